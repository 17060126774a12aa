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


# SIGTERM again while the worker is already ending its children (Linux sends the
# parent-death signal once more each time the worker passes to another thread of the dying
# supervisor): here it arrives while die() imports psutil, whose handler ran die() again.
SIGTERM_TWICE = """
import importlib.abc, os, signal, subprocess, sys, time
from nbaccel.launch.worker import _worker_os as wos

assert "psutil" not in sys.modules
wos.reset_signals()  # SIGTERM -> die(143), as in a worker
child = subprocess.Popen(["sleep", "300"])
print(child.pid, flush=True)


class SigtermDuringImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "psutil._common":  # psutil is half imported: no psutil.Process yet
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this returns
        return None


sys.meta_path.insert(0, SigtermDuringImport())
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(300)  # never reached: die() ends the process
"""


@pytest.mark.timeout(120)
def test_a_second_sigterm_while_the_worker_dies_still_ends_its_children(tmp_path):
    script = tmp_path / "sigterm_twice.py"
    script.write_text(SIGTERM_TWICE)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, "the script ended before starting its child"
        child = psutil.Process(int(line))
        assert proc.wait() == 143  # SIGTERM's code, from die()
        _, alive = psutil.wait_procs([child], timeout=10)
        alive = [p for p in alive if not _gone_or_zombie(p)]
        assert not alive, "the second SIGTERM's die() exited before the first ended the child"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and not _gone_or_zombie(child):
            child.kill()
