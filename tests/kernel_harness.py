"""Drive a real IPython kernel from tests, notebooks checks and benchmarks.

The kernel is an ordinary ``ipykernel`` process started through
``jupyter_client`` exactly as Jupyter starts one: its own session (process
group), signal-mode interrupts (SIGINT to the whole group, like the notebook's
interrupt button), ZMQ channels. It runs ``python`` (by default the interpreter
running the caller, i.e. ``.venv/bin/python``), so the kernel sees the same
installed nbaccel.

API:
    :class:`KernelSession` -- start/stop one kernel (a context manager).
        ``execute(code, timeout)`` runs a cell and returns a :class:`CellResult`;
        ``execute_answering(code, answers)`` answers the cell's input requests (pdb),
        ``wait_for_input_request()`` waits for one and leaves it unanswered;
        ``submit(code)`` + ``collect(msg_id, timeout)`` split that in two so a
        test can ``wait_for_output(msg_id, regex)`` and ``interrupt()`` a
        running cell; ``run(code)`` fails unless the cell succeeded; ``evaluate(expr)`` /
        ``evaluate_json(expr)`` read a value back; ``descendants()``,
        ``wait_for_no_descendants()``, ``assert_no_descendants()``,
        ``watch_descendants()`` (every child seen during a block) and
        ``listening_sockets()`` inspect the kernel's live child processes; ``drain(seconds)``
        reads output that arrives after its cell finished (a background run's) into that
        cell's :class:`CellResult`, by parent header, as a notebook front end routes it.
        ``stop()`` shuts the kernel down and kills anything it left behind;
        ``restart()`` gives a fresh kernel (e.g. after a :class:`CellTimeout`, see ``busy``).
    :class:`CellResult` -- status, per-name stream text, MIME bundles of
        display_data / execute_result messages, and the :class:`CellError`.
    :class:`CellTimeout` -- a cell did not finish in time (carries the partial
        :class:`CellResult`).
    :func:`isolated_env` -- env overrides for a hermetic kernel (no NBACCEL_*, no user config).
    :func:`wait_gone` -- wait until given processes (e.g. recorded workers) are gone,
        orphans included; :func:`describe_processes` formats them for messages.

Example:
    >>> from kernel_harness import KernelSession  # doctest: +SKIP
    >>> with KernelSession() as kernel:  # doctest: +SKIP
    ...     kernel.execute("x = 20").raise_for_error()
    ...     cell = kernel.execute("print(x + 1); x * 2")
    ...     cell.stdout, cell.text
    ('21\\n', '40')
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import queue
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from waits import HANG_GUARD_S

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_KERNEL_NAME = "nbaccel-test-python"


def strip_ansi(text: str) -> str:
    """Remove terminal colour codes (IPython colours tracebacks)."""
    return _ANSI.sub("", text)


@dataclass
class CellError:
    """The ``error`` output of a cell: exception name, value and traceback lines."""

    ename: str
    evalue: str
    traceback: list[str]

    @property
    def text(self) -> str:
        """The whole traceback as plain text (ANSI codes removed)."""
        return strip_ansi("\n".join(self.traceback))


@dataclass
class CellResult:
    """Everything one executed cell produced, in arrival order.

    Attributes:
        code: the cell source.
        status: ``"ok"``, ``"error"`` or ``"aborted"`` (from the execute_reply).
        streams: stream name (``"stdout"``/``"stderr"``) -> concatenated text.
        stream_chunks: ``(name, text)`` for every stream message, in order.
        outputs: display_data / update_display_data / execute_result /
            clear_output messages as ``{"msg_type", "data", "metadata", ...}``.
        error: the error output, if the cell raised.
        elapsed: seconds from submission to the kernel going idle.
        reply: the raw execute_reply content (``user_expressions`` etc.).
    """

    code: str
    status: str = "unknown"
    streams: dict[str, str] = field(default_factory=dict)
    stream_chunks: list[tuple[str, str]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    error: CellError | None = None
    elapsed: float = 0.0
    reply: dict[str, Any] = field(default_factory=dict)

    @property
    def stdout(self) -> str:
        return self.streams.get("stdout", "")

    @property
    def stderr(self) -> str:
        return self.streams.get("stderr", "")

    @property
    def result(self) -> dict[str, Any] | None:
        """The MIME bundle of the cell's ``execute_result`` (its last expression), if any."""
        for out in self.outputs:
            if out["msg_type"] == "execute_result":
                return dict(out["data"])
        return None

    @property
    def text(self) -> str | None:
        """``text/plain`` of the execute_result, if any."""
        bundle = self.result
        return None if bundle is None else bundle.get("text/plain")

    def displays(self, mime: str | None = None) -> list[dict[str, Any]]:
        """MIME bundles of display_data/update_display_data outputs (optionally having ``mime``)."""
        return [
            dict(out["data"])
            for out in self.outputs
            if out["msg_type"] in ("display_data", "update_display_data")
            and (mime is None or mime in out["data"])
        ]

    def raise_for_error(self) -> CellResult:
        """Raise ``AssertionError`` with the cell's output if it did not succeed; else return self."""
        if self.status != "ok" or self.error is not None:
            raise AssertionError(f"cell failed ({self.status}):\n{self.describe()}")
        return self

    def describe(self) -> str:
        """A readable dump of the cell (source, streams, error) for assertion messages."""
        parts = [f"--- code ---\n{self.code}"]
        for name, text in self.streams.items():
            parts.append(f"--- {name} ---\n{text}")
        if self.error is not None:
            parts.append(
                f"--- error {self.error.ename}: {self.error.evalue} ---\n{self.error.text}"
            )
        return "\n".join(parts)


# Every wait here is for an event (a cell going idle, a line printed, the kernel
# answering): a caller's ``timeout`` is raised to the hang guard (waits.HANG_GUARD_S), never
# a speed bound (the slow-machine rehearsal passed 60 s cell bounds on a loaded machine;
# issue 49).


def _guard(timeout: float) -> float:
    return max(timeout, HANG_GUARD_S)


class CellTimeout(AssertionError):
    """A cell did not finish within its time bound; ``.partial`` holds what arrived."""

    def __init__(self, timeout: float, partial: CellResult) -> None:
        self.partial = partial
        super().__init__(f"cell did not finish within {timeout}s\n{partial.describe()}")


def _live(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


def wait_gone(procs: list[psutil.Process], timeout: float = 5.0) -> list[psutil.Process]:
    """Poll until none of ``procs`` is alive (pid reuse is detected); return the survivors.

    Works for any process, not only children: use it to catch workers that were
    re-parented (orphaned) instead of exiting.
    """
    deadline = time.monotonic() + timeout
    while True:
        alive = _live(procs)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


#: a cell's function for the hang tests: rank 1 waits for the test's flag file while rank 0
#: waits in ``all_reduce`` (the kernel needs os, time, torch and Accelerator imported)
WAITS_FOR_FLAG = """
def waits(flag):
    import torch.distributed as dist
    accelerator = Accelerator(cpu=True)
    value = torch.ones(1)
    if accelerator.process_index == 1:
        while not os.path.exists(flag): time.sleep(0.05)
    dist.all_reduce(value)
    return value.item()
"""


def isolated_env(cache_dir: str | os.PathLike[str]) -> dict[str, str | None]:
    """``env`` overrides for a hermetic test kernel (pass to :class:`KernelSession`).

    Drops every ``NBACCEL_*`` variable of the caller and points ``XDG_CACHE_HOME``
    at ``cache_dir`` so that a developer's saved nbaccel config file is not read. No fork
    server (``NBACCEL_FORK_SERVER=0``): on a GPU machine a kernel would take one at its first
    launch, one more descendant; the tests of the server set it themselves.
    """
    env: dict[str, str | None] = {key: None for key in os.environ if key.startswith("NBACCEL_")}
    env["XDG_CACHE_HOME"] = os.fspath(cache_dir)
    env["NBACCEL_FORK_SERVER"] = "0"
    return env


def describe_processes(procs: list[psutil.Process]) -> str:
    """``pid: cmdline`` lines for assertion messages."""
    lines = []
    for proc in procs:
        try:
            lines.append(f"{proc.pid}: {' '.join(proc.cmdline()[:6])} ({proc.status()})")
        except psutil.Error:
            lines.append(f"{proc.pid}: <gone>")
    return "\n".join(lines)


class KernelSession:
    """One real IPython kernel, started with ``python -m ipykernel_launcher``.

    Args:
        python: interpreter that runs the kernel (default: ``sys.executable``).
        cwd: working directory of the kernel (default: the caller's).
        env: environment overrides; a value of ``None`` removes the variable.
        startup_timeout: seconds to wait for the kernel to answer.
    """

    def __init__(
        self,
        python: str | os.PathLike[str] | None = None,
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str | None] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        self.python = str(python or sys.executable)
        self.cwd = str(cwd or os.getcwd())
        self.env_overrides = dict(env or {})
        self.startup_timeout = startup_timeout
        self._km: KernelManager | None = None
        self._kc: Any = None
        self._spec_dir: str | None = None
        self._pending: dict[str, CellResult] = {}
        self._started_at: dict[str, float] = {}
        self._idle: set[str] = set()
        self._replies: dict[str, dict[str, Any]] = {}
        self._cells: dict[str, CellResult] = {}  # every cell submitted, for late output

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> KernelSession:
        """Start the kernel and wait until it answers a ``kernel_info`` request."""
        if self._km is not None:
            return self
        self._spec_dir = tempfile.mkdtemp(prefix="nbaccel-kernelspec-")
        spec_path = Path(self._spec_dir, _KERNEL_NAME)
        spec_path.mkdir()
        spec = {
            "argv": [self.python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "nbaccel test kernel",
            "language": "python",
            "interrupt_mode": "signal",
            "metadata": {"debugger": False},
        }
        (spec_path / "kernel.json").write_text(json.dumps(spec))
        env = dict(os.environ)
        # debugpy warns about frozen modules on every start; it is noise in stderr.
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        for key, value in self.env_overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        # IPC sockets, not TCP: a TCP port picked free by the manager can be taken by another
        # process (a worker's rendezvous, a Ray node, a test beside) before the kernel binds
        # it, and the kernel dies at start ("Address already in use": a CI run lost a test so).
        self._km = KernelManager(
            kernel_name=_KERNEL_NAME,
            kernel_spec_manager=KernelSpecManager(kernel_dirs=[self._spec_dir]),
            transport="ipc",
            ip=str(Path(self._spec_dir, "ipc")),  # absolute: the kernel runs in another cwd
        )
        self._km.shutdown_wait_time = 4.0
        try:
            self._km.start_kernel(cwd=self.cwd, env=env)
            self._kc = self._km.client()
            self._kc.start_channels()
            self._kc.wait_for_ready(timeout=_guard(self.startup_timeout))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> list[str]:
        """Shut the kernel down; kill any descendant it left alive.

        Returns:
            ``"pid: cmdline"`` of the descendants that had to be killed (empty
            when the kernel exited cleanly with no leftovers).
        """
        leftovers: list[str] = []
        km, kc = self._km, self._kc
        self._km = self._kc = None
        if km is not None:
            tracked = self.descendants(_km=km)
            if kc is not None:
                with contextlib.suppress(Exception):
                    kc.stop_channels()
            try:
                if km.has_kernel:
                    km.shutdown_kernel(now=False)
            except Exception:
                with contextlib.suppress(Exception):
                    km.shutdown_kernel(now=True)
            alive = _live(tracked)
            if alive:
                leftovers = describe_processes(alive).splitlines()
                for proc in alive:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
                psutil.wait_procs(alive, timeout=5)
        if self._spec_dir is not None:
            shutil.rmtree(self._spec_dir, ignore_errors=True)
            self._spec_dir = None
        self._pending.clear()
        self._started_at.clear()
        self._idle.clear()
        self._replies.clear()
        self._cells.clear()
        return leftovers

    def restart(self) -> list[str]:
        """Stop (see :meth:`stop`) and start a fresh kernel; returns what ``stop`` had to kill."""
        leftovers = self.stop()
        self.start()
        return leftovers

    def __enter__(self) -> KernelSession:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        """Process id of the kernel."""
        km = self._require()
        provisioner = km.provisioner
        assert provisioner is not None and provisioner.process is not None
        return int(provisioner.process.pid)

    def is_alive(self) -> bool:
        return self._km is not None and bool(self._km.is_alive())

    # ----------------------------------------------------------------- execution
    def submit(
        self,
        code: str,
        *,
        user_expressions: Mapping[str, str] | None = None,
        allow_stdin: bool = True,
    ) -> str:
        """Send ``code`` for execution without waiting; returns the request's msg_id.

        ``allow_stdin=False`` is a front end that cannot answer ``input()`` (nbclient's way).
        """
        self._require()
        msg_id = self._kc.execute(
            code,
            user_expressions=dict(user_expressions or {}),
            stop_on_error=False,
            allow_stdin=allow_stdin,
        )
        self._pending[msg_id] = self._cells[msg_id] = CellResult(code=code)
        self._started_at[msg_id] = time.monotonic()
        return str(msg_id)

    @property
    def busy(self) -> bool:
        """True while a submitted cell has not been collected (e.g. after a :class:`CellTimeout`)."""
        return bool(self._pending)

    def _pump(self, deadline: float, done: Any, waiting_for: CellResult, timeout: float) -> None:
        # Route iopub messages to their pending cells until ``done()`` or the deadline.
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CellTimeout(timeout, waiting_for)
            try:
                msg = self._kc.get_iopub_msg(timeout=min(remaining, 0.5))
            except queue.Empty:
                if not self.is_alive():
                    raise AssertionError(f"kernel died\n{waiting_for.describe()}") from None
                continue
            self._route(msg)

    def _route(self, msg: dict[str, Any]) -> None:
        parent = msg["parent_header"].get("msg_id")
        if parent in self._pending:
            if self._record(self._pending[parent], msg):
                self._idle.add(parent)
        elif parent in self._cells:  # output of a cell that finished already (a background run)
            self._record(self._cells[parent], msg)

    def drain(self, seconds: float) -> None:
        """Read output for ``seconds`` while no cell runs: late output lands in its own cell's
        :class:`CellResult` (the object ``execute``/``collect`` returned), by parent header."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = self._kc.get_iopub_msg(timeout=min(remaining, 0.2))
            except queue.Empty:
                continue
            self._route(msg)

    def wait_for_output(
        self, msg_id: str, pattern: str, *, count: int = 1, timeout: float = 30.0
    ) -> CellResult:
        """Wait until the running cell ``msg_id`` printed ``count`` lines matching regex ``pattern``.

        Looks at stdout and stderr together; returns the (partial) :class:`CellResult`.

        Raises:
            CellTimeout: not enough matching output in time (or the cell finished first).
        """
        result = self._pending[msg_id]
        regex = re.compile(pattern, re.MULTILINE)
        timeout = _guard(timeout)

        def enough() -> bool:
            text = "".join(chunk for _, chunk in result.stream_chunks)
            if len(regex.findall(text)) >= count:
                return True
            if msg_id in self._idle:
                raise AssertionError(
                    f"cell finished before printing {count} x {pattern!r}\n{result.describe()}"
                )
            return False

        self._pump(time.monotonic() + timeout, enough, result, timeout)
        return result

    def collect(self, msg_id: str, timeout: float = 60.0) -> CellResult:
        """Wait (at most ``timeout`` s) for the cell ``msg_id`` to finish and return its output.

        Raises:
            CellTimeout: the kernel did not go idle for this cell in time.
        """
        result = self._pending[msg_id]
        timeout = _guard(timeout)
        deadline = time.monotonic() + timeout
        self._pump(deadline, lambda: msg_id in self._idle, result, timeout)
        # The reply may arrive on the shell channel slightly before or after idle.
        while msg_id not in self._replies:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CellTimeout(timeout, result)
            try:
                reply = self._kc.get_shell_msg(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            self._replies[reply["parent_header"].get("msg_id")] = dict(reply["content"])
        result.reply = self._replies.pop(msg_id)
        result.status = str(result.reply.get("status", "unknown"))
        result.elapsed = time.monotonic() - self._started_at.pop(msg_id)
        self._idle.discard(msg_id)
        del self._pending[msg_id]
        return result

    def execute(
        self,
        code: str,
        timeout: float = 60.0,
        *,
        user_expressions: Mapping[str, str] | None = None,
    ) -> CellResult:
        """Run one cell and return its :class:`CellResult` (the cell may have failed)."""
        return self.collect(self.submit(code, user_expressions=user_expressions), timeout)

    def execute_answering(
        self, code: str, answers: list[str], timeout: float = 60.0
    ) -> tuple[CellResult, list[str]]:
        """Run a cell that asks for input (``input()``, a pdb prompt), answering the kernel's
        input requests in order with ``answers``, as a person typing would.

        Returns the cell and the prompts of the input requests. Raises ``AssertionError``
        when the cell asks more often than there are answers (the cell is left waiting).
        """
        msg_id = self.submit(code)
        result, prompts, left = self._pending[msg_id], [], list(answers)
        deadline = time.monotonic() + timeout
        while msg_id not in self._idle:
            if time.monotonic() > deadline:
                raise CellTimeout(timeout, result)
            with contextlib.suppress(queue.Empty):
                msg = self._kc.get_stdin_msg(timeout=0.02)
                if msg["msg_type"] == "input_request":
                    prompts.append(msg["content"]["prompt"])
                    if not left:
                        raise AssertionError(
                            f"unexpected input request {prompts[-1]!r} after answering "
                            f"{answers}\n{result.describe()}"
                        )
                    self._kc.input(left.pop(0))
            with contextlib.suppress(queue.Empty):
                msg = self._kc.get_iopub_msg(timeout=0.02)
                parent = msg["parent_header"].get("msg_id")
                if parent in self._pending and self._record(self._pending[parent], msg):
                    self._idle.add(parent)
        return self.collect(msg_id, max(deadline - time.monotonic(), 1.0)), prompts

    def wait_for_input_request(self, timeout: float = 60.0) -> str:
        """Wait for the running cell's next input request (a pdb prompt) and return its
        prompt, leaving it unanswered (to press the interrupt button at the prompt)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                msg = self._kc.get_stdin_msg(timeout=0.1)
                if msg["msg_type"] == "input_request":
                    return str(msg["content"]["prompt"])
        raise AssertionError(f"no input request within {timeout}s")

    def run(self, code: str, timeout: float = 60.0) -> CellResult:
        """Like :meth:`execute` but raise ``AssertionError`` if the cell did not succeed."""
        return self.execute(code, timeout).raise_for_error()

    def evaluate(self, expression: str, timeout: float = 30.0) -> str:
        """Return the ``text/plain`` repr of ``expression`` evaluated in the kernel."""
        cell = self.execute("", timeout, user_expressions={"value": expression})
        value = cell.reply.get("user_expressions", {}).get("value", {})
        if value.get("status") != "ok":
            raise AssertionError(
                f"evaluating {expression!r} failed: {value.get('ename')}: {value.get('evalue')}"
            )
        return str(value["data"]["text/plain"])

    def evaluate_json(self, expression: str, timeout: float = 30.0) -> Any:
        """Evaluate ``expression`` in the kernel and return it decoded from JSON."""
        text = self.evaluate(f"__import__('json').dumps({expression})", timeout)
        return json.loads(ast.literal_eval(text))

    def interrupt(self) -> None:
        """Press the interrupt button: SIGINT to the kernel's process group."""
        self._require().interrupt_kernel()

    # ----------------------------------------------------------------- processes
    def descendants(self, *, _km: KernelManager | None = None) -> list[psutil.Process]:
        """The kernel's live (non-zombie) descendant processes, recursively."""
        km = _km or self._km
        if km is None or km.provisioner is None or km.provisioner.process is None:
            return []
        try:
            kernel = psutil.Process(km.provisioner.process.pid)
            return _live(kernel.children(recursive=True))
        except psutil.Error:
            return []

    def wait_for_no_descendants(
        self, timeout: float = 5.0, *, sparing: frozenset[int] = frozenset()
    ) -> list[psutil.Process]:
        """Poll until the kernel has no live descendants; return those still alive at the end.

        Processes ending is an event: ``timeout`` is raised to the hang guard (a leaked
        process never ends, so a leak still fails; a slow machine's late exit does not)."""
        deadline = time.monotonic() + _guard(timeout)
        while True:
            alive = [p for p in self.descendants() if p.pid not in sparing]
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.05)

    def assert_no_descendants(self, timeout: float = 5.0) -> None:
        """Fail (``AssertionError``) if the kernel still has live child processes after ``timeout``."""
        alive = self.wait_for_no_descendants(timeout)
        if alive:
            raise AssertionError(
                f"kernel {self.pid} still has child processes after {_guard(timeout)}s:\n"
                + describe_processes(alive)
            )

    def wait_for_descendants(self, count: int, timeout: float = 30.0) -> list[psutil.Process]:
        """Poll until the kernel has at least ``count`` live descendants; return them."""
        timeout = _guard(timeout)  # processes starting is an event, not a speed
        deadline = time.monotonic() + timeout
        while True:
            alive = self.descendants()
            if len(alive) >= count:
                return alive
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"expected {count} child processes of the kernel within {timeout}s, "
                    f"saw:\n{describe_processes(alive)}"
                )
            time.sleep(0.05)

    @contextlib.contextmanager
    def watch_descendants(self, interval: float = 0.05) -> Iterator[dict[int, psutil.Process]]:
        """Record every descendant of the kernel seen while the block runs (polled in a thread).

        Yields a dict ``pid -> psutil.Process`` that fills up as processes appear;
        pass its values to :func:`wait_gone` afterwards to prove they all exited
        (a re-parented orphan is no longer a descendant, but is still caught).
        Very short-lived processes can slip between two polls.
        """
        seen: dict[int, psutil.Process] = {}
        stop = threading.Event()

        def poll() -> None:
            while True:
                for proc in self.descendants():
                    seen.setdefault(proc.pid, proc)
                if stop.wait(interval):
                    return

        thread = threading.Thread(target=poll, name="kernel-descendant-watch", daemon=True)
        thread.start()
        try:
            yield seen
        finally:
            stop.set()
            thread.join()

    def connection_info(self) -> dict[str, Any]:
        """The kernel's connection info (transport, ip, ports), as its manager wrote it."""
        return dict(self._require().get_connection_info())

    def listening_sockets(self, include_kernel: bool = False) -> list[tuple[int, str, int]]:
        """``(pid, ip, port)`` of every TCP socket in LISTEN state held by the kernel's descendants.

        The kernel itself (its ZMQ ports) is left out unless ``include_kernel``.
        """
        procs = self.descendants()
        if include_kernel:
            procs = [psutil.Process(self.pid), *procs]
        found = []
        for proc in procs:
            try:
                conns = proc.net_connections(kind="tcp")
            except psutil.Error:
                continue
            for conn in conns:
                if conn.status == psutil.CONN_LISTEN and conn.laddr:
                    found.append((proc.pid, conn.laddr.ip, conn.laddr.port))
        return found

    # ----------------------------------------------------------------- internals
    def _require(self) -> KernelManager:
        if self._km is None:
            raise RuntimeError("the kernel is not running: call start() first")
        return self._km

    @staticmethod
    def _record(result: CellResult, msg: dict[str, Any]) -> bool:
        kind = msg["msg_type"]
        content = msg["content"]
        if kind == "status":
            return content.get("execution_state") == "idle"
        if kind == "stream":
            name, text = content["name"], content["text"]
            result.stream_chunks.append((name, text))
            result.streams[name] = result.streams.get(name, "") + text
        elif kind in ("display_data", "update_display_data", "execute_result"):
            result.outputs.append(
                {
                    "msg_type": kind,
                    "data": content.get("data", {}),
                    "metadata": content.get("metadata", {}),
                    "transient": content.get("transient", {}),
                }
            )
        elif kind == "clear_output":
            result.outputs.append({"msg_type": kind, "data": {}, "wait": content.get("wait")})
        elif kind == "error":
            result.error = CellError(
                content.get("ename", ""), content.get("evalue", ""), list(content["traceback"])
            )
        return False


def module_kernel(tmp_path_factory: Any, setup: str) -> Iterator[KernelSession]:
    """A kernel for one test module: started in a fresh folder, ``setup`` run, then stopped.

    Example (a module-scoped fixture)::

        @pytest.fixture(scope="module")
        def kernel(tmp_path_factory):
            yield from module_kernel(tmp_path_factory, SETUP)
    """
    workdir = tmp_path_factory.mktemp("kernel")
    session = KernelSession(cwd=workdir, env=isolated_env(workdir))
    session.start()
    try:
        session.run(setup, timeout=120)
        yield session
    finally:
        session.stop()


__all__ = [
    "CellError",
    "CellResult",
    "CellTimeout",
    "KernelSession",
    "describe_processes",
    "isolated_env",
    "module_kernel",
    "strip_ansi",
    "wait_gone",
]
