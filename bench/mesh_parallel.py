"""TP x FSDP2 step through nbaccel's ParallelismConfig vs the same model parallelised by hand.

One launch of 4 CPU processes (gloo), ``notebook_launcher``'s engine. In every process both
models exist: A = ``Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2,
tp_size=2))`` + ``prepare`` with a TP plan; B = the same plan applied by hand with torch's
``parallelize_module`` on ``init_device_mesh(("dp_shard", "tp"))["tp"]`` and
``fully_shard`` on ``["dp_shard"]``, AdamW, the data split by hand. Steps alternate A B A B
(interleaved: both see the same machine load); each step is timed from forward to the end
of ``optimizer.step`` and the slowest rank counts. The two must agree on every loss.

    .venv/bin/python bench/mesh_parallel.py            # writes bench/RESULTS_MESH.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

WIDTH, LAYERS, BATCH, WARMUP = 512, 4, 32, 3


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [
            torch.nn.Linear(WIDTH, 4 * WIDTH),
            torch.nn.GELU(),
            torch.nn.Linear(4 * WIDTH, WIDTH),
        ]
    return torch.nn.Sequential(*layers)


def _plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        str(i): ColwiseParallel() if i % 3 == 0 else RowwiseParallel()
        for i in range(3 * LAYERS)
        if i % 3 != 1
    }


def _worker(steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from nbaccel import Accelerator, ParallelismConfig
    from nbaccel.utils import TorchTensorParallelConfig

    config = ParallelismConfig(
        dp_shard_size=2, tp_size=2, tp_handler=TorchTensorParallelConfig(plan=_plan())
    )
    acc = Accelerator(parallelism_config=config)
    model_a = _model()
    opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-3)
    model_a, opt_a = acc.prepare(model_a, opt_a)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model_b = parallelize_module(_model(), mesh["tp"], _plan())
    fully_shard(model_b, mesh=mesh["dp_shard"])
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-3)

    dp_rank = dist.get_rank() // 2  # tp innermost: ranks 0,1 read shard 0
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(2 * BATCH, WIDTH, generator=g) for _ in range(steps + WARMUP)]

    def step(model, opt, x, backward):
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        backward(loss)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0, float(loss.detach())

    times = {"nbaccel": [], "by hand": []}
    losses = {"nbaccel": [], "by hand": []}
    for i, batch in enumerate(data):
        x = batch[dp_rank * BATCH : (dp_rank + 1) * BATCH]
        for name, model, opt, back in (
            (
                ("nbaccel", model_a, opt_a, acc.backward),
                ("by hand", model_b, opt_b, lambda loss: loss.backward()),
            )
            if i % 2 == 0
            else (
                ("by hand", model_b, opt_b, lambda loss: loss.backward()),
                ("nbaccel", model_a, opt_a, acc.backward),
            )
        ):
            dist.barrier()
            seconds, loss = step(model, opt, x, back)
            if i >= WARMUP:
                times[name].append(seconds)
                losses[name].append(loss)
    return times, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_MESH.md")))
    args = parser.parse_args()
    from nbaccel.launch.testing import run_on_workers

    ranks = run_on_workers(_worker, 4, args=(args.steps,), timeout=1200)
    slowest = {
        name: [max(r[0][name][i] for r in ranks) for i in range(args.steps)]
        for name in ("nbaccel", "by hand")
    }
    agree = all(r[1]["nbaccel"] == r[1]["by hand"] for r in ranks)
    close = all(
        abs(a - b) <= 1e-5 * max(1.0, abs(b))
        for r in ranks
        for a, b in zip(r[1]["nbaccel"], r[1]["by hand"], strict=True)
    )
    rows = []
    for name, values in slowest.items():
        ms = [1000 * v for v in values]
        rows.append(f"| {name} | {statistics.median(ms):.1f} | {min(ms):.1f}-{max(ms):.1f} |")
    ratios = [a / b for a, b in zip(slowest["nbaccel"], slowest["by hand"], strict=True)]
    text = "\n".join(
        [
            "# TP x FSDP2 step: nbaccel's ParallelismConfig vs torch by hand",
            "",
            f"`bench/mesh_parallel.py --steps {args.steps}`: 4 CPU processes (gloo), "
            f"dp_shard=2 x tp=2, MLP {LAYERS} x ({WIDTH}->{4 * WIDTH}->{WIDTH}), batch "
            f"{BATCH}/data shard, AdamW; steps interleaved A B / B A, slowest rank, "
            f"{WARMUP} warm-up steps dropped. torch {torch.__version__}, "
            f"{platform.processor() or platform.machine()}, one run.",
            "",
            "| system | median step (ms) | min-max (ms) |",
            "|---|---|---|",
            *rows,
            "",
            f"nbaccel / by hand, per interleaved pair: median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}).",
            f"Losses: bit-identical {agree}; within 1e-5 {close}.",
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
