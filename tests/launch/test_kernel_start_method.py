"""The launcher does not depend on the interpreter's default start method.

Python 3.14 changed the default of ``multiprocessing`` on Linux from fork to
forkserver, and users (or libraries) set it globally with ``set_start_method``.
nbaccel starts its workers itself (``os.fork`` or a fresh interpreter), so a launch
from a REAL kernel must behave the same whatever the global default says: same
result, same number of forks, no forkserver left behind.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kernel_harness import KernelSession, module_kernel

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SETUP = """
import multiprocessing, os, torch
import torch.distributed as dist
from nbaccel import notebook_launcher

FORKS = [0]
os.register_at_fork(before=lambda: FORKS.__setitem__(0, FORKS[0] + 1))

def total_of_ranks(scale):
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(t)
    return t.item(), multiprocessing.current_process().name

def launch(**kwargs):
    before = FORKS[0]
    value = notebook_launcher(total_of_ranks, args=(2.0,), num_processes=2, **kwargs)
    return {"value": value, "forks": FORKS[0] - before}
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    yield from module_kernel(tmp_path_factory, SETUP)


def _launch(kernel: KernelSession, kwargs: str = "") -> dict:
    kernel.run(f"outcome = launch({kwargs})", timeout=120)
    return kernel.evaluate_json("outcome")


@pytest.mark.timeout(240)
def test_global_start_method_changes_nothing(kernel: KernelSession) -> None:
    baseline = _launch(kernel)
    assert baseline["value"] == [6.0, "MainProcess"]
    assert baseline["forks"] == 2  # "auto" forks on Linux: one per worker
    spawned = _launch(kernel, "start_method='spawn'")
    assert spawned == {"value": [6.0, "MainProcess"], "forks": 0}
    for method in ("forkserver", "spawn"):
        kernel.run(f"multiprocessing.set_start_method({method!r}, force=True)")
        assert kernel.evaluate_json("multiprocessing.get_start_method()") == method
        assert _launch(kernel) == baseline, f"global start method {method!r}"
        if method == "forkserver":  # Python 3.14's new default on Linux
            assert _launch(kernel, "start_method='spawn'") == spawned, method
        kernel.assert_no_descendants(timeout=5)  # no forkserver (or anything) left behind
