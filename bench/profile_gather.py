"""Cost of ``gather_for_metrics`` against a raw ``all_gather``, call by call, from a script.

    .venv/bin/python bench/profile_gather.py [--passes 5] [--profile]

Two forked processes over gloo (one compute thread each) walk the evaluation set of
``bench/scenarios/gather.py`` (8191 samples, batch 64 per process) through a prepared
DataLoader. For every batch both gathers run on the same tensors, one after the
other, in alternating order: the hand-written one (``dist.all_gather`` of the
predictions and of the sample indices, what the scenario's raw system does) and
``Accelerator.gather_for_metrics((pred, idx))``. Pairing call by call makes the ratio
insensitive to load that drifts over seconds. Rank 0 prints, per pass, the summed
time of each and their ratio, and the median over passes.

``--profile`` adds one cProfile'd pass of each on rank 0: Python calls per gather
(independent of the machine's load) and the top entries by own time.
Not part of the test suite; results go into bench/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

SAMPLES, FEATURES, CLASSES, BATCH = 8191, 256, 10, 64


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 512), torch.nn.ReLU(), torch.nn.Linear(512, CLASSES)
    )


def make_dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(SAMPLES, FEATURES, generator=gen), torch.arange(SAMPLES))


def raw_gather(pred: torch.Tensor, idx: torch.Tensor) -> list[torch.Tensor]:
    """bench/scenarios/gather.py's hand-written gather."""
    outs = []
    for t in (pred, idx):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        outs.append(torch.cat(parts))
    return outs


def one_pass(acc: Any, model: Any, loader: Any, profile: str | None) -> dict[str, Any]:
    """One pass over the loader; both gathers on every batch, alternating which goes first."""
    ours: Callable[[Any, Any], Any] = lambda p, i: acc.gather_for_metrics((p, i))  # noqa: E731
    spent = {"raw": 0.0, "nbaccel": 0.0}
    prof = cProfile.Profile() if profile else None
    seen: list[int] = []
    calls = 0
    with torch.no_grad():
        for n, (x, idx) in enumerate(loader):
            pred = model(x).argmax(dim=-1)
            order = ("raw", "nbaccel") if n % 2 == 0 else ("nbaccel", "raw")
            for system in order:
                fn = raw_gather if system == "raw" else ours
                if prof is not None and system == profile:
                    prof.enable()
                t0 = time.perf_counter()
                out = fn(pred, idx)
                spent[system] += time.perf_counter() - t0
                if prof is not None and system == profile:
                    prof.disable()
                if system == "nbaccel":
                    seen.extend(out[1].tolist())
            calls += 1
    return {
        "spent": spent,
        "exact": sorted(seen) == list(range(SAMPLES)),
        "prof": prof,
        "calls": calls,
    }


def print_profile(name: str, prof: cProfile.Profile, calls: int) -> None:
    stats = pstats.Stats(prof)
    total = sum(v[1] for v in stats.stats.values())  # type: ignore[attr-defined]
    print(f"\n### cProfile, {name}: {total / calls:.1f} Python-level calls per gather")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
    text = buf.getvalue()
    print(text[text.find("   ncalls") :])


def worker(rank: int, world: int, port: int, opts: argparse.Namespace) -> None:
    from profile_step import join_gloo_group  # bench/ is the script's folder

    join_gloo_group(rank, world, port)
    try:
        from nbaccel import Accelerator

        acc = Accelerator()
        model = acc.prepare(make_model()).eval()
        loader = acc.prepare(DataLoader(make_dataset(), batch_size=BATCH))
        one_pass(acc, model, loader, None)  # warm-up
        ratios, raw_ms, our_ms, exact = [], [], [], True
        for _ in range(opts.passes):
            res = one_pass(acc, model, loader, None)
            raw_ms.append(res["spent"]["raw"] * 1e3)
            our_ms.append(res["spent"]["nbaccel"] * 1e3)
            ratios.append(our_ms[-1] / raw_ms[-1])
            exact = exact and res["exact"]
        if rank == 0:
            print(
                f"{opts.passes} passes of {res['calls']} batches; gather_for_metrics exact: {exact}"
            )
            for p, (r, o, q) in enumerate(zip(raw_ms, our_ms, ratios, strict=True)):
                print(f"pass {p}: raw {r:7.2f} ms  nbaccel {o:7.2f} ms  ratio {q:.3f}")
            print(
                f"median: raw {statistics.median(raw_ms):.2f} ms, nbaccel "
                f"{statistics.median(our_ms):.2f} ms, ratio {statistics.median(ratios):.3f} "
                f"({min(ratios):.3f}-{max(ratios):.3f})"
            )
        if opts.profile:
            for system in ("raw", "nbaccel"):
                res = one_pass(acc, model, loader, system if rank == 0 else None)
                if rank == 0:
                    print_profile(system, res["prof"], res["calls"])
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    opts = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    import nbaccel

    print(f"nbaccel from {nbaccel.__file__}; torch {torch.__version__}", flush=True)
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(2, port, opts), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
