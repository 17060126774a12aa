"""Forked workers must not hang when the parent already used torch's OpenMP pool."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from nbaccel.launch.testing import run_on_workers
from nbaccel.platform import forksafe
from nbaccel.platform.forksafe import release_openmp_threads


def _two_thread_matmul() -> int:
    # the exact pattern that hangs after fork with an un-released libgomp pool
    torch.set_num_threads(2)
    a = torch.randn(256, 256)
    return int((a @ a).shape[0])


@pytest.mark.integration
def test_workers_run_multithreaded_ops_after_the_parent_used_openmp():
    a = torch.randn(256, 256)
    (a @ a).sum()  # start the parent's OpenMP pool, as any notebook cell would
    assert run_on_workers(_two_thread_matmul, num_processes=2) == [256, 256]


def test_release_reports_whether_a_runtime_was_paused():
    torch.ones(1)  # torch (and with it its OpenMP runtime) is loaded in this process
    # torch 2.4's wheel ships a libgomp older than OpenMP 5.0 (no omp_pause_resource_all):
    # nothing can be paused there, and the result says so.
    pausable = any(
        hasattr(ctypes.CDLL(path), "omp_pause_resource_all")
        for path in forksafe._loaded_openmp_libraries()
    )
    assert forksafe._loaded_openmp_libraries(), "torch's OpenMP runtime should be mapped"
    assert release_openmp_threads() is pausable


def test_threads_are_known_by_the_package_whose_code_runs_them():
    import threading
    import warnings

    stop = threading.Event()
    mine = threading.Thread(target=stop.wait, name="user-thread", daemon=True)
    # a thread of a class nbaccel defines is one nbaccel knows
    supervisor = type("Supervisor", (threading.Thread,), {"__module__": "nbaccel.launch._x"})
    ours = supervisor(target=stop.wait, name="nbaccel-code", daemon=True)
    mine.start()
    ours.start()
    try:
        assert "user-thread" in forksafe.unknown_threads()
        assert "nbaccel-code" not in forksafe.unknown_threads()
        check = forksafe.check_fork()
        assert not check.safe and "'user-thread'" in check.message()
        assert "start_method='spawn'" in check.message()
        with pytest.warns(RuntimeWarning, match="user-thread"):
            forksafe.warn_if_fork_unsafe()
    finally:
        stop.set()
        mine.join()
        ours.join()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert forksafe.warn_if_fork_unsafe().safe  # nothing unknown left: no warning


def test_fsspecs_io_thread_is_known_and_a_namesake_is_not():
    # s3fs (object-storage checkpoints) starts fsspec's IO loop thread in the kernel and it
    # lives on; fsspec drops it in a forked child itself (os.register_at_fork), so a later
    # fork launch must not warn about it. A user's thread of the same name is still unknown.
    import threading

    fsspec_asyn = pytest.importorskip("fsspec.asyn", reason="the storage extra is not here")
    fsspec_asyn.get_loop()  # starts "fsspecIO" once per process, as s3fs does
    assert any(t.name == "fsspecIO" for t in threading.enumerate())
    assert "fsspecIO" not in forksafe.unknown_threads()
    stop = threading.Event()
    namesake = threading.Thread(target=stop.wait, name="fsspecIO", daemon=True)
    namesake.start()
    try:
        assert forksafe.unknown_threads().count("fsspecIO") == 1
    finally:
        stop.set()
        namesake.join()


def test_a_timer_is_known_by_the_function_it_will_call():
    # threading.Timer keeps its callable in .function, not ._target: the monitor's redraw
    # timer (nbaccel.ui.monitor) runs during a launch, and must not make the fork "unsafe"
    import threading

    from nbaccel.ui.monitor import RunMonitor

    ours = threading.Timer(60, RunMonitor.refresh)
    mine = threading.Timer(60, print)  # a builtin: nobody nbaccel knows
    ours.name, mine.name = "nbaccel-timer", "user-timer"
    for timer in (ours, mine):
        timer.daemon = True
        timer.start()
    try:
        unknown = forksafe.unknown_threads()
        assert "nbaccel-timer" not in unknown
        assert "user-timer" in unknown
    finally:
        for timer in (ours, mine):
            timer.cancel()
            timer.join()


def test_opentelemetry_exporter_threads_are_known():
    # mlflow starts OpenTelemetry's exporter threads in the kernel; the SDK re-creates them
    # (and their locks) in a forked child, so a launch must not warn about them
    export = pytest.importorskip("opentelemetry.sdk.metrics.export", reason="no OpenTelemetry")
    import io

    reader = export.PeriodicExportingMetricReader(
        export.ConsoleMetricExporter(out=io.StringIO()), export_interval_millis=600_000
    )
    try:
        import threading

        names = [t.name for t in threading.enumerate()]
        assert "OtelPeriodicExportingMetricReader" in names  # the real thread runs
        assert "OtelPeriodicExportingMetricReader" not in forksafe.unknown_threads()
    finally:
        reader.shutdown()


class _Ray:
    """What nbaccel reads of an imported Ray: whether this process is connected."""

    def __init__(self, connected: bool) -> None:
        self.connected = connected

    def is_initialized(self) -> bool:
        return self.connected


def test_a_ray_driver_is_never_forked_by_auto_and_an_explicit_fork_is_refused(monkeypatch):
    # the whole-run hang: a forked local launch in a kernel connected to Ray, then the next
    # ray.nodes() waited for ever (tests/cluster/test_cluster_nodes.py runs it for real)
    from nbaccel.errors import ConfigError
    from nbaccel.launch.start import _preflight

    monkeypatch.setitem(sys.modules, "ray", _Ray(connected=False))
    assert forksafe.fork_breaks_this_process() is None
    assert _preflight.choose_start_method("auto") == "fork"  # Linux, no CUDA here
    monkeypatch.setitem(sys.modules, "ray", _Ray(connected=True))
    assert "connected to Ray" in (forksafe.fork_breaks_this_process() or "")
    assert _preflight.choose_start_method("auto") == "spawn"
    with pytest.raises(ConfigError, match=r"start_method='fork' cannot be used here.*Ray"):
        _preflight.choose_start_method("fork")
