"""DeepSpeed from a REAL IPython kernel: fork and spawn launches, the warm pool, the panel.

The cell-defined training function creates a plain ``Accelerator()`` (the strategy comes
from ``LaunchConfig(strategy="deepspeed", ...)``) or one with a ``DeepSpeedPlugin`` passed
in from the kernel. Each run trains 2 CPU processes over gloo and must end with the
weights of the same training done in one plain process inside the kernel.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from kernel_harness import KernelSession, module_kernel

pytestmark = [
    pytest.mark.kernel,
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed (pip install --no-build-isolation deepspeed; setup.sh does)",
    ),
]

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from nbaccel import Accelerator, DeepSpeedPlugin, LaunchConfig, notebook_launcher, start_workers

def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))

def train(steps, plugin=None):
    accelerator = Accelerator(deepspeed_plugin=plugin)   # None: the launch config decides
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(data(), batch_size=16)            # 2 processes: 16 each, all 32
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(steps):
        for x, y in loader:
            accelerator.backward(((model(x) - y) ** 2).mean())
            optimizer.step()
            optimizer.zero_grad()
    state = accelerator.get_state_dict(model)           # ZeRO-3: gathered on rank 0
    stage = accelerator.state.deepspeed_plugin.zero_stage_value
    return accelerator.distributed_type.value, stage, {k: v.clone() for k, v in state.items()}

torch.manual_seed(0)
reference = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
x, y = data().tensors
for _ in range(5):
    ref_opt.zero_grad()
    ((reference(x) - y) ** 2).mean().backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # DeepSpeed's default clipping
    ref_opt.step()

def check(result):
    kind, stage, state = result
    return {
        "type": kind,
        "stage": stage,
        "matches": sorted(state) == sorted(reference.state_dict())
            and all(torch.allclose(state[k], v, atol=1e-5) for k, v in reference.state_dict().items()),
    }

CONFIG = LaunchConfig(
    strategy="deepspeed", deepspeed_zero_stage=3, num_processes=2, compute_device="cpu",
)
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    yield from module_kernel(tmp_path_factory, SETUP)


@pytest.mark.timeout(240)
def test_fork_launch_with_a_deepspeed_launch_config(kernel):
    kernel.run(
        "result = notebook_launcher(train, args=(5,), config=CONFIG.replace(start_method='fork'))",
        timeout=180,
    )
    assert kernel.evaluate_json("check(result)") == {
        "type": "DEEPSPEED",
        "stage": 3,
        "matches": True,
    }
    kernel.assert_no_descendants(timeout=5)


@pytest.mark.timeout(240)
def test_spawn_launch_with_a_plugin_from_the_kernel(kernel):
    kernel.run(
        "plugin = DeepSpeedPlugin(zero_stage=2, offload_optimizer_device='cpu')\n"
        "plugin.deepspeed_config['zero_force_ds_cpu_optimizer'] = False  # torch SGD on the CPU\n"
        "result = notebook_launcher(train, args=(5, plugin), num_processes=2,\n"
        "                           start_method='spawn', config=LaunchConfig(compute_device='cpu'))",
        timeout=180,
    )
    assert kernel.evaluate_json("check(result)") == {
        "type": "DEEPSPEED",
        "stage": 2,
        "matches": True,
    }
    kernel.assert_no_descendants(timeout=5)


@pytest.mark.timeout(240)
def test_a_warm_pool_and_the_panel_offer_deepspeed(kernel):
    kernel.run(
        "with start_workers(config=CONFIG.replace(deepspeed_zero_stage=1)) as pool:\n"
        "    result = pool.call(train, args=(5,))\n",
        timeout=180,
    )
    assert kernel.evaluate_json("check(result)") == {
        "type": "DEEPSPEED",
        "stage": 1,
        "matches": True,
    }
    kernel.assert_no_descendants(timeout=5)
    pytest.importorskip("ipywidgets")
    kernel.run(
        "from nbaccel.widgets import LaunchPanel\n"
        "panel = LaunchPanel(train, args=(5,), config=CONFIG.replace(strategy='ddp'))\n"
        "hidden = panel.rows['deepspeed_zero_stage'].layout.display\n"
        "panel.controls['strategy'].value = 'deepspeed'   # the one switch\n"
        "panel.controls['deepspeed_offload_optimizer_device'].value = 'cpu'\n"
        "shown = [panel.rows[n].layout.display for n in ('deepspeed_zero_stage', 'fsdp_cpu_offload')]\n"
        "chosen = panel.config\n",
        timeout=60,
    )
    assert kernel.evaluate_json("[hidden, shown]") == ["none", [None, "none"]]
    assert kernel.evaluate_json(
        "[chosen.strategy, chosen.deepspeed_zero_stage, chosen.deepspeed_offload_optimizer_device]"
    ) == ["deepspeed", 3, "cpu"]
