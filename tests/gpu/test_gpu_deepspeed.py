"""ZeRO-Offload on one GPU: a model whose fp32 AdamW state does not fit in the GPU trains.

One process (``notebook_launcher(num_processes=1)`` forked from this CUDA-free pytest
process), DeepSpeed ZeRO-2 with bf16 and ``offload_optimizer_device="cpu"``: the GPU
holds bf16 parameters and gradients (4 bytes per parameter), the CPU the fp32 master
weights and AdamW's two moments (12 bytes per parameter). fp32 AdamW training without
offload needs 16 bytes per parameter on the GPU (weights, gradients, two moments).

To stay short, the GPU is capped with ``torch.cuda.set_per_process_memory_fraction``
(``NBACCEL_ZERO_OFFLOAD_GIB``, default 6 GiB) and the model is sized so that its fp32 AdamW
state is 1.5x the cap; the same model without offload is run first as the control and
must run out of memory. ``NBACCEL_ZERO_OFFLOAD_GIB=0`` uses the whole GPU (a model of
~1.2 x GPU memory / 16 bytes parameters: minutes, and host RAM of 12 bytes per parameter).
The optimizer is torch's AdamW on the CPU (``zero_force_ds_cpu_optimizer: false``), so no
C++ build (DeepSpeedCPUAdam) is needed on the GPU machine.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed (pip install --no-build-isolation deepspeed)",
    ),
]

GIB = 1024**3


def _offload_run(cap_gib: float, offload: bool, steps: int) -> dict:
    import time

    import torch

    from nbaccel import Accelerator, DeepSpeedPlugin

    total = torch.cuda.get_device_properties(0).total_memory
    cap = cap_gib * GIB if cap_gib else total
    if cap_gib:
        torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    width = 8192
    layers = max(1, round(1.5 * cap / 16 / (width * width)))  # fp32 AdamW state = 1.5 x cap
    params = layers * (width * width + width)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.to(self.layers[0].weight.dtype)
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    plugin = DeepSpeedPlugin(
        zero_stage=2, offload_optimizer_device="cpu" if offload else "none", gradient_clipping=1.0
    )
    plugin.deepspeed_config["zero_force_ds_cpu_optimizer"] = False  # torch AdamW on the CPU
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 8
    acc = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    result = {"params": params, "fp32_adamw_state_gib": 16 * params / GIB, "cap_gib": cap / GIB}
    try:
        model, optimizer = acc.prepare(model, optimizer)
        x = torch.randn(8, width, device=acc.device)
        target = torch.zeros(8, width, device=acc.device)
        losses, seconds = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x).float(), target)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
            losses.append(float(loss))
    except torch.OutOfMemoryError as err:
        return {**result, "oom": str(err).splitlines()[0][:200]}
    result.update(
        oom=None,
        losses=losses,
        step_seconds=seconds,
        peak_gpu_gib=torch.cuda.max_memory_allocated() / GIB,
        optimizer_state_device=str(
            next(iter(optimizer.optimizer.optimizer.state.values()))["exp_avg"].device
        ),
        steps=acc.step,
    )
    return result


def _on_gpu(fn, *args):
    from nbaccel import LaunchConfig, notebook_launcher

    config = LaunchConfig(num_processes=1, compute_device="gpu", start_method="fork")
    return notebook_launcher(fn, args=args, config=config, block=False).result(timeout=900)


@pytest.mark.timeout(1200)
def test_zero_offload_trains_a_model_whose_fp32_adamw_state_does_not_fit_on_the_gpu():
    cap = float(os.environ.get("NBACCEL_ZERO_OFFLOAD_GIB", "6"))
    control = _on_gpu(_offload_run, cap, False, 2)
    assert control["fp32_adamw_state_gib"] > control["cap_gib"]
    assert control["oom"], f"without offload the model should not fit: {control}"
    got = _on_gpu(_offload_run, cap, True, 4)
    print(f"ZeRO-Offload on one GPU: {got}")  # the measured numbers, for the report
    assert got["oom"] is None and got["steps"] == 4
    assert got["fp32_adamw_state_gib"] > got["cap_gib"] > got["peak_gpu_gib"]
    assert got["optimizer_state_device"] == "cpu"  # AdamW's moments live in CPU memory
    assert got["losses"][-1] < got["losses"][0]
