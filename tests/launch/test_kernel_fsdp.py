"""FSDP from a REAL IPython kernel: one switch in the launch configuration.

The training function is cell-defined and creates a plain ``Accelerator()``; the
strategy comes only from ``LaunchConfig(strategy="fsdp", ...)`` -- passed to
``notebook_launcher`` in one test, chosen in the widget panel in the other. Both
train 2 CPU processes over gloo and must end with the weights of the same training
done in one unsharded process inside the kernel.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kernel_harness import KernelSession, module_kernel

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SETUP = """
import torch
from torch import nn
from nbaccel import Accelerator, LaunchConfig, notebook_launcher

def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

def train(steps):
    accelerator = Accelerator()                 # nothing about FSDP in the code
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = data()
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = slice(rank * 32 // world, (rank + 1) * 32 // world)
    for _ in range(steps):
        optimizer.zero_grad()
        accelerator.backward(((model(x[mine]) - y[mine]) ** 2).mean())
        optimizer.step()
    state = accelerator.get_state_dict(model)   # full weights, gathered on rank 0
    local = sum(p.to_local().numel() for p in model.parameters())
    return accelerator.distributed_type.value, local, {k: v.clone() for k, v in state.items()}

torch.manual_seed(0)
reference = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
x, y = data()
for _ in range(5):
    ref_opt.zero_grad()
    ((reference(x) - y) ** 2).mean().backward()
    ref_opt.step()
TOTAL = sum(p.numel() for p in reference.parameters())

def check(result):
    kind, local, state = result
    return {
        "type": kind,
        "half": local < TOTAL,
        "matches": sorted(state) == sorted(reference.state_dict())
            and all(torch.allclose(state[k], v, atol=1e-5) for k, v in reference.state_dict().items()),
    }

CONFIG = LaunchConfig(
    strategy="fsdp", num_processes=2, compute_device="cpu",
    fsdp_auto_wrap_policy="size_based_wrap", fsdp_min_num_params=30,
)
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    yield from module_kernel(tmp_path_factory, SETUP)


@pytest.mark.timeout(240)
def test_notebook_launcher_with_an_fsdp_launch_config(kernel):
    kernel.run("result = notebook_launcher(train, args=(5,), config=CONFIG)", timeout=180)
    assert kernel.evaluate_json("check(result)") == {"type": "FSDP", "half": True, "matches": True}
    kernel.assert_no_descendants(timeout=5)


@pytest.mark.timeout(240)
def test_the_panel_launches_fsdp_when_strategy_is_chosen(kernel):
    pytest.importorskip("ipywidgets")
    kernel.run(
        "from nbaccel.widgets import LaunchPanel\n"
        "panel = LaunchPanel(train, args=(5,), config=CONFIG.replace(strategy='ddp'))\n"
        "hidden = panel.rows['fsdp_min_num_params'].layout.display\n"
        "panel.controls['strategy'].value = 'fsdp'   # the one switch\n"
        "shown = panel.rows['fsdp_min_num_params'].layout.display\n"
        "panel_result = panel.launch()",
        timeout=180,
    )
    assert kernel.evaluate_json("[hidden, shown]") == ["none", None]
    assert kernel.evaluate_json("check(panel_result)") == {
        "type": "FSDP",
        "half": True,
        "matches": True,
    }
    kernel.assert_no_descendants(timeout=5)
