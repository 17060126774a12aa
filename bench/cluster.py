"""Cluster bench: one DDP training function on a local two-node Ray cluster, three ways.

nbaccel (``notebook_launcher(..., cluster="ray")``), Ray Train's ``TorchTrainer`` (same
function body, same two workers, ``STRICT_SPREAD``) and a hand-written baseline (two Ray
actors in a ``STRICT_SPREAD`` placement group running ``torch.distributed`` themselves);
then a warm nbaccel pool's call against a launch. Interleaved rounds (A B C D A B C D ...),
medians with min-max, every system timed from the driver's call to the end of the first
training step (time to first step) and by its median step time; each rank writes its
numbers to a JSON file (Ray Train returns no value), every system pays that the same.

The driver is this script (a Python process, not a kernel: Ray Train's own driver code
runs the same either way). The cluster is the test suite's (tests/cluster/conftest.py: two
``ray start`` nodes on 127.0.0.2 / 127.0.0.3), started and ended here.

    .venv/bin/python bench/cluster.py [--rounds 3] [--steps 30]

Writes ``bench/results/cluster.md`` and ``.json``. Targets (issue 45): time to first step
<= 0.5x Ray Train's; step <= 1.03x the hand-written baseline; a warm pool call <= 0.2x a
launch. Misses are reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
sys.path.insert(0, str(ROOT))


def loop(model, rank, steps, out, t_call):
    """The shared training loop: DDP-wrapped ``model``, SGD, ``steps`` steps; writes the
    wall time of the first step's end and each step's duration."""
    import torch

    torch.manual_seed(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    times, first = [], None
    for i in range(steps):
        t0 = time.time()
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        t1 = time.time()
        if i == 0:
            first = t1
        else:
            times.append(t1 - t0)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"first": first - t_call, "step": statistics.median(times)}, f)


def nbaccel_fn(steps, out, t_call):
    import torch

    from nbaccel import Accelerator

    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(256, 256))
    loop(model, acc.process_index, steps, out, t_call)


def ray_train_fn(config):
    import ray.train
    import ray.train.torch
    import torch

    model = ray.train.torch.prepare_model(torch.nn.Linear(256, 256))
    rank = ray.train.get_context().get_world_rank()
    loop(model, rank, config["steps"], config["out"], config["t_call"])


class HandWritten:
    """The baseline's actor: torch.distributed by hand."""

    def address(self):
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def run(self, rank, master, port, steps, out, t_call):
        import torch
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                                world_size=2)  # fmt: skip
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))
        loop(model, rank, steps, out, t_call)
        dist.destroy_process_group()


def _read(out):
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    return max(r["first"] for r in ranks), max(r["step"] for r in ranks)


def run_nbaccel(steps, out):
    from nbaccel import notebook_launcher

    t = time.time()
    notebook_launcher(nbaccel_fn, (steps, out, t), num_processes=1, num_nodes=2, cluster="ray")
    return _read(out)


def run_ray_train(steps, out, storage):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    t = time.time()
    TorchTrainer(
        ray_train_fn,
        train_loop_config={"steps": steps, "out": out, "t_call": t},
        scaling_config=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(storage_path=storage),
    ).fit()
    return _read(out)


def run_hand(steps, out):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    t = time.time()
    pg = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")
    ray.get(pg.ready())
    actor = ray.remote(HandWritten)
    actors = [
        actor.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote()
        for i in range(2)
    ]  # fmt: skip
    master, port = ray.get(actors[0].address.remote())
    ray.get([a.run.remote(r, master, port, steps, out, t) for r, a in enumerate(actors)])
    for a in actors:
        ray.kill(a)
    remove_placement_group(pg)
    return _read(out)


def run_pool_call(pool, steps, out):
    t = time.time()
    pool.call(nbaccel_fn, (steps, out, t))
    return _read(out)


def _fmt(values, scale=1.0, unit="s"):
    v = [x * scale for x in values]
    return f"{statistics.median(v):.3f} {unit} ({min(v):.3f}-{max(v):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    from conftest import HEAD_IP, LocalCluster

    cluster = LocalCluster()
    try:
        cluster.start()
        import ray

        ray.init(address=cluster.address, _node_ip_address=HEAD_IP, log_to_driver=False)
        from nbaccel import start_workers

        tmp = tempfile.mkdtemp(prefix="nbbench")
        systems = {
            "nbaccel": lambda out: run_nbaccel(args.steps, out),
            "ray_train": lambda out: run_ray_train(args.steps, out, tmp),
            "hand": lambda out: run_hand(args.steps, out),
        }
        for name, fn in systems.items():  # one unrecorded run each
            fn(f"{tmp}/warm-{name}")
        samples: dict[str, list[tuple[float, float]]] = {
            k: [] for k in [*systems, "pool_call", "launch_beside_pool"]
        }
        for i in range(args.rounds):
            for name, fn in systems.items():
                samples[name].append(fn(f"{tmp}/{name}-{i}"))
        # then the warm pool (it holds a CPU per node, which Ray Train's group would wait
        # for), its calls interleaved with launches made beside it
        pool = start_workers(num_processes=1, num_nodes=2, cluster="ray")
        run_pool_call(pool, args.steps, f"{tmp}/warm-pool")
        for i in range(args.rounds):
            samples["pool_call"].append(run_pool_call(pool, args.steps, f"{tmp}/pool-{i}"))
            samples["launch_beside_pool"].append(run_nbaccel(args.steps, f"{tmp}/beside-{i}"))
        pool.close()
    finally:
        with_ray = sys.modules.get("ray")
        if with_ray is not None:
            with_ray.shutdown()
        cluster.stop()
    med = {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
           for k, v in samples.items()}  # fmt: skip
    ratios = {
        "first step: nbaccel / Ray Train (target <= 0.5)": med["nbaccel"][0] / med["ray_train"][0],
        "step: nbaccel / hand-written (target <= 1.03)": med["nbaccel"][1] / med["hand"][1],
        "warm pool call / launch, to first step (target <= 0.2)": med["pool_call"][0]
        / med["launch_beside_pool"][0],
    }
    lines = [
        "# Cluster bench (local 2-node Ray cluster, 1 CPU rank per node, gloo)",
        "",
        f"{args.rounds} interleaved rounds, {args.steps} steps of Linear(256, 256), batch 64; "
        "median (min-max).",
        "",
        "| system | call to first step | step |",
        "|---|---|---|",
    ]
    for name, vals in samples.items():
        lines.append(f"| {name} | {_fmt([a for a, _ in vals])} | "
                     f"{_fmt([b for _, b in vals], 1000, 'ms')} |")  # fmt: skip
    lines += ["", "| ratio | value | met |", "|---|---|---|"]
    targets = [0.5, 1.03, 0.2]
    for (label, value), target in zip(ratios.items(), targets, strict=True):
        lines.append(f"| {label} | {value:.2f} | {'yes' if value <= target else 'MISSED'} |")
    text = "\n".join(lines) + "\n"
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "cluster.md").write_text(text)
    (out_dir / "cluster.json").write_text(json.dumps({"samples": samples, "ratios": ratios}))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
