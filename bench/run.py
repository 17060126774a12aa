"""Run every nbaccel benchmark from real IPython kernels and write a table.

    .venv/bin/python bench/run.py [--quick] [--out bench/results] [--only launch,train,...]

The driver (this file) runs in any interpreter with ``jupyter_client``; it starts
kernels with the benchmark interpreter (``bench/.peers-venv/bin/python`` when
``bench/setup_peers.sh`` created it, so nbaccel, accelerate and Lightning share one
interpreter and one torch; otherwise the driver's own interpreter, nbaccel and the
hand-written baseline only). Each scenario's kernel-side code lives in
``bench/scenarios/*.py`` and is executed as notebook cells, so every launched
function is notebook-defined. Systems are interleaved (A B C A B C ...).

Writes ``<out>/latest.json`` (every sample) and ``<out>/latest.md`` (the table).
See bench/README.md for the method.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(BENCH))

from kernel_harness import KernelSession, isolated_env  # noqa: E402
from report import machine_info, render_markdown  # noqa: E402

SCENARIOS = (
    "launch", "train", "gather", "spawn", "checkpoint", "pool", "memory", "fsdp", "monitor",
    "zero2",
)  # fmt: skip
CELLS = ("common", "launch", "train", "gather", "spawn", "checkpoint", "pool", "memory", "fsdp",
         "monitor", "zero2")  # fmt: skip
IMPORTS = {  # what a notebook using each system imports in its first cell
    "raw": "import torch.multiprocessing",
    "nbaccel": "from nbaccel import Accelerator, notebook_launcher",
    "accelerate": "from accelerate import Accelerator, notebook_launcher",
    "fabric": "from lightning.fabric import Fabric",
}


class CellFailed(RuntimeError):
    """A measurement cell raised in the kernel."""


class Bench:
    """One kernel plus helpers to evaluate a measurement expression."""

    def __init__(self, python: str, cache: str) -> None:
        # Hermetic (no NBACCEL_* / user config); bytecode caching on, as for a user
        # (the editable nbaccel would otherwise be recompiled on every import).
        env = {**isolated_env(cache), "PYTHONDONTWRITEBYTECODE": None}
        self.kernel = KernelSession(python, cwd=str(ROOT), env=env, startup_timeout=120)

    def __enter__(self) -> Bench:
        self.kernel.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # accelerate's launcher leaves torch.distributed.elastic's SIGTERM handler
        # installed in the kernel, which then prints a traceback when shut down.
        with contextlib.suppress(Exception):
            self.kernel.execute("import signal; signal.signal(signal.SIGTERM, signal.SIG_DFL)", 10)
        self.kernel.stop()

    def run(self, code: str, timeout: float = 300) -> float:
        cell = self.kernel.execute(code, timeout)
        if cell.status != "ok":
            raise CellFailed(_error_text(cell))
        return cell.elapsed

    def call(self, expr: str, timeout: float = 300) -> Any:
        cell = self.kernel.execute(f"bench_json({expr})", timeout)
        if cell.status != "ok" or cell.text is None:
            raise CellFailed(_error_text(cell))
        return json.loads(ast.literal_eval(cell.text))

    def load_cells(self, names: tuple[str, ...] = CELLS) -> None:
        for name in names:
            self.run((BENCH / "scenarios" / f"{name}.py").read_text(), timeout=300)


def _error_text(cell: Any) -> str:
    if cell.error is not None:
        return f"{cell.error.ename}: {cell.error.evalue}"[:400]
    return f"cell status {cell.status}"


def _record(samples: list, fn: Callable[[], Any], errors: list, label: str) -> None:
    try:
        samples.append(fn())
    except Exception as err:  # keep going: a failed system is reported, not fatal
        errors.append(f"{label}: {str(err)[:300]}")
        print(f"  ! {label}: {str(err)[:200]}", flush=True)


def bench_cold(python: str, systems: list[str], reps: int, cache: str, res: dict) -> None:
    """Cold launch: a fresh kernel per sample; import cell, then the first launch."""
    for rep in range(reps):
        for system in systems:
            label = f"cold {system} #{rep}"
            print(f"- {label}", flush=True)

            def sample(system: str = system) -> dict[str, float]:
                with Bench(python, cache) as bench:
                    imports = f"import torch, torch.distributed\n{IMPORTS[system]}"
                    import_s = bench.run(imports)
                    bench.load_cells(("common", "launch"))
                    first = bench.call(f"bench_launch_once({system!r})")
                return {"import_s": import_s, "launch_s": first}

            _record(res["samples"].setdefault(f"cold/{system}", []), sample, res["errors"], label)
    for rep in range(reps):  # issue 26: the first launch of a training function
        for system in [s for s in systems if s in ("raw", "nbaccel")]:
            label = f"coldtrain {system} #{rep}"
            print(f"- {label}", flush=True)

            def train(system: str = system) -> dict[str, float]:
                with Bench(python, cache) as bench:
                    bench.run(f"import torch, torch.distributed\n{IMPORTS[system]}")
                    bench.load_cells(("common", "launch"))
                    return {"launch_s": bench.call(f"bench_first_train_once({system!r})")}

            _record(
                res["samples"].setdefault(f"coldtrain/{system}", []), train, res["errors"], label
            )


def bench_main(
    bench: Bench, systems: list[str], scenarios: list[str], cfg: dict, res: dict
) -> None:
    """Everything else in one kernel, systems interleaved within every round."""
    samples, errors = res["samples"], res["errors"]

    def rounds(name: str, reps: int, variants: list[tuple[str, str]], timeout: float) -> None:
        for rep in range(reps):
            for key, expr in variants:
                label = f"{name} {key} #{rep}"
                print(f"- {label}", flush=True)
                _record(
                    samples.setdefault(f"{name}/{key}", []),
                    lambda expr=expr: bench.call(expr, timeout),
                    errors,
                    label,
                )

    if "launch" in scenarios:
        # one unrecorded round first: the first launch of each system in this kernel
        rounds("warmup", 1, [(s, f"bench_launch_once({s!r})") for s in systems], 300)
        rounds("warm", cfg["warm"], [(s, f"bench_launch_once({s!r})") for s in systems], 120)
        samples.pop("warmup", None)
    if "train" in scenarios:
        for variant, args in (("fp32", "'no', 1"), ("bf16", "'bf16', 1"), ("accum4", "'no', 4")):
            expr = [(s, f"bench_train_once({s!r}, {args})") for s in systems]
            rounds(f"train-{variant}", cfg["train"], expr, 600)
    if "gather" in scenarios:
        rounds("gather", cfg["gather"], [(s, f"bench_gather_once({s!r})") for s in systems], 300)
    if "spawn" in scenarios:
        refs = ["nbaccel-spawn", "nbaccel-fork", "raw-spawn"]
        if "fabric" in systems:
            refs.append("fabric-spawn")
        rounds("spawn", cfg["spawn"], [(s, f"bench_spawn_once({s!r})") for s in refs], 300)
    if "checkpoint" in scenarios:
        ck = ["raw", "raw+fsync"] + [s for s in systems if s != "raw"]
        rounds(
            "checkpoint", cfg["checkpoint"], [(s, f"bench_checkpoint_once({s!r})") for s in ck], 900
        )
    if "pool" in scenarios and "nbaccel" in systems:  # issue 14: warm workers
        bench.run("bench_pool_start()")
        try:
            launcher = ("launcher", "bench_launch_once('nbaccel')")
            rounds("poolwarmup", 1, [("pool", "bench_pool_call_once()"), launcher], 300)
            for key in ("poolwarmup/pool", "poolwarmup/launcher"):
                samples.pop(key, None)  # first calls: not recorded
            rounds("poolcall", cfg["warm"], [("pool", "bench_pool_call_once()"), launcher], 120)
            train3 = [(k, f"bench_pool_train3({k!r})") for k in ("pool", "launcher")]
            rounds("pooltrain", cfg["train"], train3, 600)
            rounds("poolmem", cfg["memory"], [("pool", "bench_pool_memory()")], 300)
        finally:
            bench.run("bench_pool_close()")
    if "fsdp" in scenarios:  # nbaccel only: DDP vs FSDP2, interleaved, same model and data
        kinds = ("ddp", "fsdp", "ddp+mmap", "fsdp+mmap")
        variants = [(k, f"bench_fsdp_once({k!r})") for k in kinds]
        rounds("fsdp", cfg["fsdp"], variants, 600)
    if "zero2" in scenarios:  # issue 36: FSDP2 / nbaccel+DeepSpeed / DeepSpeed by hand
        if bench.call("__import__('importlib').util.find_spec('deepspeed') is not None"):
            variants = [(k, f"bench_zero2_once({k!r})") for k in ("fsdp2", "nbaccel", "deepspeed")]
            rounds("zero2warmup", 1, variants, 600)  # DeepSpeed's first import: not recorded
            for key, _ in variants:
                samples.pop(f"zero2warmup/{key}", None)
            rounds("zero2", cfg["zero2"], variants, 600)
        else:
            errors.append("zero2: deepspeed is not installed in the kernel's interpreter")
    if "monitor" in scenarios and "nbaccel" in systems:  # issue 28: the live monitor's cost
        kinds = ("off", "log", "log+watch")
        rounds("monitorwarmup", 1, [(k, f"bench_monitor_once({k!r})") for k in kinds], 600)
        for kind in kinds:
            samples.pop(f"monitorwarmup/{kind}", None)
        variants = [(k, f"bench_monitor_once({k!r})") for k in kinds]
        rounds("monitor", cfg["monitor"], variants, 600)
        rounds("monitorrender", 1, [("render", "bench_monitor_render()")], 300)
    if "memory" in scenarios:  # last: the 1 GiB array stays out of the other scenarios
        bench.run("mem_alloc()")
        rounds("memory", cfg["memory"], [(s, f"bench_memory_once({s!r})") for s in systems], 300)
        bench.run("mem_free()")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 sample per measurement")
    parser.add_argument("--out", default=str(BENCH / "results"), help="output folder")
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    parser.add_argument("--systems", default=None, help="e.g. raw,nbaccel (default: all installed)")
    parser.add_argument("--python", default=None, help="kernel interpreter")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-launch kernels")
    parser.add_argument("--note", default="", help="free text for the results header")
    args = parser.parse_args(argv)

    scenarios = [s for s in args.only.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    peers_python = BENCH / ".peers-venv" / "bin" / "python"
    python = args.python or (str(peers_python) if peers_python.exists() else sys.executable)
    q = args.quick
    cfg = {"cold": 1 if q else 3, "warm": 3 if q else 15, "train": 1 if q else 4}
    cfg.update(gather=1 if q else 3, spawn=1 if q else 3, checkpoint=1 if q else 2)
    cfg["memory"] = 1 if q else 3
    cfg["fsdp"] = 1 if q else 3
    cfg["zero2"] = 1 if q else 5
    cfg["monitor"] = 1 if q else 7
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="nbaccel-bench-cache-")
    res: dict[str, Any] = {"samples": {}, "errors": [], "config": cfg, "scenarios": scenarios}
    t0 = time.time()
    load_before = os.getloadavg()
    with Bench(python, cache) as bench:
        bench.run("import torch, torch.distributed")
        bench.load_cells()
        installed = bench.call("bench_available()")
        systems = args.systems.split(",") if args.systems else installed
        missing = [s for s in systems if s not in installed]
        if missing:
            parser.error(f"system(s) {missing} not installed in {python}; run bench/setup_peers.sh")
        imports = "\n".join(IMPORTS[s] for s in systems)
        if {"train", "gather", "checkpoint", "fsdp", "monitor", "zero2"} & set(scenarios):
            # DDP's constructor imports torch._dynamo (seconds); do it once here rather
            # than in every worker of every launch (same for every system, see README).
            imports += "\nimport torch._dynamo"
        bench.run(f"{imports}\nbench_quiet_peers()")
        res["machine"] = machine_info(bench.call("bench_versions()"), python)
        res["systems"] = systems
        print(f"systems: {systems}; kernel python: {python}", flush=True)
        if "launch" in scenarios and not args.no_cold:
            bench_cold(python, systems, cfg["cold"], cache, res)
        bench_main(bench, systems, scenarios, cfg, res)
    res["machine"]["load_before"] = [round(x, 2) for x in load_before]
    res["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    res["machine"]["note"] = args.note
    res["wall_s"] = round(time.time() - t0, 1)
    (out / "latest.json").write_text(json.dumps(res, indent=1))
    (out / "latest.md").write_text(render_markdown(res))
    print(f"wrote {out / 'latest.md'} and latest.json in {res['wall_s']} s", flush=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
