"""Per-step overhead of nbaccel's training path against hand-written DDP, from a script.

    .venv/bin/python bench/profile_step.py [--rounds 5] [--variants fp32,bf16,accum4]
                                           [--profile cprofile|pyinstrument] [--top 25]

Two forked processes over gloo (one compute thread each) run the training loop of
``bench/scenarios/train.py`` (MLP 256-512-512-10, 8192x256, batch 64 per process,
2 epochs, SGD), hand-written DDP and nbaccel alternately, so both see the same
load. Rank 0 prints, per variant, the median step time of each round and the CPU
time per step (less sensitive to other load than wall time).

``--profile cprofile`` profiles one extra nbaccel loop and one raw loop on rank 0
and prints Python function calls per step and the top entries by own time:
call counts do not depend on the machine's load, so they show the per-step
overhead even on a busy machine. ``--profile pyinstrument`` prints a call tree.
Not part of the test suite; results go into bench/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import itertools
import os
import pstats
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SAMPLES, FEATURES, CLASSES, BATCH, EPOCHS, LR = 8192, 256, 10, 64, 2, 0.05
VARIANTS = {"fp32": ("no", 1), "bf16": ("bf16", 1), "accum4": ("no", 4)}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, CLASSES),
    )


def make_dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
    return TensorDataset(x, y)


def loop_raw(precision: str, accum: int, profiler: Any = None) -> tuple[list[float], float]:
    """bench/scenarios/train.py's train_raw: hand-written DDP."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    autocast_on = precision == "bf16"
    device = torch.device("cpu")
    dist.barrier()
    if profiler is not None:
        profiler.enable()
    ticks, cpu0 = [time.perf_counter()], time.process_time()
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            sync = (i + 1) % accum == 0 or i + 1 == len(loader)
            with model.no_sync() if not sync else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_on):
                    out = model(x)
                loss = F.cross_entropy(out.float(), y) / accum
                loss.backward()
            if sync:
                optimizer.step()
                optimizer.zero_grad()
            ticks.append(time.perf_counter())
    cpu = time.process_time() - cpu0
    if profiler is not None:
        profiler.disable()
    dist.barrier()
    return ticks, cpu


def loop_nbaccel(precision: str, accum: int, profiler: Any = None) -> tuple[list[float], float]:
    """bench/scenarios/train.py's train_nbaccel."""
    from nbaccel import Accelerator

    acc = Accelerator(mixed_precision=precision, gradient_accumulation_steps=accum)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(make_dataset(), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    acc.wait_for_everyone()
    if profiler is not None:
        profiler.enable()
    ticks, cpu0 = [time.perf_counter()], time.process_time()
    for _epoch in range(EPOCHS):
        for x, y in loader:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            ticks.append(time.perf_counter())
    cpu = time.process_time() - cpu0
    if profiler is not None:
        profiler.disable()
    acc.wait_for_everyone()
    return ticks, cpu


LOOPS = {"raw": loop_raw, "nbaccel": loop_nbaccel}


def _median_step(ticks: list[float]) -> float:
    return statistics.median(b - a for a, b in itertools.pairwise(ticks))


def _print_cprofile(name: str, prof: cProfile.Profile, steps: int, top: int) -> None:
    dump = os.environ.get("PROFILE_STEP_DUMP")  # a folder: keep the raw stats for pstats
    if dump:
        prof.dump_stats(os.path.join(dump, name.replace(" ", "-") + ".prof"))
    stats = pstats.Stats(prof)
    calls = sum(v[1] for v in stats.stats.values())  # type: ignore[attr-defined]
    print(f"\n### cProfile, {name}: {calls / steps:.1f} Python-level calls per step")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    text = buf.getvalue()
    print(text[text.find("   ncalls") :])


class _Pyinstrument:
    """pyinstrument's Profiler with cProfile's enable/disable."""

    def __init__(self) -> None:
        from pyinstrument import Profiler

        self.profiler = Profiler(interval=0.0002)
        self.enable, self.disable = self.profiler.start, self.profiler.stop


def _profiler(kind: str) -> Any:
    return cProfile.Profile() if kind == "cprofile" else _Pyinstrument()


def _print_profile(name: str, prof: Any, steps: int, top: int) -> None:
    if isinstance(prof, cProfile.Profile):
        _print_cprofile(name, prof, steps, top)
    else:
        print(f"\n### pyinstrument, {name}")
        print(prof.profiler.output_text(unicode=False, color=False, show_all=False))


def join_gloo_group(rank: int, world: int, port: int) -> None:
    """A forked bench worker: rank environment, one compute thread, the gloo group."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def worker(rank: int, world: int, port: int, opts: argparse.Namespace) -> None:
    join_gloo_group(rank, world, port)
    try:
        steps = EPOCHS * (SAMPLES // (BATCH * world))
        for variant in opts.variants:
            precision, accum = VARIANTS[variant]
            LOOPS["nbaccel"](precision, accum)  # warm-up (first-use costs of both paths)
            LOOPS["raw"](precision, accum)
            medians: dict[str, list[float]] = {"raw": [], "nbaccel": []}
            cpus: dict[str, list[float]] = {"raw": [], "nbaccel": []}
            for r in range(opts.rounds):
                order = ("raw", "nbaccel") if r % 2 == 0 else ("nbaccel", "raw")
                for system in order:
                    ticks, cpu = LOOPS[system](precision, accum)
                    medians[system].append(_median_step(ticks))
                    cpus[system].append(cpu / steps)
            if rank == 0:
                print(f"\n## {variant}: {opts.rounds} interleaved rounds, {steps} steps each")
                for system in ("raw", "nbaccel"):
                    ms = [m * 1e3 for m in medians[system]]
                    cpu_ms = [c * 1e3 for c in cpus[system]]
                    print(
                        f"{system:8s} median step {statistics.median(ms):.3f} ms "
                        f"({min(ms):.3f}-{max(ms):.3f}); CPU/step "
                        f"{statistics.median(cpu_ms):.3f} ms ({min(cpu_ms):.3f}-{max(cpu_ms):.3f})"
                    )
                ratios = [n / r for n, r in zip(medians["nbaccel"], medians["raw"], strict=True)]
                cpu_ratios = [n / r for n, r in zip(cpus["nbaccel"], cpus["raw"], strict=True)]
                print(
                    f"ratio nbaccel/raw per round: median {statistics.median(ratios):.3f} "
                    f"({min(ratios):.3f}-{max(ratios):.3f}); CPU/step ratio "
                    f"{statistics.median(cpu_ratios):.3f}"
                )
            if opts.profile:
                for system in ("raw", "nbaccel"):
                    prof: Any = _profiler(opts.profile) if rank == 0 else None
                    LOOPS[system](precision, accum, prof)
                    if rank == 0:
                        _print_profile(f"{variant} {system}", prof, steps, opts.top)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default="fp32,bf16,accum4")
    parser.add_argument("--profile", choices=("cprofile", "pyinstrument"))
    parser.add_argument("--top", type=int, default=25)
    opts = parser.parse_args()
    opts.variants = [v for v in opts.variants.split(",") if v]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    import nbaccel

    print(f"nbaccel from {nbaccel.__file__}; torch {torch.__version__}", flush=True)
    importlib.import_module("torch._dynamo")  # DDP and optimizers need it: once, before forking
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(2, port, opts), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
