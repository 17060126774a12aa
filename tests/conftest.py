"""Fixtures shared by the whole suite.

Autouse fixtures restore the environment and working directory, destroy any
process group a test left behind, and fail a test that leaks child processes.

The pytest process makes itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``):
a grandchild whose parent died is re-parented to pytest rather than to init, so the
leak check sees it. Re-parented orphans that have exited are reaped here (the job
init would do); a zombie that a test's own ``Popen``/``multiprocessing.Process``
never waited for counts as a leak.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

import psutil
import pytest

_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


SUBREAPER = _become_subreaper()


def _owned_pids() -> set[int]:
    """Children some Python object still owns (and so is responsible for waiting on)."""
    import multiprocessing.process

    owned = {p.pid for p in getattr(multiprocessing.process, "_children", ()) if p.pid}
    with warnings.catch_warnings():
        # isinstance() on every live object touches deprecated aliases such as
        # torch.distributed.reduce_op, which warn when looked at
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, subprocess.Popen) and obj.returncode is None:
                owned.add(obj.pid)
    return owned


def _reap_orphans() -> None:
    """Reap exited children that nobody owns: orphans re-parented to us as subreaper."""
    zombies = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.status() == psutil.STATUS_ZOMBIE:
                zombies.append(child.pid)
    if not zombies:
        return
    owned = _owned_pids()
    for pid in zombies:
        if pid not in owned:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _children() -> dict[int, str]:
    """Every descendant (grandchildren included), zombies marked as such."""
    _reap_orphans()
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                out[child.pid] = f"<zombie: exited, never waited for> {child.name()}"
                continue
            out[child.pid] = " ".join(child.cmdline()[:4])
        except psutil.Error:
            continue
    return out


@pytest.fixture(autouse=True)
def _restore_process_state():
    env = dict(os.environ)
    cwd = os.getcwd()
    before = set(_children())
    yield
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    try:
        import sys

        if "torch.distributed" in sys.modules:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    except Exception:
        pass
    _fail_on_leaks(before, "test", spare=_rays_pool_worker)


def _rays_pool_worker(cmd: str) -> bool:
    """A worker of a Ray node's pool that holds no task or actor: named ``ray::IDLE``, or not
    named yet (``default_worker.py``). A module's raylet starts and ends these as it likes,
    seconds after a test (after a killed actor: more on a loaded machine), so they are the
    cluster's, checked with the module; what a test could leak on a cluster is an actor
    (``ray::RankHost...``) or an nbaccel worker (``spawn_main``), still caught here."""
    return cmd.startswith("ray::IDLE") or "ray/_private/workers/default_worker.py" in cmd


@pytest.fixture(autouse=True, scope="module")
def _no_process_outlives_its_module():
    """What a module's fixtures started (a kernel, a server, a Ray cluster) ends with the
    module: the per-test check cannot see them, as they outlive every test of the module.
    Autouse, so set up before and torn down after every fixture of the module's own (a
    Ray head's client server, re-parented to pytest, once outlived its cluster's stop and
    then failed another module's "no child left" check)."""
    before = set(_children())
    yield
    _fail_on_leaks(before, "module's fixtures")


def _fail_on_leaks(
    before: set[int], who: str, spare: Callable[[str], bool] = lambda cmd: False
) -> None:
    """Fail if a descendant not in ``before`` (nor ``spare``d by its command line) is still
    there after a short grace period (workers get one to exit), killing it so that it
    cannot fail the next check too."""
    deadline = time.monotonic() + 5
    leaked = {}
    while time.monotonic() < deadline:
        leaked = {
            pid: cmd for pid, cmd in _children().items() if pid not in before and not spare(cmd)
        }
        if not leaked:
            break
        time.sleep(0.1)
    if leaked:
        procs = []
        for pid in leaked:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
                procs[-1].kill()
        psutil.wait_procs(procs, timeout=5)  # reaps them (children, or orphans re-parented)
        pytest.fail(f"{who} left child processes running (or unwaited): {leaked}")


@pytest.fixture(autouse=True, scope="module")
def _forget_accelerator_state():
    """After each module: no Accelerator state left in this process for the next module.

    A test that creates an ``Accelerator`` in the pytest process leaves its cached process
    state behind, and a later launch then refuses to start ("an Accelerator was already
    created in this kernel"). Run one after the other, some module in between happened to
    reset it; in pytest-xdist workers (scripts/test.sh) each worker runs only some of the
    modules, so every module starts without another's state.
    """
    yield
    state = sys.modules.get("nbaccel.runtime.process.state")
    if state is not None:
        state.reset_state()


@pytest.fixture
def kernel_sigint():
    """SIGINT handled as in a kernel's cell: it raises ``KeyboardInterrupt``.

    ipykernel installs Python's handler for each cell it runs, whatever the kernel
    inherited. A test that presses "the interrupt button" by sending SIGINT to its own
    process needs the same, or it depends on how pytest was started: a background job
    (``nohup ... &``, some CI runners, ``trap "" INT``) inherits SIGINT ignored.
    """
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


# The torch matrix (scripts/test_torch_matrix.sh: the oldest torch setup.cfg claims and the
# newest release) runs the tests marked `matrix`, not the whole suite: the rest of the code
# does not change with torch's version. The rule: a test is `matrix` when it exercises a
# torch API whose behaviour has changed between torch releases -- process groups, stores and
# collectives, DDP, FSDP2, DCP, DTensor/DeviceMesh, autocast and GradScaler, DataLoader and
# sampler internals, RNG state, torch.load/save, the profiler and flight recorder, dynamo --
# or a branch on torch's version (nbaccel.platform.torchcompat). Tests of nbaccel's own logic
# (supervision, messages, output, debugging, pools' bookkeeping, config, CLI, UI, files) run
# on the dev torch only. Whole modules are listed here; a test elsewhere can carry
# @pytest.mark.matrix itself. tests/test_torch_matrix.py keeps this list and the README's
# rule in step.
MATRIX_MODULES = (
    "tests/checkpoint/test_checkpoint.py",
    "tests/checkpoint/test_fsdp_checkpoint.py",
    "tests/checkpoint/test_resume_patterns.py",
    "tests/checkpoint/test_who_saves.py",
    "tests/launch/test_hang_watchdog.py",
    "tests/launch/test_launcher.py",
    "tests/launch/test_pool.py",
    "tests/launch/test_pool_fsdp.py",
    "tests/launch/test_preload.py",
    "tests/launch/test_rendezvous.py",
    "tests/platform/test_cudafork.py",
    "tests/platform/test_forksafe.py",
    "tests/platform/test_torchcompat.py",
    "tests/runtime/test_accelerator.py",
    "tests/runtime/test_accumulation.py",
    "tests/runtime/test_clipping.py",
    "tests/runtime/test_data.py",
    "tests/runtime/test_ddp_features.py",
    "tests/runtime/test_dispatch.py",
    "tests/runtime/test_fsdp.py",
    "tests/runtime/test_gather_dtypes.py",
    "tests/runtime/test_ops.py",
    "tests/runtime/test_packed_gather.py",
    "tests/runtime/test_parity.py",
    "tests/runtime/test_precision.py",
    "tests/runtime/test_rank_check.py",
    "tests/runtime/test_reproducibility.py",
    "tests/runtime/test_state.py",
    "tests/runtime/test_state_cuda.py",
    "tests/runtime/test_step_path.py",
)


# The longest test files, longest first (durations of a whole run on 2 cores; a file is one
# unit of work for pytest-xdist's --dist loadfile). They are collected first, so the two
# workers start on them and the short files fill in at the end: when a long file is handed
# out last, one worker runs it alone while the other idles (the order changes no outcome).
LONGEST_FIRST = (
    "tests/scripts/test_real_scripts.py",
    "tests/cluster/test_cluster_kernel.py",
    "tests/cli/test_cli.py",
    "tests/test_notebooks.py",
    "tests/test_binder.py",
    "tests/scripts/test_same_numbers.py",
    "tests/ui/test_browser.py",
    "tests/parallel/test_mesh_training.py",
    "tests/test_gpu_check_script.py",
    "tests/docs/test_docs_site.py",
    "tests/test_conftest.py",
    "tests/scripts/test_nd_parallel.py",
    "tests/cli/test_launch_hang.py",
    "tests/launch/test_kernel_deepspeed.py",
    "tests/launch/test_launcher.py",
    "tests/tracking/test_trackers.py",
    "tests/launch/test_kernel_launch.py",
    "tests/runtime/test_deepspeed.py",
    "tests/launch/test_pool_kernel.py",
    "tests/parallel/test_kernel_parallelism.py",
    "tests/launch/test_kernel_forkserver.py",
    "tests/runtime/test_accelerate_api.py",
    "tests/cli/test_launch_loopback.py",
    "tests/platform/test_os_support.py",
    "tests/ui/test_browser_user.py",
)


# Files that wait for a lane beside the main run (the xla tests for .xla-venv's set-up,
# scripts/test.sh, about 150 s into the main run): collected right after LONGEST_FIRST
# (about half the run in, the set-up long done): not first, where a worker sat waiting for
# it (31 s once), nor last, where one worker ran it alone while the other had nothing left.
WAITS_FOR_A_LANE = ("tests/launch/test_xla.py",)


def _hang_guard(config) -> float | None:
    """pytest's per-test timeout from pyproject (pytest-timeout's ``timeout``), if any."""
    try:
        return float(config.getini("timeout") or 0) or None
    except (ValueError, TypeError):  # pytest-timeout absent: nothing to lift
        return None


def pytest_collection_modifyitems(config, items):
    guard = _hang_guard(config)
    for item in items:
        if item.nodeid.split("::", 1)[0] in MATRIX_MODULES:
            item.add_marker(pytest.mark.matrix)
        # A test's own @pytest.mark.timeout(N) below the suite's hang guard is a speed bound
        # that load can pass (120-700 s marks, written on an idle machine; issue 49): it is
        # lifted to the guard, which still ends a real hang. Marks above it stay.
        marker = item.get_closest_marker("timeout")
        if guard and marker and marker.args and float(marker.args[0]) < guard:
            item.add_marker(pytest.mark.timeout(guard), append=False)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST + WAITS_FOR_A_LANE)}
    # stable: the tests of a file keep their order, and so do the files not listed
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


# Markers whose tests must really run in the full suite: a skip there (a missing browser,
# .xla-venv, kernel) would hide that the capability is untested, so it fails instead.
_REQUIRED_MARKERS = ("browser", "xla", "kernel", "integration", "faults")
# What NBACCEL_REQUIRE_ALL found missing without a test report of its own: required tests
# deselected by -m and modules skipped whole at collection (module-level importorskip).
_UNRUN: list[str] = []


def _require_all() -> bool:
    return os.environ.get("NBACCEL_REQUIRE_ALL") == "1"


def pytest_deselected(items):
    # -k picks tests on purpose (`scripts/test.sh -k launcher`); -m is how whole
    # capabilities vanish (`-m "not kernel"`), so only a -m run is held to account
    config = items[0].config if _require_all() and items else None
    if config is None or not config.option.markexpr or config.option.keyword:
        return
    for item in items:
        required = [m for m in _REQUIRED_MARKERS if item.get_closest_marker(m) is not None]
        if required:
            _UNRUN.append(f"{item.nodeid} ({'/'.join(required)}) was deselected")


def pytest_collectreport(report):
    if _require_all() and report.skipped:
        # (a list where pytest-xdist passed the report on from a worker)
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, (tuple, list)) else longrepr
        _UNRUN.append(f"{report.nodeid} was skipped whole at collection: {reason}")


# The time guard's view into the main run (scripts/test.sh sets NBACCEL_CPU_TOP=N): the CPU
# seconds each test file cost, user + system of the pytest process and of every process it
# reaped while the file's tests, fixtures and teardowns ran -- its workers, kernels, scripts,
# and (pytest being their subreaper) their orphaned grandchildren too. CPU, not wall: on a
# loaded machine a file's wall time is mostly the other files' CPU. File -> [CPU s, wall s].
_COST: dict[str, list[float]] = {}


def _cpu_seconds() -> float:
    import resource

    own, reaped = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield  # setup, call, teardown: a module's fixtures end inside its last test's protocol
    cost = _COST.setdefault(item.nodeid.split("::", 1)[0], [0.0, 0.0])
    cost[0] += _cpu_seconds() - cpu
    cost[1] += time.monotonic() - wall


def pytest_sessionfinish(session, exitstatus):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        # a pytest-xdist worker (scripts/test.sh runs the suite with -n 2): its deselections
        # and collection skips happen here, its summary is the controller's
        workeroutput["nbaccel_unrun"] = list(_UNRUN)
        workeroutput["nbaccel_cost"] = _COST
        return
    if _require_all() and _UNRUN:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where it is not installed
def pytest_testnodedown(node, error):
    # pytest-xdist's controller: gather what each worker found missing. A module skipped at
    # collection is also reported to the controller's own pytest_collectreport, so once only.
    for line in getattr(node, "workeroutput", {}).get("nbaccel_unrun", ()):
        if line not in _UNRUN:
            _UNRUN.append(line)
    # --dist loadfile: a file runs in one worker, but one split across workers adds up
    for path, (cpu, wall) in getattr(node, "workeroutput", {}).get("nbaccel_cost", {}).items():
        cost = _COST.setdefault(path, [0.0, 0.0])
        cost[0] += cpu
        cost[1] += wall


def pytest_terminal_summary(terminalreporter):
    top = int(os.environ.get("NBACCEL_CPU_TOP", "0") or 0)
    if top > 0 and _COST:
        total = sum(cpu for cpu, _ in _COST.values())
        terminalreporter.section(
            f"CPU per test file: the {min(top, len(_COST))} costliest of {len(_COST)} "
            f"({total:.0f} s CPU in all: pytest and every process it reaped)"
        )
        for path, (cpu, wall) in sorted(_COST.items(), key=lambda kv: -kv[1][0])[:top]:
            terminalreporter.write_line(
                f"{cpu:7.1f} s CPU {wall:7.1f} s wall {100 * cpu / total:5.1f}%  {path}"
            )
    if _require_all() and _UNRUN:
        terminalreporter.section("NBACCEL_REQUIRE_ALL: tests that did not run", red=True)
        for line in _UNRUN:
            terminalreporter.write_line(line)
        terminalreporter.write_line(
            f"{len(_UNRUN)} required test(s)/module(s) did not run: install what they need "
            "(scripts/test.sh does) or run without NBACCEL_REQUIRE_ALL=1."
        )


# GPU tests (tests/gpu) are skipped on machines without CUDA, which is every CI and dev
# machine, so NBACCEL_REQUIRE_ALL leaves them alone. scripts/gpu_check.sh sets
# NBACCEL_REQUIRE_GPU=1 instead: on the GPU machine a skipped GPU test fails, unless its
# reason says the machine lacks the hardware (tests/gpu/conftest.py: "[hardware] ...").
_HARDWARE_SKIP = "[hardware] "


def _skip_reason(report) -> str:
    return str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped:
        return
    if item.get_closest_marker("gpu") is not None:
        reason = _skip_reason(report)
        if os.environ.get("NBACCEL_REQUIRE_GPU") == "1" and _HARDWARE_SKIP not in reason:
            report.outcome = "failed"
            report.longrepr = (
                f"NBACCEL_REQUIRE_GPU=1 and this gpu test was skipped: {reason}. On the GPU "
                "machine every GPU test must run (scripts/gpu_check.sh installs what they need)."
            )
        return
    if os.environ.get("NBACCEL_REQUIRE_ALL") != "1" or hasattr(report, "wasxfail"):
        return  # an expected failure ran: it is not a capability that went untested
    required = [m for m in _REQUIRED_MARKERS if item.get_closest_marker(m) is not None]
    if required:
        report.outcome = "failed"
        reason = _skip_reason(report)
        report.longrepr = (
            f"NBACCEL_REQUIRE_ALL=1 and this {'/'.join(required)} test was skipped: {reason}. "
            "Run scripts/setup_browser.sh and scripts/setup_xla.sh (scripts/test.sh does)."
        )
