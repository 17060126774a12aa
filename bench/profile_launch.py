"""Where a warm launch's time goes: nbaccel against a hand-written fork, from a script.

    .venv/bin/python bench/profile_launch.py [--launches 16]

Both launch 2 forked workers that form a gloo group, all-reduce one tensor and meet
at a barrier (bench/scenarios/launch.py's work; nbaccel's creates an Accelerator).
Launches alternate (raw, nbaccel, nbaccel, raw, ...), so both see the same load.
Printed, medians (min-max):

* per launch: wall time, the launching process's CPU and page faults, and the
  workers' (``getrusage``; page faults are mostly copy-on-write after ``fork``);
* the wall ratio, launch by launch;
* nbaccel's worker timeline: when each bootstrap phase starts and ends on each rank,
  in ms from the call (wrappers around the bootstrap's functions write timestamps).

Not part of the test suite; results go into bench/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import resource
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nbaccel import Accelerator, notebook_launcher
from nbaccel.launch.channel import _rendezvous
from nbaccel.launch.worker import _worker
from nbaccel.platform import torchcompat


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _raw_entry(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _nbaccel_fn() -> None:
    acc = Accelerator()
    t = torch.ones(1, device=acc.device)
    dist.all_reduce(t)
    acc.wait_for_everyone()


def launch_raw() -> None:
    mp.start_processes(_raw_entry, args=(2, _port()), nprocs=2, start_method="fork")


def launch_nbaccel() -> None:
    notebook_launcher(_nbaccel_fn, num_processes=2)


def _usage() -> tuple[float, ...]:
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return (
        time.perf_counter(),
        own.ru_utime + own.ru_stime,
        kids.ru_utime + kids.ru_stime,
        own.ru_minflt,
        kids.ru_minflt,
    )


COLUMNS = ("wall ms", "own CPU ms", "workers' CPU ms", "own faults", "workers' faults")
SCALE = (1e3, 1e3, 1e3, 1, 1)


def _fmt(values: list[float], digits: int = 1) -> str:
    med, low, high = statistics.median(values), min(values), max(values)
    return f"{med:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def compare(launches: int) -> None:
    systems: dict[str, Callable[[], None]] = {"raw": launch_raw, "nbaccel": launch_nbaccel}
    for fn in (*systems.values(), *systems.values()):  # warm-up
        fn()
    rows: dict[str, list[list[float]]] = {name: [] for name in systems}
    for i in range(launches):
        order = ("raw", "nbaccel") if i % 2 == 0 else ("nbaccel", "raw")
        for name in order:
            before = _usage()
            systems[name]()
            after = _usage()
            rows[name].append([(b - a) * s for a, b, s in zip(before, after, SCALE, strict=True)])
    print(f"## {launches} launches each, interleaved")
    print("| | " + " | ".join(COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS))
    for name, samples in rows.items():
        cols = list(zip(*samples, strict=True))
        print(f"| {name} | " + " | ".join(_fmt(list(c)) for c in cols) + " |")
    ratios = [n[0] / r[0] for n, r in zip(rows["nbaccel"], rows["raw"], strict=True)]
    print(f"\nwall ratio nbaccel/raw per pair: {_fmt(ratios, 3)}")


def timeline(launches: int) -> None:
    """Timestamps of the bootstrap's phases in nbaccel's workers, relative to the call."""
    log = os.path.join(tempfile.mkdtemp(), "timeline")
    phases = [
        (_worker, "_setup"),
        (_rendezvous, "host_store"),
        (_rendezvous, "connect_exit_client"),
        (_rendezvous, "leave"),
        (torchcompat, "destroy_process_group"),
    ]
    originals = [(module, name, getattr(module, name)) for module, name in phases]

    def timed(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                with open(log, "a") as f:
                    f.write(f"{os.environ.get('RANK')} {label} {start:.6f} {time.time():.6f}\n")

        return wrapper

    def user_fn() -> None:
        start = time.time()
        _nbaccel_fn()
        with open(log, "a") as f:
            f.write(f"{os.environ.get('RANK')} function {start:.6f} {time.time():.6f}\n")

    for module, name, fn in originals:
        setattr(module, name, timed(fn, name))
    try:
        notebook_launcher(user_fn, num_processes=2)
        rows: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for _ in range(launches):
            open(log, "w").close()
            t0 = time.time()
            notebook_launcher(user_fn, num_processes=2)
            total = time.time() - t0
            with open(log) as f:
                lines = f.read().split("\n")
            for line in filter(None, lines):
                rank, label, start, end = line.split()
                rows[f"{label}, rank {rank}"].append(
                    ((float(start) - t0) * 1e3, (float(end) - t0) * 1e3)
                )
            rows["the launch call returns"].append((total * 1e3, total * 1e3))
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
    print(f"\n## nbaccel worker timeline, median of {launches} launches (ms from the call)")
    print("| phase | starts | ends |\n|---|---|---|")
    for label, spans in sorted(rows.items(), key=lambda kv: statistics.median(s for s, _ in kv[1])):
        starts, ends = [s for s, _ in spans], [e for _, e in spans]
        print(f"| {label} | {statistics.median(starts):.1f} | {statistics.median(ends):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=16)
    opts = parser.parse_args()
    print(f"torch {torch.__version__}; load average {os.getloadavg()}")
    compare(opts.launches)
    timeline(max(4, opts.launches // 2))


if __name__ == "__main__":
    main()
