"""macOS and Windows, as far as they can be tested on Linux: by emulation in a fresh process.

CI has neither OS. Each scenario runs in its own interpreter that first imports
torch and nbaccel's third-party requirements for real (they are Linux builds), then
makes the interpreter look like the other OS to nbaccel: ``sys.platform``, and on
Windows no ``os.fork``/``os.setsid``/``os.sched_getaffinity``/``os.O_DIRECTORY``, no
POSIX-only signals (``SIGUSR1``, ``SIGKILL``, ``SIGCHLD``, ...), and ``os.open`` of a
directory failing with ``PermissionError`` as it does there. Then every nbaccel
module is imported, a one-process ``Accelerator`` trains and saves a checkpoint, and
the launcher either runs (macOS: spawned workers) or refuses clearly before
starting anything (Windows). What this cannot cover: the real system libraries of
those OSes (README, "Tested matrix").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

EMULATE = r"""
import importlib, json, os, pkgutil, signal, subprocess, sys, tempfile
import torch, numpy, psutil, safetensors, yaml, tqdm, dill  # real Linux builds
import sysconfig, torch._dynamo  # torch's own lazy imports read Linux build facts
sysconfig.get_config_vars()

MODE = sys.argv[1]
STARTED = []  # every Python process started (workers), recorded; helpers such as ldconfig are not
_popen_init = subprocess.Popen.__init__
def _recording_popen(self, *args, **kwargs):
    command = args[0] if args else kwargs.get("args")
    if isinstance(command, (list, tuple)) and command and command[0] == sys.executable:
        STARTED.append("popen")
    _popen_init(self, *args, **kwargs)
subprocess.Popen.__init__ = _recording_popen

if MODE == "win32":
    sys.platform = "win32"
    for name in ("fork", "forkpty", "setsid", "killpg", "getpgid", "sched_getaffinity",
                 "O_DIRECTORY", "register_at_fork"):
        if hasattr(os, name):
            delattr(os, name)
    for name in ("SIGUSR1", "SIGUSR2", "SIGKILL", "SIGCHLD", "SIGHUP", "SIGQUIT", "SIGALRM",
                 "SIGPIPE", "SIGSTOP", "SIGCONT", "SIGTSTP"):
        if hasattr(signal, name):
            delattr(signal, name)
    _open = os.open
    def _windows_open(path, flags, *args, **kwargs):
        if os.path.isdir(path):
            raise PermissionError(13, "Permission denied", str(path))
        return _open(path, flags, *args, **kwargs)
    os.open = _windows_open
elif MODE == "darwin":
    sys.platform = "darwin"
    if hasattr(os, "sched_getaffinity"):
        delattr(os, "sched_getaffinity")
    _fork = os.fork
    def _counting_fork():
        STARTED.append("fork")
        return _fork()
    os.fork = _counting_fork

import nbaccel
failed_imports = {}
for info in pkgutil.walk_packages(nbaccel.__path__, "nbaccel."):
    if info.name.endswith("__main__"):  # runs the CLI when imported, by design
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as err:  # optional extras (torch_xla) are not installed here
        if "torch_xla" not in str(err):
            failed_imports[info.name] = repr(err)
    except Exception as err:
        failed_imports[info.name] = repr(err)

from nbaccel import Accelerator, notebook_launcher
from nbaccel.errors import ConfigError, LaunchError
from nbaccel.launch.testing import plan_for as plan_launch

accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
before = model.weight.detach().clone()
accelerator.backward(model(torch.ones(2, 4)).sum())
optimizer.step()
checkpoint = tempfile.mkdtemp()
accelerator.save_state(checkpoint)
accelerator.load_state(checkpoint)

def plus_one(x):
    return x + 1

out = {
    "failed_imports": failed_imports,
    "trained": not torch.equal(before, model.weight.detach()),
    "checkpoint_files": sorted(os.listdir(checkpoint)),
    "in_kernel": notebook_launcher(plus_one, args=(1,), num_processes=1),
    "started_before_launch": list(STARTED),
}
from nbaccel.runtime.process.state import reset_state
reset_state()  # the one-process Accelerator above must not block multi-process launches
errors = {}
for kwargs in ({}, {"start_method": "fork"}, {"start_method": "spawn"}):
    try:
        errors[kwargs.get("start_method", "auto")] = {
            "method": plan_launch(plus_one, (1,), num_processes=2, **kwargs).method}
    except (ConfigError, LaunchError) as err:
        errors[kwargs.get("start_method", "auto")] = {"error": type(err).__name__,
                                                       "message": str(err)}
out["plans"] = errors
STARTED.clear()
if MODE == "darwin":
    out["launched"] = notebook_launcher(plus_one, args=(1,), num_processes=2,
                                        return_all_ranks=True)
else:
    try:
        notebook_launcher(plus_one, args=(1,), num_processes=2)
    except LaunchError as err:
        out["launch_error"] = str(err)
out["started_by_launch"] = list(STARTED)
print("RESULT " + json.dumps(out))
"""


def _emulate(mode: str, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBACCEL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["HOME"] = str(tmp_path)  # no user config file
    proc = subprocess.run(
        [sys.executable, "-c", EMULATE, mode],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


def _one_process_works(out: dict) -> None:
    assert out["failed_imports"] == {}
    assert out["trained"]
    assert out["checkpoint_files"], "save_state wrote nothing"
    assert out["in_kernel"] == 2  # num_processes=1 runs in the kernel: nothing started
    assert out["started_before_launch"] == []


@pytest.mark.integration
def test_windows_imports_trains_in_one_process_and_refuses_workers_clearly(tmp_path):
    out = _emulate("win32", tmp_path)
    _one_process_works(out)
    for method in ("auto", "fork", "spawn"):
        plan = out["plans"][method]
        assert plan.get("error") == "LaunchError", (method, plan)
        assert "Windows" in plan["message"] and "WSL2" in plan["message"]
        assert "num_processes=1" in plan["message"]
    assert "Windows" in out["launch_error"]
    assert out["started_by_launch"] == []  # refused before any process existed


@pytest.mark.integration
def test_macos_spawns_and_refuses_fork_clearly(tmp_path):
    out = _emulate("darwin", tmp_path)
    _one_process_works(out)
    assert out["plans"]["auto"] == {"method": "spawn"}
    assert out["plans"]["spawn"] == {"method": "spawn"}
    fork = out["plans"]["fork"]
    assert fork.get("error") == "ConfigError", fork
    assert "macOS" in fork["message"] and "start_method='spawn'" in fork["message"]
    assert out["launched"] == [2, 2]
    assert "fork" not in out["started_by_launch"] and "popen" in out["started_by_launch"]
