"""The fork server with the real CUDA driver (issue 43): a notebook that loads nbaccel
first and then touches CUDA (torch.cuda.is_available(), a tensor on the GPU) launches
workers forked by the server, and they use the GPU."""

from __future__ import annotations

from pathlib import Path

import psutil
from kernel_harness import KernelSession, isolated_env

SETUP = """
%load_ext nbaccel
import os, torch
from nbaccel import notebook_launcher, start_workers
from nbaccel.launch.start import _forkserver

def on_gpu(x):
    import os, torch
    t = torch.full((4,), float(x), device="cuda")
    torch.cuda.synchronize()
    return [os.getppid(), float(t.sum())]
"""


def test_workers_fork_from_the_server_after_the_kernel_touched_cuda(tmp_path: Path) -> None:
    # unset NBACCEL_FORK_SERVER: an interactive kernel on a machine with a driver takes it
    env = isolated_env(tmp_path) | {"NBACCEL_FORK_SERVER": None}
    session = KernelSession(cwd=tmp_path, env=env, startup_timeout=120)
    session.start()
    try:
        session.run(SETUP, timeout=300)
        server = session.evaluate_json("_forkserver.server_pid()")
        assert server is not None and psutil.Process(server).ppid() == session.pid
        session.run("assert torch.cuda.is_available()\nhere = torch.ones(1, device='cuda')")
        cell = session.run("got = notebook_launcher(on_gpu, args=(2,), num_processes=1, "
                           "block=False).result(timeout=300)", timeout=360)  # fmt: skip
        assert "spawn" not in cell.stderr, cell.stderr
        assert session.evaluate_json("got") == [server, 8.0]
        session.run("pool = start_workers(num_processes=1)\n"
                    "from_pool = pool.call(on_gpu, (3,))\nmethod = pool.start_method\n"
                    "pool.close()", timeout=360)  # fmt: skip
        assert session.evaluate_json("[method, from_pool]") == ["forkserver", [server, 12.0]]
    finally:
        leftovers = session.stop()
    assert leftovers == [], leftovers
