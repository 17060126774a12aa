"""``notebook_launcher``: run a training function on every device from a live kernel.

A launch is "check, then launch": :mod:`~nbaccel.launch.start._preflight` raises any problem
before a process exists; one blocking process runs the function in the kernel itself (on a
TPU never: the backend's processes are workers); otherwise a one-shot group of workers
(:mod:`~nbaccel.launch.start._start`) gets the function as its one job, supervised as a pool's
(:mod:`~nbaccel.launch.engine._supervisor`); ``max_restarts`` starts a fresh group after a failure.

Example:
    >>> from nbaccel import notebook_launcher
    >>> def train(scale):
    ...     import os
    ...     return int(os.environ["RANK"]) * scale
    >>> notebook_launcher(train, args=(10,), num_processes=2)  # doctest: +SKIP
    0
    >>> notebook_launcher(train, args=(10,), num_processes=2, return_all_ranks=True)  # doctest: +SKIP
    [0, 10]
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..config import LaunchConfig, install_launch_config, installed_launch_config
from ..config.choices import PrecisionType, RdzvBackendType
from ..config.keywords import LaunchKeywords, documented, split
from ..config.options import START
from ..errors import LaunchError, Stopped, WorkerError, WorkerTimeoutError, named_rank
from ..platform import environment
from ..platform.process_env import (
    EnvironmentSnapshot,
    install_process_facts,
    installed_process_facts,
)
from .cell._cell_output import CellOutput
from .channel._messages import Job
from .debug import _kept
from .engine._supervisor import JobFailed, Supervisor
from .engine._tidy import add_hint, clean, warn_oversubscribed
from .handle import LaunchHandle, already_running, running_from
from .start._preflight import LaunchPlan, plan_launch, plan_script
from .start._start import rank_environment, start_group

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack


# Accelerate's parameters are written out: they may be passed positionally, in
# Accelerate's order. nbaccel's own are keyword-only, typed for mypy and IDEs by a TypedDict
# (PEP 692); @documented shows all of them, with their defaults, to help() and inspect.
# Each option's default, help and validation are written once, in nbaccel.config (see
# nbaccel.config.keywords); tests/config/test_options.py fails when they drift apart.
@documented(LaunchKeywords)
def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: PrecisionType | None = None,
    use_port: int | str | None = START.use_port,
    master_addr: str | None = None,
    node_rank: int | None = None,
    num_nodes: int | None = None,
    rdzv_backend: RdzvBackendType = START.rdzv_backend,
    rdzv_endpoint: str = START.rdzv_endpoint,
    rdzv_conf: dict[str, Any] | None = START.rdzv_conf,
    rdzv_id: str = START.rdzv_id,
    max_restarts: int | None = None,
    monitor_interval: float = START.monitor_interval,
    log_line_prefix_template: str | None = START.log_line_prefix_template,
    **options: Unpack[LaunchKeywords],
) -> Any:
    """Run ``function(*args)`` once per device and return rank 0's result.

    The positional parameters are Accelerate's, in its order; nbaccel's own are
    keyword-only. A setting left at ``None`` comes from the ``NBACCEL_*`` environment, the
    config file or its default (shown); one you pass always wins, also when it equals the
    default. Every argument is checked before any process starts.

    Args:
        function: the training function (define the model, data and ``Accelerator``
            inside it). Pass the function itself, not ``function()``.
        args: positional arguments for ``function``.
        {options}

    Returns:
        Rank 0's return value with tensors moved to the CPU (on another node: the value
        of that node's first rank), the list of values, or a ``LaunchHandle``. A single
        blocking process runs in the kernel itself and its value is returned as it is
        (CUDA tensors stay on the GPU, in the kernel's own CUDA context).

    Raises:
        TypeError, ValueError: bad arguments, before anything is started.
        CUDAInitializedError: ``start_method="fork"`` after CUDA was initialised.
        WorkerError: a worker failed. When its exception type can be re-created in
            the kernel, the error is also an instance of that type (``except ValueError``
            works); the message names the rank and carries the remote traceback.
        WorkerTimeoutError: ranks stopped making progress (see ``timeout``, and
            ``on_hang="raise"``); names the stuck ranks (``err.stuck_ranks``) with every
            worker's stack (``err.stacks``).
        KeyboardInterrupt: the kernel was interrupted; every worker is gone.
    """
    __tracebackhide__ = True  # IPython shows the user's cell, then the error: not this frame
    # Accelerate's parameters, each passed on by name: split() sorts them by their
    # definition into settings (LaunchConfig fields: num_processes, mixed_precision,
    # master_addr, node_rank, num_nodes, max_restarts) and StartOptions (the rest).
    # tests/config/test_options.py fails when a parameter is not passed on.
    accelerate = dict(
        num_processes=num_processes, mixed_precision=mixed_precision, use_port=use_port,
        master_addr=master_addr, node_rank=node_rank, num_nodes=num_nodes,
        rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id, max_restarts=max_restarts, monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template,
    )  # fmt: skip
    settings, start, call = split(accelerate, options, LaunchKeywords, "notebook_launcher()")
    return launch(plan_launch(function, args, settings, start, call))


def launch(plan: LaunchPlan) -> Any:
    """Run a planned launch: in the kernel, or on a one-shot group of workers (TPUs too:
    the backend sets each one up); a :class:`LaunchHandle` when ``plan.call.block`` is False."""
    __tracebackhide__ = True
    _free_kept_gpu_memory(plan)
    if plan.method == "kernel":
        return _run_in_kernel(plan)
    warn_oversubscribed(plan.config, plan.num_processes or 1, stacklevel=3)  # the user's line
    started: list[Supervisor] = []
    handle = LaunchHandle(
        plan.ranks, lambda h: _attempts(plan, h, started), all_ranks=plan.call.return_all_ranks
    )
    handle.label = f"notebook_launcher({getattr(plan.function, '__name__', 'function')})"
    cell = CellOutput.here()  # captured here, in the cell's thread (see _cell_output)
    if (running := running_from(cell)) is not None:  # never two jobs from one cell unsaid
        busy = "a run started from this cell is still going"
        raise clean(LaunchError(already_running(running, busy, cell)))
    if plan.call.output is None:
        handle.cell_output = cell
    try:  # the first group starts in the calling thread (the kernel's main thread)
        started.append(_start(plan, handle))
        if not plan.call.block:
            handle.run_in_background()
            return handle
    except BaseException:
        for group in started:  # an interrupt between starting and supervising
            group.terminate()
            group.close()
        raise
    try:
        handle.run()
    except KeyboardInterrupt:  # the user's own interrupt: no frames of ours to read through
        raise clean(KeyboardInterrupt("the launch was interrupted; every worker is gone")) from None
    if (error := handle.exception()) is not None:  # the remote traceback is the story
        raise clean(error)
    return handle.result()


def _free_kept_gpu_memory(plan: LaunchPlan) -> None:
    """Failed ranks kept for nbaccel.debug() hold their GPU memory: a GPU launch ends them."""
    if plan.config.compute_device == "cpu" or not _kept.holding_any():
        return  # first the cheap checks: counting GPUs may start a process (no NVML)
    if environment.gpu_count() == 0:
        return
    for what in _kept.make_room():
        sys.stderr.write(
            f"nbaccel: {what}, kept for nbaccel.debug(), ended now so that this launch has "
            "its GPU memory (call nbaccel.debug() before launching again to look at it).\n"
        )


def _attempts(
    plan: LaunchPlan, handle: LaunchHandle, started: list[Supervisor], job: Job | None = None
) -> dict[int, Any]:
    """One group of workers per attempt, ``max_restarts`` more after a failure: the one
    restart loop of every launch (``job``: another than the plan's function, a script).
    A restart is said in the cell: what failed (a lost node: which), when the new group
    started and, when rank 0 loads a checkpoint, which one and how long after the failure
    (on a cluster the new group may first wait for nodes: :mod:`.start.cluster`)."""
    restart: _Restart | None = None
    while True:
        group = started.pop() if started else _start(plan, handle, job, restart)
        handle.supervisor = group
        if restart is not None:
            restart.say(
                f"attempt {handle.attempt} started, {restart.seconds():.1f}s after the failure"
            )
        kept = last = False
        try:
            want = job.want if job is not None else _wanted(plan)
            return group.run_job(1, plan.ranks, want, handle.stop_requested)
        except JobFailed as failed:
            err = failed.error
            last = isinstance(err, (Stopped, KeyboardInterrupt)) or (
                handle.attempt >= plan.config.max_restarts or handle.stop_requested.is_set()
            )
            if last:  # for nbaccel.debug(): with debug=True the failed ranks stay
                kept = _kept.after_launch(group, err, plan.debug_timeout)
                add_hint(err, kept=plan.debug_timeout is not None)
        finally:
            if not kept:
                group.terminate()
                group.close()
        if last:
            raise err
        handle.attempt += 1
        restart = _Restart(plan, handle)
        _announce_restart(plan, handle.attempt, err, handle.cell_output)


class _Restart:
    """One restart's clock and its lines in the cell (rank 0's checkpoint load said once)."""

    def __init__(self, plan: LaunchPlan, handle: LaunchHandle) -> None:
        self.plan, self.handle, self.attempt = plan, handle, handle.attempt
        self.began = time.monotonic()
        self.resumed = False

    def seconds(self) -> float:
        return time.monotonic() - self.began

    def say(self, text: str) -> None:
        _say(self.plan, self.handle.cell_output, f"nbaccel: {text}\n")

    def on_event(self, rank: int, kind: str, data: dict) -> None:
        self.handle.on_event(rank, kind, data)
        if kind == "checkpoint_loaded" and rank == self.plan.ranks[0] and not self.resumed:
            self.resumed = True
            self.say(
                f"attempt {self.attempt} resumed from {data.get('path')} (step "
                f"{data.get('at_step')}), {self.seconds():.1f}s after the failure"
            )


def _wanted(plan: LaunchPlan) -> set[int]:
    return set(plan.ranks) if plan.call.return_all_ranks else {plan.ranks[0]}


def _start(
    plan: LaunchPlan, handle: LaunchHandle, job: Job | None = None, restart: _Restart | None = None
) -> Supervisor:
    want = _wanted(plan)
    if job is None and plan.method == "fork":  # inherited through the fork: nothing is pickled
        job = Job(1, "call", want, (plan.function, plan.args, {}))
    elif job is None:
        job = Job(1, "run", want, (plan.payload,))
    return start_group(
        plan,
        on_event=handle.on_event if restart is None else restart.on_event,
        round_=handle.attempt,
        first_job=job,
        output=handle.cell_output or plan.call.output,
        say=lambda text: _say(plan, handle.cell_output, text),
        replace_wait=plan.config.replace_timeout if restart is not None else None,
    )


def _announce_restart(plan: LaunchPlan, attempt: int, err: BaseException, cell: Any) -> None:
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    text = (
        f"nbaccel: workers failed ({first}); restarting, attempt {attempt} of "
        f"{plan.config.max_restarts}\n"
    )
    _say(plan, cell, text)


def _say(plan: LaunchPlan, cell: Any, text: str) -> None:
    """A line of the launcher's own in the launching cell (its stderr), or the call's output."""
    output: Any = plan.call.output
    if output is None:  # the launching cell's, from this background thread too
        output = cell.streams()[1] if cell is not None else sys.stderr
    with contextlib.suppress(Exception):
        if hasattr(output, "write"):
            output.write(text)
        else:  # output(rank, stream, line)
            output(plan.ranks[0], "stderr", text.rstrip("\n"))


def debug_launcher(
    function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: int = 2
) -> Any:
    """Run ``function`` on ``num_processes`` CPU processes over loopback (gloo).

    For trying distributed code on a laptop: ignores GPUs, the environment and the
    config file. Returns rank 0's value.

    Example:
        >>> def check():
        ...     import torch.distributed as dist
        ...     from nbaccel.state import get_state
        ...     return get_state().world_size
        >>> debug_launcher(check)  # doctest: +SKIP
        2
    """
    config = LaunchConfig(compute_device="cpu", num_processes=num_processes)
    return notebook_launcher(function, args, num_processes=num_processes, config=config)


@contextlib.contextmanager
def patched_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` for the launch; afterwards the environment is exactly as before.

    Example:
        >>> with patched_environ({"NBACCEL_DOC": "1"}):
        ...     os.environ["NBACCEL_DOC"]
        '1'
    """
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in saved]:
            del os.environ[key]
        for key, old in saved.items():
            if os.environ.get(key) != old:
                os.environ[key] = old


def _run_in_kernel(plan: LaunchPlan) -> Any:
    """One process: call the function right here, as rank 0 of 1."""
    __tracebackhide__ = True  # an error shows the user's cell, then the function's frames
    env = {**plan.env, **rank_environment(0, 0, world_size=1, local_world_size=1, node_rank=0)}
    cfg = plan.config
    facts = EnvironmentSnapshot(
        use_cpu=cfg.compute_device == "cpu", timeout=cfg.timeout, debug=cfg.debug
    )
    state = sys.modules.get("nbaccel.runtime.process.state")
    had_state = state is not None and state.current_state() is not None
    saved = installed_launch_config(), installed_process_facts()
    install_launch_config(cfg)  # this process's launch state for the length of the run
    install_process_facts(facts)
    try:
        with patched_environ(env):
            value = plan.function(*plan.args)
    finally:
        install_launch_config(saved[0])
        install_process_facts(saved[1])
        state = sys.modules.get("nbaccel.runtime.process.state")
        if state is not None and not had_state:
            state.reset_state()  # leave the kernel as found: no Accelerator state behind
    return [value] if plan.call.return_all_ranks else value


def run_script(cfg: LaunchConfig, command: list[str]) -> int:
    """``nbaccel launch``: ``command`` (``[-m] script_or_module args...``) as ``__main__``
    on ``cfg``'s processes, the same engine with a ``script`` job; returns the exit code
    (the first real failure's: the script's own, 1 for an exception, 128 + N after
    signal N) and says on stderr which rank failed.

    Example:
        >>> run_script(LaunchConfig(num_processes=2), ["train.py", "--lr", "3e-4"])  # doctest: +SKIP
        0
    """
    plan = plan_script(cfg)
    job = Job(1, "script", set(), (list(command),))
    handle = LaunchHandle(plan.ranks, lambda h: _attempts(plan, h, [], job))
    try:
        handle.run()
    except KeyboardInterrupt:
        return 130
    error = handle.exception()
    if error is not None and handle.supervisor is None:  # no group started: a bad setting,
        raise error  # said as the command's other errors are (a busy port: exit code 2)
    return 0 if error is None else _exit_code(error)


def _exit_code(error: BaseException) -> int:
    if isinstance(error, KeyboardInterrupt):
        return 130
    if isinstance(error, WorkerTimeoutError):  # every stuck rank's stack: only here
        print(f"nbaccel launch: {error}", file=sys.stderr)
        return 1
    if isinstance(error, WorkerError):
        code = error.exit_code or 1
        if error.exc_type in ("SystemExit", "ExitCode") or error.exc_type.startswith("SIG"):
            detail = f"exited with code {code}"
        else:  # the traceback is on stderr already, as python prints it
            detail = f"failed with {error.exc_type}: {error.message.splitlines()[0] if error.message else ''}"
        who = named_rank(error.rank, error.pid, error.node, with_pid=True)
        print(f"nbaccel launch: {who} {detail}", file=sys.stderr)
        return code
    print(f"nbaccel launch: {error}", file=sys.stderr)
    return 1


__all__ = [
    "LaunchHandle",
    "WorkerTimeoutError",
    "debug_launcher",
    "notebook_launcher",
    "run_script",
]
