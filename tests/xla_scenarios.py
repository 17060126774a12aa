"""Run by tests/launch/test_xla.py inside .xla-venv (torch_xla 2.9, PJRT_DEVICE=CPU).

Not a test module: it plays the notebook kernel. It launches a small training
function through the one engine (``notebook_launcher``, ``block=False``, the warm pool,
``nbaccel.debug()``) on the XLA device and writes what happened to the JSON file named by
``argv[1]``. Order matters: every launch comes before the XLA runtime is started here.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from typing import Any

import nbaccel
import nbaccel.accelerator
import nbaccel.launcher
import nbaccel.runtime.process.state

IMPORTED_TORCH_XLA = "torch_xla" in sys.modules  # importing nbaccel must not import it


def train(epochs: int) -> dict[str, Any]:
    """A tiny regression trained with the Accelerator; returns what the test checks."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]])
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, batch_devices = [], set()
    for _ in range(epochs):
        for xb, yb in loader:
            batch_devices.add(xb.device.type)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(loss.item())
            accelerator.log({"loss": losses[-1]}, step=len(losses))  # the monitor's events
    with tempfile.TemporaryDirectory() as tmp:  # checkpoints of XLA tensors round-trip
        accelerator.save_state(tmp)
        trained = model.weight.detach().cpu().clone()
        with torch.no_grad():
            model.weight.zero_()
        accelerator.load_state(tmp)
        restored = torch.equal(model.weight.detach().cpu(), trained)
    return {
        "checkpoint_restored": restored,
        "losses": losses,
        "distributed_type": accelerator.distributed_type.value,
        "device": str(accelerator.device),
        "param_device": next(model.parameters()).device.type,
        "batch_devices": sorted(batch_devices),
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "pid": os.getpid(),
        "weight": model.weight.detach(),  # an XLA tensor: must arrive on the CPU
    }


def fail(value: int) -> None:
    """Raises in the worker after touching the XLA device."""
    import torch

    from nbaccel import Accelerator

    device = Accelerator().device
    torch.ones(1, device=device).sum().item()
    raise ValueError(f"bad value {value} on {device}")


def launched(num_processes: int | None) -> dict[str, Any]:
    import torch_xla  # noqa: F401  (its import sets XLA_FLAGS & co. for good; not the launch)

    before = dict(os.environ)
    result = nbaccel.notebook_launcher(train, args=(3,), num_processes=num_processes)
    weight = result.pop("weight")
    return {
        **result,
        "weight_device": weight.device.type,
        "weight": weight.tolist(),
        "environ_restored": dict(os.environ) == before,
        "state_left_behind": nbaccel.runtime.process.state.current_state() is not None,
        "launcher_pid": os.getpid(),
    }


def expect_error(function: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        nbaccel.notebook_launcher(function, *args, **kwargs)
    except Exception as err:
        return {
            "types": [t.__name__ for t in type(err).__mro__],
            "rank": getattr(err, "rank", None),
            "message": str(err),
        }
    return {"types": [], "rank": None, "message": "no error"}


def background_pool_and_debug() -> dict[str, Any]:
    """block=False with its status, then a warm pool: two calls, a failure, nbaccel.debug()."""
    import contextlib
    import io

    handle = nbaccel.notebook_launcher(train, args=(1,), block=False)
    background = handle.result(timeout=120)
    scalars = handle.status()[0]["scalars"]
    with nbaccel.start_workers() as pool:
        first, second = pool.call(train, (1,)), pool.call(train, (1,))
        failure = expect_error_in(lambda: pool.call(fail, (5,)))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            nbaccel.debug(commands=["p value + 1", "q"])
        restarts = pool.restarts
    return {
        "background_pid": background["pid"],
        "background_device": background["device"],
        "logged_loss": "loss" in scalars,
        "pool_pids": [first["pid"], second["pid"]],
        "pool_device": second["device"],
        "pool_failure": failure,
        "debug_output": out.getvalue(),
        "restarts": restarts,
    }


def expect_error_in(call: Any) -> dict[str, Any]:
    try:
        call()
    except Exception as err:
        return {"types": [t.__name__ for t in type(err).__mro__], "message": str(err)}
    return {"types": [], "message": "no error"}


def start_the_runtime_here() -> bool:
    import torch_xla

    torch_xla.device()  # the "kernel" touches the device: from now on no worker can own it
    return True


def colab_refuses_8() -> dict[str, Any]:
    """Colab's TPU runtime (v5e-1) asked for 8 processes: an error before anything starts."""
    markers = {"COLAB_RELEASE_TAG": "release-colab_20251101", "TPU_ACCELERATOR_TYPE": "v5litepod-1"}
    os.environ.update(markers)
    try:
        return expect_error(train, args=(1,), num_processes=8)
    finally:
        for name in markers:
            del os.environ[name]


def main(path: str) -> None:
    import torch_xla

    from nbaccel.platform import tpu

    out: dict[str, Any] = {
        "imported_torch_xla_at_import": IMPORTED_TORCH_XLA,
        "torch_xla_version": torch_xla.__version__,
    }
    steps = [
        ("colab_8", colab_refuses_8),  # refused before the runtime or a worker starts
        ("cpu_2", lambda: expect_error(train, args=(1,), num_processes=2)),  # 1 CPU device
        ("spawned", lambda: launched(None)),  # a worker of the engine, set up by the backend
        ("runtime_after_spawn", tpu.runtime_initialized),
        ("failure", lambda: expect_error(fail, args=(7,), num_processes=None)),
        ("one_worker", lambda: launched(1)),  # one process: a worker too, never the kernel
        ("engine", background_pool_and_debug),
        ("runtime_after_workers", tpu.runtime_initialized),
        ("runtime_started_here", start_the_runtime_here),
        ("refused", lambda: expect_error(train, args=(1,), num_processes=None)),
    ]
    for name, step in steps:
        try:
            out[name] = step()
        except Exception:
            out[name] = {"crashed": traceback.format_exc()}
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
