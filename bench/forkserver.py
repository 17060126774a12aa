"""CPU benchmark of the fork server: a launch after the kernel "touched CUDA" vs spawn vs fork.

    .venv/bin/python bench/forkserver.py [--rounds 7] [--out bench/results]

Two real kernels (tests/kernel_harness.py, as Jupyter starts them), the launches made as
notebook cells of a notebook-defined function on 2 processes (gloo), as bench/README.md:

* ``clean``: a kernel that never touched CUDA; nbaccel forks the workers from it (the
  baseline: a clean fork).
* ``touched``: ``%load_ext nbaccel`` in its first cell took the fork server, then the CUDA
  driver was initialised. On this CPU machine the driver is the stand-in of
  tests/platform/fake_cuda.py (the test suite's simulated driver-touched state): forking
  from the kernel is refused as on a GPU, so ``auto`` forks the workers from the server;
  ``spawn`` is the other choice nbaccel had before.

Interleaved (clean fork, server fork, spawn, clean fork, ...), one unrecorded warm-up
each; medians with min–max; ratios against the clean fork of the same run. The server's
unique memory (USS, psutil) is reported: forked from the kernel, it shares its pages
copy-on-write. Writes ``<out>/forkserver.json`` and ``<out>/forkserver.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from kernel_harness import KernelSession, isolated_env  # noqa: E402
from report import _r, cell, machine_info, med, ratio  # noqa: E402

CELL = """
import os, time
from nbaccel import notebook_launcher

def work(scale):
    import os
    return int(os.environ["RANK"]) * scale

def once(method):
    t0 = time.perf_counter()
    got = notebook_launcher(work, args=(2,), num_processes=2, start_method=method,
                            return_all_ranks=True)
    assert got == [0, 2], got
    return time.perf_counter() - t0
"""
SYSTEMS = {  # sample name -> (kernel, start_method asked)
    "fork (clean kernel)": ("clean", "fork"),
    "fork server (CUDA touched)": ("touched", "auto"),
    "spawn (CUDA touched)": ("touched", "spawn"),
}


def start_kernels(folder: Path, driver: Path) -> dict[str, KernelSession]:
    kernels = {}
    for name, server in (("clean", "0"), ("touched", "1")):
        env = {**isolated_env(folder), "NBACCEL_FORK_SERVER": server}
        session = KernelSession(cwd=str(ROOT), env=env, startup_timeout=120).start()
        session.run(CELL, timeout=300)
        if name == "touched":
            session.run(f"import ctypes\ndrv = ctypes.CDLL({str(driver)!r})")
            session.run("%load_ext nbaccel")  # the notebook's first cell: the server
            session.run("drv.cuInit(0)  # torch.cuda.is_available(), on a GPU")
        kernels[name] = session
    return kernels


def sample(kernels: dict[str, KernelSession], method_of: tuple[str, str]) -> float:
    kernel, method = method_of
    return float(kernels[kernel].evaluate(f"once({method!r})", timeout=300))


def measure(rounds: int, folder: Path) -> dict[str, Any]:
    from fake_cuda import build_fake_driver

    res: dict[str, Any] = {"samples": {}, "errors": [], "rounds": rounds}
    kernels = start_kernels(folder, build_fake_driver(folder))
    try:
        touched = kernels["touched"]
        res["server_pid"] = touched.evaluate_json("__import__('nbaccel.launch.start._forkserver')"
                                                  ".launch.start._forkserver.server_pid()")  # fmt: skip
        for spec in SYSTEMS.values():  # warm-up, unrecorded
            sample(kernels, spec)
        for _ in range(rounds):
            for name, spec in SYSTEMS.items():
                res["samples"].setdefault(name, []).append(sample(kernels, spec))
        parent = touched.evaluate_json(
            "notebook_launcher(lambda: os.getppid(), num_processes=2, return_all_ranks=True)"
        )
        res["server_forked_them"] = parent == [res["server_pid"]] * 2
        server, kernel = psutil.Process(res["server_pid"]), psutil.Process(touched.pid)
        res["memory"] = {
            "server_uss": server.memory_full_info().uss,
            "server_rss": server.memory_info().rss,
            "kernel_uss": kernel.memory_full_info().uss,
            "kernel_rss": kernel.memory_info().rss,
        }
    finally:
        for session in kernels.values():
            session.stop()
    return res


def render(res: dict[str, Any]) -> str:
    m, mem = res["machine"], res["memory"]
    base = med(res, "fork (clean kernel)")
    mib = 1 / (1 << 20)
    lines = [
        "# Fork server (CPU): launch after the kernel touched CUDA",
        "",
        f"{m['date']} · {m['cpu']}, {m['cores']} cores · Python {m['python']}, torch "
        f"{m['torch']}, nbaccel {m['nbaccel']} (commit {m['commit']}) · {res['rounds']} "
        f"interleaved rounds · whole run {res['wall_s']} s",
        "",
        "A launch: `notebook_launcher` of a notebook-defined function on 2 processes (gloo), "
        "call to results back, from a real kernel. The CUDA driver is the test suite's "
        "stand-in (tests/platform/fake_cuda.py). Median (min–max) in ms; ratio against the "
        "clean kernel's fork of the same run. Method: bench/forkserver.py.",
        "",
        "| Launch | time (ms) | vs clean fork |",
        "|---|---|---|",
    ]
    for name in SYSTEMS:
        lines.append(
            f"| {name} | {cell(res, name, scale=1e3)} | {_r(ratio(med(res, name), base))} |"
        )
    lines += [
        "",
        f"Workers forked by the server: {'yes' if res['server_forked_them'] else '**NO**'} "
        "(their parent pid is the server's).",
        "",
        "| Process | USS (MiB) | RSS (MiB) |",
        "|---|---|---|",
        f"| fork server | {mem['server_uss'] * mib:.1f} | {mem['server_rss'] * mib:.1f} |",
        f"| kernel | {mem['kernel_uss'] * mib:.1f} | {mem['kernel_rss'] * mib:.1f} |",
        "",
        "USS: memory only this process holds; the server shares the rest with the kernel "
        "copy-on-write. The GPU target (a launch after CUDA was touched ≤ 1.2× a clean fork "
        "on the H100/H200) is measured by bench/gpu.py's `forkserver` part, not here.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="nbaccel-forkserver-bench-") as folder:
        res = measure(args.rounds, Path(folder))
    import torch

    import nbaccel

    versions = {
        "torch": torch.__version__,
        "nbaccel": nbaccel.__version__,
        "python": sys.version.split()[0],
    }
    res["machine"] = machine_info(versions,
                                  sys.executable)  # fmt: skip
    res["wall_s"] = round(time.time() - t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "forkserver.json").write_text(json.dumps(res, indent=1))
    text = render(res)
    (out / "forkserver.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
