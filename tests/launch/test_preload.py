"""What the kernel pre-imports before forking: torch._dynamo once a worker needed it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from nbaccel.launch.engine import _group


@pytest.fixture(autouse=True)
def _fresh_memory():
    saved = set(_group._learned)
    _group._learned.clear()
    yield
    _group._learned.clear()
    _group._learned.update(saved)


def test_only_what_a_worker_reported_is_remembered():
    assert _group.worker_imports() == frozenset()  # nothing predicted
    _group.remember_worker_imports(["torch._dynamo"])
    assert _group.worker_imports() == {"torch._dynamo"}


SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from nbaccel import notebook_launcher, start_workers

    def ping():
        import torch.distributed as dist
        from nbaccel import Accelerator
        Accelerator()
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)

    def train():
        already = "torch._dynamo" in sys.modules
        m = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(torch.ones(1, 2)).sum().backward()
        opt.step()
        return already

    assert notebook_launcher(ping, num_processes=2) == 2.0
    print("after collectives:", "torch._dynamo" in sys.modules)
    inherited = notebook_launcher(train, num_processes=2)
    print("after training:", "torch._dynamo" in sys.modules, inherited)
    inherited = notebook_launcher(train, num_processes=2)
    print("after the next launch:", "torch._dynamo" in sys.modules, inherited)
    """
)


@pytest.mark.integration
def test_dynamo_is_imported_by_the_workers_once_then_by_the_kernel(tmp_path):
    """In a fresh interpreter (this one may have torch._dynamo already)."""
    cuda_build = torch.cuda._is_compiled()  # CUDA builds never pre-import torch._dynamo
    script = tmp_path / "launch_script.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("after")]
    # a launch that only runs collectives never pays the import, anywhere
    assert lines[0] == "after collectives: False"
    # the first training launch: the workers import it (as raw torch's would), and say so
    assert lines[1] == "after training: False False"
    if cuda_build:  # the workers import it themselves, every launch; the kernel never does
        assert lines[2] == "after the next launch: False False"
    else:  # imported in the kernel before forking: the workers inherit it
        assert lines[2] == "after the next launch: True True"
