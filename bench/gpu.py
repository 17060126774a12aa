"""GPU benchmark: nbaccel against hand-written torch on one GPU, from a real IPython kernel.

    python3 bench/gpu.py [--out bench/gpu] [--smoke]

Rows (issue 18): bf16 step time of nbaccel vs a hand-written loop with and without
a 1-rank DDP on a >= 100M-parameter model (target: nbaccel >= 0.98x the raw
throughput); launch latency with CUDA initialised in the worker (fork, and
nbaccel's spawn); bf16 vs fp32 speed-up; fp8 (torchao) vs bf16 speed-up where the
GPU has compute capability >= 8.9 and torchao is installed; a launch from a kernel that
touched CUDA after ``%load_ext nbaccel`` (its workers forked by the fork server) vs a clean
kernel's fork (issue 43, target <= 1.2x), and the server's own memory (USS).

Method as bench/README.md: the kernel-side code (bench/scenarios/gpu.py) runs as
notebook cells in a kernel that never touches CUDA itself; systems are interleaved
(A B C A B C ...); tables give the median with min–max; ratios are against the
baseline of the same run. ``--smoke`` runs a tiny model on the CPU (gloo) with one
sample each: it only proves the script works (tests/test_gpu_check_script.py).

Writes ``<out>/gpu_bench.json`` (every sample) and ``<out>/gpu_bench.md`` (the table).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(BENCH))

from kernel_harness import KernelSession, isolated_env  # noqa: E402
from report import _r, cell, machine_info, med, ratio, verdict  # noqa: E402

FULL = {  # 3 blocks x (LayerNorm + 2048->8192->2048) = 100.7M parameters
    "width": 2048,
    "blocks": 3,
    "tokens": 8192,
    "warmup": 5,
    "windows": 5,
    "steps": 10,
    "rounds": 3,
    "launch_rounds": 4,
    # fp8 vs bf16 where torchao's tables show a gain (issue 32): 4096->16384->4096 between a
    # 256-wide first and last layer (kept bf16 as in Accelerate), 16k tokens
    "fp8_edge": 256,  # the first and last Linear (kept bf16 under fp8)
    "fp8_width": 4096,
    "fp8_hidden": 16384,
    "fp8_tokens": 16384,
    "fp8_rounds": 2,
}
SMOKE = {
    "width": 64,
    "blocks": 1,
    "tokens": 64,
    "warmup": 1,
    "windows": 2,
    "steps": 2,
    "rounds": 1,
    "launch_rounds": 1,
    "fp8_edge": 16,
    "fp8_width": 64,
    "fp8_hidden": 128,
    "fp8_tokens": 64,
    "fp8_rounds": 1,
}
PARTS = ("step", "launch", "fp8", "spawn", "pool", "forkserver")

_PROBE = """
import json, torch
ok = torch.cuda.is_available()
cap = list(torch.cuda.get_device_capability(0)) if ok else None
print(json.dumps({"cuda": ok, "name": torch.cuda.get_device_name(0) if ok else None,
                  "capability": cap}))
"""


def probe_gpu(python: str) -> dict[str, Any]:
    """GPU facts from a subprocess (the driver and the kernel never initialise CUDA)."""
    out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"cuda": False, "error": out.stderr[-300:]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def fp8_unavailable(gpu: dict[str, Any], python: str) -> str | None:
    """Why the fp8 row cannot run here, or None."""
    if not gpu.get("cuda"):
        return "no CUDA GPU"
    if tuple(gpu["capability"]) < (8, 9):
        return f"{gpu['name']} has compute capability {gpu['capability']} < 8.9"
    found = subprocess.run(
        [python, "-c", "import torchao.float8"], capture_output=True, text=True, timeout=300
    )
    return None if found.returncode == 0 else "torchao is not installed"


class Kernel:
    """One hermetic kernel holding the scenario cell."""

    def __init__(self, python: str, cache: str, **extra_env: str | None) -> None:
        env = {**isolated_env(cache), "PYTHONDONTWRITEBYTECODE": None, **extra_env}
        self.session = KernelSession(python, cwd=str(ROOT), env=env, startup_timeout=120)

    def run(self, code: str, timeout: float = 600) -> None:
        result = self.session.execute(code, timeout)
        if result.status != "ok":
            raise RuntimeError(result.describe()[-2000:])

    def call(self, expr: str, timeout: float = 900) -> Any:
        result = self.session.execute(f"gpu_json({expr})", timeout)
        if result.status != "ok" or result.text is None:
            raise RuntimeError(result.describe()[-2000:])
        return json.loads(ast.literal_eval(result.text))


def _sample(kernel: Kernel, res: dict, key: str, expr: str) -> None:
    print(f"- {key}", flush=True)
    try:
        res["samples"].setdefault(key, []).append(kernel.call(expr))
    except Exception as err:  # a failed system is reported, the run goes on
        res["errors"].append(f"{key}: {str(err)[-600:]}")
        print(f"  ! {key}: {str(err)[-300:]}", flush=True)


# The notebook as people write it (issue 43): nbaccel loaded first, then CUDA touched.
_TOUCH_CUDA = """
import torch
torch.cuda.is_available()  # initialises the driver in the kernel
try:
    import transformers  # noqa: F401 - what GPU notebooks import before launching
except ImportError:
    pass
"""


def touched_kernel(python: str, cache: str, cfg: dict[str, Any]) -> Kernel:
    """A second kernel: ``%load_ext nbaccel`` (the fork server), then CUDA touched. On the
    CPU (--smoke) the driver is tests/platform/fake_cuda.py's stand-in, initialised."""
    server = "1" if cfg["smoke"] else None  # a GPU machine takes it on its own
    kernel = Kernel(python, cache, NBACCEL_FORK_SERVER=server)
    kernel.session.start()
    kernel.run(f"GPU_CFG = {cfg!r}")
    kernel.run((BENCH / "scenarios" / "gpu.py").read_text())
    kernel.run("%load_ext nbaccel")
    if cfg["smoke"]:
        sys.path.insert(0, str(ROOT / "tests" / "platform"))
        from fake_cuda import build_fake_driver

        driver = build_fake_driver(Path(cache))
        kernel.run(f"import ctypes\nctypes.CDLL({str(driver)!r}).cuInit(0)")
    else:
        kernel.run(_TOUCH_CUDA)
    return kernel


def measure_forkserver(kernel: Kernel, cfg: dict[str, Any], res: dict) -> None:
    """A launch from the touched kernel (its workers forked by the fork server) against the
    same launch from the clean benchmark kernel (forked from it), interleaved."""
    import psutil

    touched = touched_kernel(kernel.session.python, tempfile.mkdtemp(), cfg)
    try:
        pid = touched.session.evaluate_json(
            "__import__('nbaccel.launch.start._forkserver').launch.start._forkserver.server_pid()"
        )
        for who in (kernel, touched):
            _sample(who, res, "warmup", "gpu_launch_once('nbaccel')")
        res["samples"].pop("warmup", None)
        for _ in range(cfg["launch_rounds"]):
            _sample(kernel, res, "forkserver/clean-fork", "gpu_launch_once('nbaccel')")
            _sample(touched, res, "forkserver/server", "gpu_launch_once('nbaccel')")
        parent = touched.session.evaluate_json(
            "__import__('nbaccel').notebook_launcher(lambda: __import__('os').getppid(), "
            "num_processes=1, block=False).result(timeout=300)",  # a worker, not the kernel
            timeout=300,
        )
        info = psutil.Process(pid) if pid is not None else None
        res["forkserver"] = {
            "server_pid": pid,
            "workers_from_server": pid is not None and parent == pid,
            "server_uss": info.memory_full_info().uss if info else None,
        }
        if not res["forkserver"]["workers_from_server"]:
            res["errors"].append(
                f"forkserver: workers not forked by the server ({res['forkserver']})"
            )
    finally:
        touched.session.stop()


def measure(kernel: Kernel, cfg: dict[str, Any], res: dict) -> None:
    parts = cfg["parts"]
    if "step" in parts:
        variants = [("raw", "bf16"), ("raw-ddp", "bf16"), ("nbaccel", "bf16")]
        variants += [("raw", "no"), ("nbaccel", "no")]
        # one unrecorded sample per system first (allocator, cuBLAS heuristics, page cache)
        for system, precision in variants:
            _sample(kernel, res, "warmup", f"gpu_step_once({system!r}, {precision!r})")
        res["samples"].pop("warmup", None)
        for _ in range(cfg["rounds"]):
            for system, precision in variants:
                key = f"step-{precision}/{system}"
                _sample(kernel, res, key, f"gpu_step_once({system!r}, {precision!r})")
    if "fp8" in parts and cfg["fp8"] is None:  # each sample compiles in its warm-up steps
        for _ in range(cfg["fp8_rounds"]):
            for precision in ("bf16", "fp8"):
                _sample(kernel, res, f"fp8-shape/{precision}", f"gpu_fp8_once({precision!r})")
    if "launch" in parts:
        launchers = ("raw", "nbaccel")
        for system in launchers:
            _sample(kernel, res, "warmup", f"gpu_launch_once({system!r})")
        res["samples"].pop("warmup", None)
        for _ in range(cfg["launch_rounds"]):
            for system in launchers:
                _sample(kernel, res, f"launch/{system}", f"gpu_launch_once({system!r})")
    if "spawn" in parts:
        spawners = ("raw-spawn", "nbaccel-spawn")
        for system in spawners:
            _sample(kernel, res, "warmup", f"gpu_spawn_once({system!r})")
        res["samples"].pop("warmup", None)
        for _ in range(cfg["launch_rounds"]):
            for system in spawners:
                _sample(kernel, res, f"spawn/{system}", f"gpu_spawn_once({system!r})")
    if "forkserver" in parts:
        measure_forkserver(kernel, cfg, res)
    if "pool" in parts:  # one pool per sample: its call latency once warm
        for _ in range(cfg["fp8_rounds"]):
            for method in ("fork", "spawn"):
                _sample(kernel, res, f"pool/{method}", f"gpu_pool_call_s({method!r})")


def render(res: dict) -> str:
    m, cfg = res["machine"], res["config"]
    ms = 1e3

    parts = cfg.get("parts", PARTS)

    def judge(ok: bool | None, part: str = "step") -> str:  # a smoke run measures nothing
        if part not in parts:
            return f"not run (--only {','.join(parts)})"
        return "n/a (smoke)" if cfg["smoke"] else verdict(ok)

    step = "step_s"

    def st(name: str) -> str:
        return f"{cell(res, name, step, ms, '{:.2f}')} ms"

    thr = ratio(med(res, "step-bf16/raw-ddp", step), med(res, "step-bf16/nbaccel", step))
    thr_plain = ratio(med(res, "step-bf16/raw", step), med(res, "step-bf16/nbaccel", step))
    launch = ratio(med(res, "launch/nbaccel"), med(res, "launch/raw"))
    bf16_nb = ratio(med(res, "step-no/nbaccel", step), med(res, "step-bf16/nbaccel", step))
    bf16_raw = ratio(med(res, "step-no/raw", step), med(res, "step-bf16/raw", step))
    fp8 = ratio(med(res, "fp8-shape/bf16", step), med(res, "fp8-shape/fp8", step))
    spawn = ratio(med(res, "spawn/nbaccel-spawn"), med(res, "spawn/raw-spawn"))
    pool = ratio(med(res, "pool/spawn"), med(res, "pool/fork"))
    served = ratio(med(res, "forkserver/server"), med(res, "forkserver/clean-fork"))
    uss = (res.get("forkserver") or {}).get("server_uss")
    params = next((s["params"] for s in res["samples"].get("step-bf16/raw", [])), None)
    lines = [
        "# nbaccel GPU benchmark"
        + (" (smoke run on the CPU: not a measurement)" if cfg["smoke"] else ""),
        "",
        f"{m['date']} · {res['gpu'].get('name') or 'no GPU'} · {m['cpu']}, {m['cores']} cores · "
        f"Python {m['python']}, torch {m['torch']} (CUDA {m['torch_cuda']}), nbaccel "
        f"{m['nbaccel']} (commit {m['commit']}), torchao {m['torchao']} · whole run {res['wall_s']} s",
        "",
        f"Model: {cfg['blocks']} blocks of LayerNorm + Linear({cfg['width']}, {4 * cfg['width']}) "
        f"+ GELU + Linear({4 * cfg['width']}, {cfg['width']}) = {params or '?'} parameters; "
        f"batch {cfg['tokens']} × {cfg['width']}, MSE loss, AdamW; one process on "
        f"{'GPU 0' if not cfg['smoke'] else 'the CPU'}. A step-time sample is the median over "
        f"{cfg['windows']} windows of {cfg['steps']} steps after {cfg['warmup']} warm-up steps "
        "(synchronised at both ends of a window); tables give the median (min–max) over "
        f"{cfg['rounds']} interleaved launches per system. Method: bench/README.md, bench/gpu.py.",
        "",
        "## Targets and ratios",
        "",
        "| Row | nbaccel | baseline (same run) | measured | target | result |",
        "|---|---|---|---|---|---|",
        f"| bf16 throughput vs hand-written DDP (1 GPU) | {st('step-bf16/nbaccel')} | "
        f"{st('step-bf16/raw-ddp')} raw DDP | {_r(thr)} | ≥ 0.98× | "
        f"{judge(None if thr is None else thr >= 0.98)} |",
        f"| bf16 throughput vs hand-written loop, no DDP | {st('step-bf16/nbaccel')} | "
        f"{st('step-bf16/raw')} raw | {_r(thr_plain)} | ≥ 0.98× | "
        f"{judge(None if thr_plain is None else thr_plain >= 0.98)} |",
        f"| Launch latency with CUDA init (fork) | {cell(res, 'launch/nbaccel', None, ms)} ms | "
        f"{cell(res, 'launch/raw', None, ms)} ms raw fork | {_r(launch)} | ≤ 1.15× (issue 7) | "
        f"{judge(None if launch is None else launch <= 1.15, 'launch')} |",
        f"| bf16 speed-up over fp32, nbaccel | {st('step-bf16/nbaccel')} | "
        f"{st('step-no/nbaccel')} fp32 | {_r(bf16_nb)} | reported | – |",
        f"| bf16 speed-up over fp32, hand-written | {st('step-bf16/raw')} | "
        f"{st('step-no/raw')} fp32 | {_r(bf16_raw)} | reported | – |",
    ]
    shape = (
        f"{cfg['fp8_edge']}->{cfg['fp8_width']}->{cfg['fp8_hidden']}->{cfg['fp8_width']}->"
        f"{cfg['fp8_edge']}, {cfg['fp8_tokens']} tokens"
    )
    if cfg["fp8"] is None:
        lines.append(
            f"| fp8 (torchao) speed-up over bf16, compiled, {shape} | "
            f"{cell(res, 'fp8-shape/fp8', step, ms, '{:.2f}')} ms | "
            f"{cell(res, 'fp8-shape/bf16', step, ms, '{:.2f}')} ms bf16 | {_r(fp8)} | ≥ 1.2× "
            f"(issue 32) | {judge(None if fp8 is None else fp8 >= 1.2, 'fp8')} |"
        )
    else:
        lines.append(f"| fp8 (torchao) speed-up over bf16 | not run: {cfg['fp8']} | | | | – |")
    lines.append(
        f"| Spawn launch with CUDA init vs hand-written torch.multiprocessing spawn | "
        f"{cell(res, 'spawn/nbaccel-spawn', None, ms)} ms | "
        f"{cell(res, 'spawn/raw-spawn', None, ms)} ms raw spawn | {_r(spawn)} | ≤ 1.1× "
        f"(issue 32) | {judge(None if spawn is None else spawn <= 1.1, 'spawn')} |"
    )
    lines.append(
        f"| Warm pool call (CUDA tensor, synced), pool started with spawn vs fork | "
        f"{cell(res, 'pool/spawn', None, ms, '{:.2f}')} ms | "
        f"{cell(res, 'pool/fork', None, ms, '{:.2f}')} ms fork pool | {_r(pool)} | ≤ 1.1× "
        f"(issue 32) | {judge(None if pool is None else pool <= 1.1, 'pool')} |"
    )
    lines.append(
        "| Launch after the kernel touched CUDA (fork server) vs a clean kernel's fork | "
        f"{cell(res, 'forkserver/server', None, ms)} ms | "
        f"{cell(res, 'forkserver/clean-fork', None, ms)} ms clean fork | {_r(served)} | ≤ 1.2× "
        f"(issue 43) | {judge(None if served is None else served <= 1.2, 'forkserver')} |"
    )
    lines.append(
        "| Fork server's own memory (USS) | "
        f"{'–' if uss is None else f'{uss / (1 << 20):.0f} MiB'} | | | reported | – |"
    )
    lines += [
        "",
        "## Launch latency with CUDA init (one worker; call → CUDA tensor made, synced → back)",
        "",
        "| hand-written fork | nbaccel fork | hand-written spawn | nbaccel spawn |",
        "|---|---|---|---|",
        f"| {cell(res, 'launch/raw', None, ms)} ms | {cell(res, 'launch/nbaccel', None, ms)} ms | "
        f"{cell(res, 'spawn/raw-spawn', None, ms)} ms | "
        f"{cell(res, 'spawn/nbaccel-spawn', None, ms)} ms |",
        "",
        "fp32 runs with torch's defaults (no TF32). The fp8 row compiles both systems "
        "(Accelerator(dynamo_backend='inductor')): torchao's float8 is slower than bf16 eagerly; "
        f"each sample is one fresh worker, compiled during its warm-up steps. Parts run: "
        f"{', '.join(cfg['parts'])}.",
    ]
    if res["errors"]:
        lines += ["", "## Errors", ""] + [f"- {e[:500]}" for e in res["errors"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(BENCH / "gpu"), help="output folder")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (tests only)")
    parser.add_argument("--python", default=sys.executable, help="kernel interpreter")
    parser.add_argument(
        "--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS} (default all)"
    )
    args = parser.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--only={args.only!r}: choose among {PARTS}")
    gpu = probe_gpu(args.python)
    if not args.smoke and not gpu.get("cuda"):
        parser.error(f"no CUDA GPU visible ({gpu.get('error', 'torch sees none')}); use --smoke")
    cfg: dict[str, Any] = dict(SMOKE if args.smoke else FULL)
    cfg["device"] = "cpu" if args.smoke else "cuda"
    cfg["smoke"] = args.smoke
    cfg["parts"] = parts
    cfg["scenarios"] = str(BENCH / "scenarios")
    cfg["fp8"] = "smoke run on the CPU" if args.smoke else fp8_unavailable(gpu, args.python)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"samples": {}, "errors": [], "config": cfg, "gpu": gpu}
    t0 = time.time()
    cache = tempfile.mkdtemp(prefix="nbaccel-gpu-bench-")
    kernel = Kernel(args.python, cache)
    kernel.session.start()
    try:
        kernel.run(f"GPU_CFG = {cfg!r}")
        kernel.run((BENCH / "scenarios" / "gpu.py").read_text())
        versions = kernel.call("gpu_versions()")
        res["machine"] = machine_info(versions, args.python)
        if versions["kernel_cuda_driver_initialized"]:  # issue 32: every fork row would fail
            res["errors"].append("the benchmark kernel's CUDA driver was initialised at start")
        try:
            measure(kernel, cfg, res)
            after = kernel.call("gpu_versions()")
            if after["kernel_cuda_initialized"] or after["kernel_cuda_driver_initialized"]:
                res["errors"].append("the benchmark kernel initialised CUDA (fork rows invalid)")
        except KeyboardInterrupt:  # gpu_check.sh's time budget: keep what was measured
            res["errors"].append("interrupted (time budget): the table holds what ran")
    finally:
        kernel.session.stop()
    res["wall_s"] = round(time.time() - t0, 1)
    (out / "gpu_bench.json").write_text(json.dumps(res, indent=1))
    (out / "gpu_bench.md").write_text(render(res))
    print(f"wrote {out / 'gpu_bench.md'} and gpu_bench.json in {res['wall_s']} s", flush=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
