"""scripts/load_lib.sh: the slow-machine rehearsal's CPU burners (NBACCEL_TEST_LOAD)."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import psutil
from waits import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]


def _script(body: str) -> list[str]:
    return ["bash", "-c", f"set -euo pipefail\ncd {ROOT}\nsource scripts/load_lib.sh\n{body}"]


def _until(predicate, seconds: float = HANG_GUARD_S) -> bool:
    """Waits for an event; the bound is only there to end a broken test."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _cpu(pid: int) -> float:
    try:
        return sum(psutil.Process(pid).cpu_times()[:2])
    except psutil.NoSuchProcess:
        return -1.0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_burners_burn_at_normal_priority_outlive_a_bare_wait_and_end_with_load_stop(tmp_path):
    pids_file, stop = tmp_path / "pids", tmp_path / "stop"
    # as scripts/test.sh does: burners, the run, a bare `wait` for its lanes, then load_stop
    body = (
        f'load_start 2\necho "${{LOAD_PIDS[*]}}" >{pids_file}\n'
        f"while [ ! -e {stop} ]; do sleep 0.1; done\nwait\nload_stop\n"
    )
    run = subprocess.Popen(
        _script(body), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert _until(lambda: pids_file.exists() and pids_file.read_text().strip())
        pids = [int(p) for p in pids_file.read_text().split()]
        assert len(pids) == 2
        assert _until(lambda: all(_cpu(pid) > 0.05 for pid in pids)), "the burners do not burn"
        assert all(psutil.Process(pid).nice() == psutil.Process(run.pid).nice() for pid in pids)
        # each its own session: Linux shares the CPU between sessions first (autogroup), and
        # the suite's kernels, workers and Ray nodes are sessions of their own
        assert all(os.getsid(pid) == pid for pid in pids)
        stop.touch()
        out, _ = run.communicate(timeout=120)  # a `wait` that waited for a burner never returns
    finally:
        run.kill()
    assert run.returncode == 0, out
    assert "slow-machine rehearsal: 2 CPU burners" in out and "ended 2 CPU burners" in out, out
    assert _until(lambda: not any(_alive(pid) for pid in pids)), "a burner outlived load_stop"


def test_a_burner_ends_by_itself_when_the_run_is_killed(tmp_path):
    # SIGKILL runs no trap: the burners see their owner gone
    pids_file = tmp_path / "pids"
    run = subprocess.Popen(
        _script(f'load_start 1\necho "${{LOAD_PIDS[*]}}" >{pids_file}\nsleep 600\n')
    )
    try:
        assert _until(lambda: pids_file.exists() and pids_file.read_text().strip())
        (pid,) = [int(p) for p in pids_file.read_text().split()]
        assert _alive(pid)
    finally:
        run.kill()
        run.wait()
    assert _until(lambda: not _alive(pid)), "the burner outlived the killed run"


def _burners() -> set[int]:
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        if (proc.info["cmdline"] or [""])[0] == "nbaccel-test-load":
            found.add(proc.pid)
    return found


def test_a_load_that_is_not_a_whole_number_is_refused_before_anything_starts():
    before = _burners()
    done = subprocess.run(_script("load_start 2x\n"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "NBACCEL_TEST_LOAD must be a whole number" in done.stderr and "'2x'" in done.stderr
    assert _burners() <= before


def test_the_speed_probe_states_the_cores_speed_and_the_contention():
    done = subprocess.run(
        _script('speed_probe "at the start"\n'), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    found = re.search(
        r"took ([0-9.]+) CPU-s, ([0-9.]+) s wall \(contention ([0-9.]+)x\)", done.stdout
    )
    assert done.stdout.startswith("=== machine speed at the start: a fixed workload took "), (
        done.stdout
    )
    assert found, done.stdout
    cpu, wall, contention = float(found[1]), float(found[2]), float(found[3])
    assert 0 < cpu <= wall * 1.05, done.stdout
    # the contention is wall / CPU of the unrounded times: within what the printed times'
    # rounding (to 0.01 s) and its own (to 0.1) allow (0.38 / 0.33 printed 1.1x: 0.377 / 0.334)
    low, high = (wall - 0.005) / (cpu + 0.005) - 0.05, (wall + 0.005) / (cpu - 0.005) + 0.05
    assert low <= contention <= high, done.stdout
