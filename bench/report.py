"""Turn the samples collected by bench/run.py into the markdown results table.

Every number is the median over the interleaved samples, with min–max in
parentheses. Targets (issues 7 and 16) are ratios against the hand-written baseline
measured in the same run; each is marked PASS or MISS as measured.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import subprocess
from typing import Any

import psutil

SYSTEMS = ("raw", "nbaccel", "accelerate", "fabric")
NAMES = {
    "raw": "hand-written torch",
    "nbaccel": "nbaccel",
    "accelerate": "accelerate",
    "fabric": "Lightning Fabric",
    "raw+fsync": "torch.save + fsync",
    "nbaccel-spawn": "nbaccel spawn",
    "nbaccel-fork": "nbaccel fork",
    "raw-spawn": "hand-written spawn",
    "fabric-spawn": "Fabric ddp_spawn",
}


def project_commit(root: str) -> str:
    """The commit of the repository whose root is ``root``: ``NBACCEL_COMMIT`` when set (a
    copy without .git, e.g. on a GPU machine), else git, but only when ``root`` is the top of
    the repository (a copy inside another repository must not name that one's commit)."""
    given = os.environ.get("NBACCEL_COMMIT", "").strip()
    if given:
        return given
    with contextlib.suppress(Exception):
        git = ["git", "-C", root]
        top = subprocess.run(
            [*git, "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True
        ).stdout.strip()
        if os.path.realpath(top) != os.path.realpath(root):
            return f"unknown ({root} is no git checkout; set NBACCEL_COMMIT)"
        commit = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "nbaccel"], capture_output=True, text=True
        ).stdout.strip()
        return commit + (" + uncommitted changes in nbaccel/" if dirty else "")
    return "unknown (no git; set NBACCEL_COMMIT)"


def machine_info(versions: dict[str, Any], python: str) -> dict[str, Any]:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(
                line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = project_commit(root)
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "commit": commit,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "kernel_python": python,
        **versions,
    }


# ------------------------------------------------------------------ statistics
def _values(samples: list[Any], key: str | None) -> list[float]:
    out = []
    for sample in samples:
        value = sample if key is None else sample.get(key) if isinstance(sample, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            out.append(float(value))
    return out


def med(res: dict, name: str, key: str | None = None) -> float | None:
    values = _values(res["samples"].get(name, []), key)
    return statistics.median(values) if values else None


def cell(
    res: dict, name: str, key: str | None = None, scale: float = 1.0, fmt: str = "{:.0f}"
) -> str:
    values = _values(res["samples"].get(name, []), key)
    if not values:
        errors = [e for e in res["errors"] if e.startswith(name.replace("/", " "))]
        return "failed" if errors else "–"
    m, lo, hi = statistics.median(values), min(values), max(values)
    if len(values) == 1:
        return fmt.format(m * scale)
    return f"{fmt.format(m * scale)} ({fmt.format(lo * scale)}–{fmt.format(hi * scale)})"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**PASS**" if ok else "**MISS**")


def _r(x: float | None, fmt: str = "{:.2f}×") -> str:
    return "–" if x is None else fmt.format(x)


# ------------------------------------------------------------------ tables
def targets(res: dict) -> list[str]:
    rows = [
        "| Target (issues 7, 16) | nbaccel | baseline (same run) | measured | target | result |",
        "|---|---|---|---|---|---|",
    ]
    w = ratio(med(res, "warm/nbaccel"), med(res, "warm/raw"))
    rows.append(
        f"| Warm launch latency | {cell(res, 'warm/nbaccel', scale=1e3)} ms | "
        f"{cell(res, 'warm/raw', scale=1e3)} ms raw fork | {_r(w)} | ≤ 1.10× | "
        f"{verdict(None if w is None else w <= 1.10)} |"
    )
    cold = ratio(med(res, "cold/nbaccel", "launch_s"), med(res, "cold/accelerate", "launch_s"))
    rows.append(
        f"| Cold first launch in a fresh kernel | {cell(res, 'cold/nbaccel', 'launch_s', 1, '{:.2f}')} s | "
        f"{cell(res, 'cold/accelerate', 'launch_s', 1, '{:.2f}')} s accelerate | {_r(cold)} | ≤ 1.5× | "
        f"{verdict(None if cold is None else cold <= 1.5)} |"
    )
    first = ratio(med(res, "coldtrain/nbaccel", "launch_s"), med(res, "coldtrain/raw", "launch_s"))
    rows.append(
        f"| First launch of a training function, fresh kernel (issue 26) | "
        f"{cell(res, 'coldtrain/nbaccel', 'launch_s', 1, '{:.2f}')} s | "
        f"{cell(res, 'coldtrain/raw', 'launch_s', 1, '{:.2f}')} s raw fork + DDP | {_r(first)} | "
        f"≤ 1.10× | {verdict(None if first is None else first <= 1.10)} |"
    )
    for variant in ("fp32", "bf16", "accum4"):
        n = f"train-{variant}/"
        r = ratio(med(res, n + "nbaccel", "median_step_s"), med(res, n + "raw", "median_step_s"))
        rows.append(
            f"| Median step time, {variant} | {cell(res, n + 'nbaccel', 'median_step_s', 1e3, '{:.2f}')} ms | "
            f"{cell(res, n + 'raw', 'median_step_s', 1e3, '{:.2f}')} ms raw DDP | {_r(r)} | ≤ 1.03× | "
            f"{verdict(None if r is None else r <= 1.03)} |"
        )
        for peer in ("accelerate", "fabric"):
            r = ratio(med(res, n + "nbaccel", "median_step_s"), med(res, n + peer, "median_step_s"))
            if r is None:
                continue
            rows.append(
                f"| Step time vs {NAMES[peer]}, {variant} | | {cell(res, n + peer, 'median_step_s', 1e3, '{:.2f}')} ms | "
                f"{_r(r)} | ≤ 1.03× (same or better) | {verdict(r <= 1.03)} |"
            )
    threads = [
        t
        for s in res["samples"].get("train-fp32/nbaccel", [])
        for t in s.get("default_threads_all_ranks", [])
    ]
    share = max(1, (res.get("machine", {}).get("cores") or 1) // 2)
    rows.append(
        f"| Worker compute threads (nbaccel default) | {sorted(set(threads)) or '–'} | share = {share} | | ≤ share | "
        f"{verdict(None if not threads else max(threads) <= share)} |"
    )
    g = ratio(med(res, "gather/nbaccel", "gather_s"), med(res, "gather/raw", "gather_s"))
    exact = [s.get("exact") for s in res["samples"].get("gather/nbaccel", [])]
    rows.append(
        f"| gather_for_metrics time | {cell(res, 'gather/nbaccel', 'gather_s', 1e3)} ms | "
        f"{cell(res, 'gather/raw', 'gather_s', 1e3)} ms raw all_gather | {_r(g)} | ≤ 1.10× | "
        f"{verdict(None if g is None else g <= 1.10)} |"
    )
    rows.append(
        f"| gather_for_metrics exact (8191 samples, no duplicates) | {'yes' if exact and all(exact) else 'no' if exact else '–'} | "
        f"raw: {'exact' if all(s.get('exact') for s in res['samples'].get('gather/raw', [{}])) else 'duplicates'} | | exact | "
        f"{verdict(None if not exact else all(exact))} |"
    )
    du = (
        None
        if med(res, "memory/nbaccel", "max_uss_mb") is None
        else med(res, "memory/nbaccel", "max_uss_mb") - (med(res, "memory/raw", "max_uss_mb") or 0)
    )
    rows.append(
        f"| Worker USS above raw fork (1 GiB array in kernel) | {cell(res, 'memory/nbaccel', 'max_uss_mb', 1, '{:.1f}')} MB | "
        f"{cell(res, 'memory/raw', 'max_uss_mb', 1, '{:.1f}')} MB | {_r(du, '{:+.1f} MB')} | ≤ +15 MB | "
        f"{verdict(None if du is None else du <= 15)} |"
    )
    uss = med(res, "memory/nbaccel", "max_uss_mb")
    rows.append(
        f"| 1 GiB array never copied (worker USS < 512 MB) | {_r(uss, '{:.1f} MB')} | | | not copied | "
        f"{verdict(None if uss is None else uss < 512)} |"
    )
    c = ratio(med(res, "checkpoint/nbaccel", "save_s"), med(res, "checkpoint/raw", "save_s"))
    rows.append(
        f"| save_state, 100M params + AdamW | {cell(res, 'checkpoint/nbaccel', 'save_s', 1, '{:.2f}')} s | "
        f"{cell(res, 'checkpoint/raw', 'save_s', 1, '{:.2f}')} s raw torch.save | {_r(c)} | ≤ 1.2× | "
        f"{verdict(None if c is None else c <= 1.2)} |"
    )
    return rows


def pool_rows(res: dict) -> list[str]:
    """Issue 14: warm workers (start_workers) against warm notebook_launcher calls."""
    if not any(k.startswith("pool") for k in res["samples"]):
        return []
    call = ratio(med(res, "poolcall/pool"), med(res, "poolcall/launcher"))
    train = ratio(med(res, "pooltrain/pool"), med(res, "pooltrain/launcher"))
    growth = med(res, "poolmem/pool", "max_growth_mb")
    return [
        "",
        "## Warm workers (issue 14: start_workers, 2 processes; ratios within this run)",
        "",
        "| | pool | notebook_launcher (warm) | ratio | target | result |",
        "|---|---|---|---|---|---|",
        f"| call: Accelerator + all-reduce + barrier (ms) | {cell(res, 'poolcall/pool', scale=1e3, fmt='{:.1f}')} | "
        f"{cell(res, 'poolcall/launcher', scale=1e3)} | {_r(call, '{:.3f}×')} | ≤ 0.2× | "
        f"{verdict(None if call is None else call <= 0.2)} |",
        f"| small training function run 3 times (s) | {cell(res, 'pooltrain/pool', fmt='{:.2f}')} | "
        f"{cell(res, 'pooltrain/launcher', fmt='{:.2f}')} | {_r(train)} | (reported) | |",
        f"| worker USS growth over 50 calls, max over ranks (MB) | {cell(res, 'poolmem/pool', 'max_growth_mb', fmt='{:+.2f}')} | "
        f"| | ≤ 5 MB | {verdict(None if growth is None else growth <= 5)} |",
    ]


def by_system(
    res: dict, systems: list[str], rows_spec: list[tuple[str, str, str | None, float, str]]
) -> list[str]:
    head = "| | " + " | ".join(NAMES.get(s, s) for s in systems) + " |"
    rows = [head, "|---" * (len(systems) + 1) + "|"]
    for label, prefix, key, scale, fmt in rows_spec:
        rows.append(
            f"| {label} | "
            + " | ".join(cell(res, f"{prefix}/{s}", key, scale, fmt) for s in systems)
            + " |"
        )
    return rows


def fsdp_table(res: dict) -> list[str]:
    """FSDP2 vs DDP through nbaccel: medians (min–max) and FSDP/DDP ratios of one run."""
    if not any(k.startswith("fsdp/") for k in res["samples"]):
        return []
    lines = [
        "",
        "## FSDP2 vs DDP (nbaccel, MLP 8×1024² + head = 8.4M params, AdamW, batch 32/process, "
        f"2 CPU processes; {res.get('config', {}).get('fsdp')} interleaved runs each)",
        "",
        "+mmap: the worker fixes glibc's mmap threshold at 128 KiB first (bench/scenarios/fsdp.py).",
        "",
        "| | DDP | FSDP2 | FSDP2 / DDP | DDP +mmap | FSDP2 +mmap | FSDP2 / DDP +mmap |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, key, scale, fmt in (
        ("median step, slower rank (ms)", "median_step_s", 1e3, "{:.1f}"),
        ("peak RSS above entry, max over ranks (MB)", "peak_rss_mb", 1, "{:.0f}"),
        ("parameters held per rank", "local_params", 1, "{:.0f}"),
    ):
        row = f"| {label} |"
        for suffix in ("", "+mmap"):
            ddp, fsdp = f"fsdp/ddp{suffix}", f"fsdp/fsdp{suffix}"
            r = ratio(med(res, fsdp, key), med(res, ddp, key))
            row += f" {cell(res, ddp, key, scale, fmt)} | {cell(res, fsdp, key, scale, fmt)} | {_r(r)} |"
        lines.append(row)
    return lines


def zero2_table(res: dict) -> list[str]:
    """Issue 36: a ZeRO-2 step as FSDP2, as nbaccel's DeepSpeed strategy, as DeepSpeed by hand."""
    if not any(k.startswith("zero2/") for k in res["samples"]):
        return []
    lines = [
        "",
        "## A ZeRO-2 step: FSDP2, nbaccel + DeepSpeed, DeepSpeed by hand (MLP 8×1024² + head = "
        f"8.4M params, AdamW, batch 32/process, 2 processes; {res.get('config', {}).get('zero2')} "
        "interleaved runs each, after one unrecorded round)",
        "",
        "| | FSDP2 (no reshard) | nbaccel DeepSpeed | DeepSpeed by hand "
        "| FSDP2 / by hand | nbaccel / by hand |",
        "|---|---|---|---|---|---|",
    ]
    for label, key, scale, fmt in (
        ("median step, slower rank (ms)", "median_step_s", 1e3, "{:.1f}"),
        ("peak RSS above entry, max over ranks (MB)", "peak_rss_mb", 1, "{:.0f}"),
        ("final loss, rank 0 (the same training: must agree)", "final_loss", 1, "{:.4f}"),
    ):
        names = [f"zero2/{v}" for v in ("fsdp2", "nbaccel", "deepspeed")]
        row = f"| {label} |" + "".join(f" {cell(res, n, key, scale, fmt)} |" for n in names)
        for name in names[:2]:
            row += f" {_r(ratio(med(res, name, key), med(res, names[2], key)))} |"
        lines.append(row)
    return lines


def monitor_table(res: dict) -> list[str]:
    """Issue 28: logging every step (and watching it live) against the same training without."""
    if not any(k.startswith("monitor/") for k in res["samples"]):
        return []
    base = res["samples"].get("monitor/off", [])
    lines = [
        "",
        "## Live monitor (issue 28: scenario 2's fp32 training through nbaccel, rank 0; "
        f"{res.get('config', {}).get('monitor')} interleaved runs each)",
        "",
        "Ratio: each variant's median step time over the same run's without logging; per round: "
        "the median (min–max) of the rounds' ratios, each against the run without logging of "
        "the same round. Target: ≤ 1.01×.",
        "",
        "| | median step (ms) | CPU per step (ms) | log call, mean / median (µs) "
        "| kernel CPU per step (ms) "
        "| ratio of medians | per-round ratio | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, label in (
        ("off", "no Accelerator.log"),
        ("log", "Accelerator.log every step"),
        ("log+watch", "log every step + watch(handle, system=True)"),
    ):
        name = f"monitor/{kind}"
        r = ratio(med(res, name, "median_step_s"), med(res, "monitor/off", "median_step_s"))
        pairs = [
            a["median_step_s"] / b["median_step_s"]
            for a, b in zip(res["samples"].get(name, []), base, strict=False)
            if isinstance(a, dict) and isinstance(b, dict) and b.get("median_step_s")
        ]
        per_round = (
            f"{statistics.median(pairs):.3f}× ({min(pairs):.3f}–{max(pairs):.3f})" if pairs else "–"
        )
        ok = None if kind == "off" or r is None else r <= 1.01
        lines.append(
            f"| {label} | {cell(res, name, 'median_step_s', 1e3, '{:.2f}')} | "
            f"{cell(res, name, 'cpu_per_step_s', 1e3, '{:.2f}')} | "
            f"{cell(res, name, 'log_us', 1, '{:.1f}')} / "
            f"{cell(res, name, 'log_median_us', 1, '{:.1f}')} | "
            f"{cell(res, name, 'kernel_cpu_per_step_s', 1e3, '{:.3f}')} | {_r(r, '{:.3f}×')} | "
            f"{per_round if kind != 'off' else '–'} | {verdict(ok)} |"
        )
    step = med(res, "monitor/off", "median_step_s")
    call = med(res, "monitor/log", "log_median_us")
    kernel = {
        k: med(res, f"monitor/{k}", "kernel_cpu_per_step_s") for k in ("off", "log", "log+watch")
    }
    if step and call is not None and None not in kernel.values():
        lines += [
            "",
            "Load-independent view (wall-time ratios need a quiet machine): one `Accelerator.log` "
            f"call (median) is {call * 1e-6 / step:.2%} of the median step; the kernel's CPU per "
            f"step is {kernel['off'] * 1e3:.3f} ms without logging, {kernel['log'] * 1e3:.3f} ms "
            f"with it and {kernel['log+watch'] * 1e3:.3f} ms with the monitor watching "
            f"({(kernel['log+watch'] - kernel['off']) / step:.1%} of a step on one core).",
        ]
    render = (res["samples"].get("monitorrender/render") or [{}])[0]
    if isinstance(render, dict) and render.get("svg_ms") is not None:
        mpl = render.get("matplotlib_ms")
        lines += [
            "",
            f"One chart redraw (3 metrics × 2 ranks × 1000 points): SVG {render['svg_ms']:.1f} ms "
            f"({render.get('svg_bytes', 0) / 1024:.0f} KiB)"
            + (f", a matplotlib figure rendered to PNG {mpl:.0f} ms." if mpl else "."),
        ]
    return lines


def render_markdown(res: dict) -> str:
    m, systems = res.get("machine", {}), res.get("systems", list(SYSTEMS))
    cfg = res.get("config", {})
    lines = [
        "# nbaccel benchmark results",
        "",
        f"{m.get('date', '')} · {m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('ram_gib', '?')} GiB RAM, "
        f"{m.get('os', '')} · Python {m.get('python', '?')}, torch {m.get('torch', '?')}, nbaccel {m.get('nbaccel', '?')} "
        f"(commit {m.get('commit', '?')}), "
        f"accelerate {m.get('accelerate', '–')}, lightning {m.get('lightning', '–')} · 2 processes, backend {m.get('backend', 'gloo')} · "
        f"load average before/after {m.get('load_before')} / {m.get('load_after')} · whole run {res.get('wall_s')} s",
        "",
    ]
    if m.get("note"):
        lines += [f"Note: {m['note']}", ""]
    lines += [
        "Median (min–max) over interleaved samples; ratios are medians against the hand-written "
        "baseline of the same run. Method: bench/README.md.",
        "",
        "## Targets",
        "",
    ]
    lines += targets(res)
    lines += [
        "",
        f"## Launch latency (2 processes, all-reduce + barrier; cold: {cfg.get('cold')} fresh kernels each, warm: median of {cfg.get('warm')})",
        "",
    ]
    lines += by_system(
        res,
        systems,
        [
            ("import cell, fresh kernel (s)", "cold", "import_s", 1, "{:.2f}"),
            ("cold: first launch in the kernel (s)", "cold", "launch_s", 1, "{:.2f}"),
            ("cold: first launch of a training function (s)", "coldtrain", "launch_s", 1, "{:.2f}"),
            ("warm launch (ms)", "warm", None, 1e3, "{:.0f}"),
        ],
    )
    lines += [
        "",
        f"## Training throughput (MLP 256-512-512-10, 8192×256, batch 64/process, 2 epochs, 1 thread/process; {cfg.get('train')} runs each)",
        "",
    ]
    spec = []
    for variant in ("fp32", "bf16", "accum4"):
        spec += [
            (f"{variant}: median step (ms)", f"train-{variant}", "median_step_s", 1e3, "{:.2f}"),
            (f"{variant}: steps/s", f"train-{variant}", "steps_per_s", 1, "{:.0f}"),
            (
                f"{variant}: CPU time per step, rank 0 (ms)",
                f"train-{variant}",
                "cpu_per_step_s",
                1e3,
                "{:.2f}",
            ),
        ]
    spec.append(
        (
            "compute threads at entry, before any set_num_threads",
            "train-fp32",
            "default_threads",
            1,
            "{:.0f}",
        )
    )
    lines += by_system(res, systems, spec)
    lines += ["", "## Distributed evaluation over 8191 samples (batch 64/process)", ""]
    lines += by_system(
        res,
        systems,
        [
            ("time in the gather calls (ms)", "gather", "gather_s", 1e3, "{:.0f}"),
            ("whole eval loop (ms)", "gather", "loop_s", 1e3, "{:.0f}"),
            ("samples returned", "gather", "count", 1, "{:.0f}"),
            ("distinct samples", "gather", "unique", 1, "{:.0f}"),
        ],
    )
    lines += ["", "## Worker memory with a 1 GiB array in the kernel (max over the 2 workers)", ""]
    lines += by_system(
        res,
        systems,
        [
            ("USS (MB)", "memory", "max_uss_mb", 1, "{:.1f}"),
            ("PSS (MB)", "memory", "max_pss_mb", 1, "{:.0f}"),
        ],
    )
    spawn = ["nbaccel-spawn", "nbaccel-fork", "raw-spawn", "fabric-spawn"]
    spawn = [
        s
        for s in spawn
        if s in {k.split("/", 1)[1] for k in res["samples"] if k.startswith("spawn/")}
        or any(e.startswith(f"spawn {s}") for e in res["errors"])
    ]
    if spawn:
        lines += ["", "## Spawn mode (notebook-defined function and model class)", ""]
        lines += by_system(
            res,
            spawn,
            [
                ("launch, all-reduce + barrier (s)", "spawn", "launch_s", 1, "{:.2f}"),
                (
                    "launch call → first optimizer step done (s)",
                    "spawn",
                    "first_step_s",
                    1,
                    "{:.2f}",
                ),
            ],
        )
        fab = [
            s.get("error") for s in res["samples"].get("spawn/fabric-spawn", []) if s.get("error")
        ]
        if fab:
            lines += ["", f"Fabric ddp_spawn from a notebook: {fab[0]}"]
        lines += [
            "",
            "raw spawn needs an importable function (torch.multiprocessing pickles by reference); "
            "nbaccel ships the notebook function and class with dill.",
        ]
    ck = ["raw", "raw+fsync"] + [s for s in systems if s != "raw"]
    if any(k.startswith("checkpoint/") for k in res["samples"]):
        lines += [
            "",
            "## Checkpointing a 100M-parameter model with AdamW state (rank 0 wall time between barriers)",
            "",
        ]
        lines += by_system(
            res,
            ck,
            [
                ("save (s)", "checkpoint", "save_s", 1, "{:.2f}"),
                ("load (s)", "checkpoint", "load_s", 1, "{:.2f}"),
                ("bytes written (GB)", "checkpoint", "bytes", 1e-9, "{:.3f}"),
            ],
        )
    lines += pool_rows(res)
    lines += fsdp_table(res)
    lines += zero2_table(res)
    lines += monitor_table(res)
    if res.get("errors"):
        lines += ["", "## Failed measurements", ""] + [f"- {e}" for e in res["errors"]]
    return "\n".join(lines) + "\n"
