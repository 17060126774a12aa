"""``nbaccel launch`` killed with SIGKILL (a scheduler's time limit, a closed terminal):
every worker, and every process a worker started, ends by itself within seconds, by the
operating system's own signals (the channel's end of file, the parent-death signal).
``accelerate launch`` and torchrun leave them running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

pytestmark = [pytest.mark.faults, pytest.mark.integration]

HANGS = """
import os, subprocess, time
child = subprocess.Popen(["sleep", "300"])  # a grandchild of nbaccel launch
print(f"ready {os.getpid()} {child.pid}", flush=True)
time.sleep(300)  # a hung training script
"""


def _gone_or_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(180)
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_sigkill_of_nbaccel_launch_ends_every_worker_and_their_children(tmp_path, start_method):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBACCEL_")}
    env["NBACCEL_CONFIG_FILE"] = str(tmp_path / "none.yaml")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "nbaccel", "launch", "--cpu", "--num_processes", "2",
         "--start_method", start_method, str(script)],
        stdout=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        pids = []
        while len(pids) < 4:
            line = launcher.stdout.readline()  # type: ignore[union-attr]
            assert line, "nbaccel launch ended before its workers were ready"
            pids += [int(p) for p in re.findall(r"ready (\d+) (\d+)", line)[0]]
        procs = [psutil.Process(pid) for pid in pids]
        launcher.send_signal(signal.SIGKILL)  # no handler, no exit code: the OS alone
        launcher.wait()
        _, alive = psutil.wait_procs(procs, timeout=10)
        alive = [p for p in alive if not _gone_or_zombie(p)]
        assert not alive, f"outlived nbaccel launch: {[p.cmdline() for p in alive]}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
