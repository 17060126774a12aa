"""scripts/gpu_check.sh works end to end where it can here: --smoke on the CPU.

The GPU machine gets one run (scarce time, no network), so its plumbing is proved
here: the imports check, pytest over tests/gpu with a JUnit report (the tests skip
on the CPU, with their reason), bench/gpu.py --smoke, and the report with every
test's result and the benchmark table, copied to $OUT. That one run of bench/gpu.py --smoke
also proves the GPU benchmark's driver still writes every row (it was a second, separate run
of the same smoke: tests/test_bench_gpu_smoke.py, folded in here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.kernel
@pytest.mark.integration
@pytest.mark.timeout(400)
def test_gpu_check_smoke_writes_the_report(tmp_path: Path) -> None:
    results, out = tmp_path / "results", tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DIR": str(results), "OUT": str(out)}
    env["NBACCEL_COMMIT"] = "smoke-commit"
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke", "--no-install"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = (out / "REPORT.md").read_text()
    summary = json.loads((out / "report.json").read_text())
    names = {t["test"].rsplit("::", 1)[-1] for t in summary["tests"]}
    assert {
        "test_fork_refused_after_real_cuda_init_naming_the_line",
        "test_fp16_skips_overflowing_steps_and_checkpoints_the_scaler",
    } <= names, names
    assert all(
        t["outcome"] == "skipped" and "needs a CUDA GPU" in t["message"] for t in summary["tests"]
    ), summary["tests"]
    assert summary["env"]["torch"] and summary["pytest_exit"] == "0"
    assert "imports: ok" in report and "NBACCEL_REQUIRE_GPU=0" in report
    assert "| bf16 throughput vs hand-written DDP (1 GPU) |" in report
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "REPORT.md",
            "report.json",
            "env.json",
            "gpu_bench.json",
            "gpu_bench.md",
            "gpu_tests.log",
            "gpu_tests.xml",
        ]
    )
    _assert_every_bench_row(out)


def _assert_every_bench_row(out: Path) -> None:
    """bench/gpu.py --smoke (tiny model, CPU, gloo) wrote every row of the GPU benchmark.

    Not a measurement: it keeps bench/gpu.py working on machines without a GPU, so that
    the one run on a GPU machine does not fail on a typo.
    """
    result = json.loads((out / "gpu_bench.json").read_text())
    assert result["errors"] == [], result["errors"]
    for key in ("raw", "raw-ddp", "nbaccel"):
        (sample,) = result["samples"][f"step-bf16/{key}"]
        assert sample["step_s"] > 0 and len(sample["windows_s"]) == 2, sample
    assert len(result["samples"]["step-no/nbaccel"]) == 1
    for key in ("launch/raw", "launch/nbaccel", "spawn/raw-spawn", "spawn/nbaccel-spawn"):
        (seconds,) = result["samples"][key]
        assert seconds > 0
    for key in ("forkserver/clean-fork", "forkserver/server"):  # issue 43: stand-in driver
        (seconds,) = result["samples"][key]
        assert seconds > 0
    assert result["forkserver"]["workers_from_server"] is True, result["forkserver"]
    for key in ("pool/fork", "pool/spawn"):
        (seconds,) = result["samples"][key]
        assert seconds > 0
    assert result["machine"]["commit"] == "smoke-commit", result["machine"]  # NBACCEL_COMMIT
    table = (out / "gpu_bench.md").read_text()
    assert "smoke run on the CPU" in table and "n/a (smoke)" in table
    assert "| bf16 throughput vs hand-written DDP (1 GPU) |" in table
    assert "fp8 (torchao) speed-up over bf16 | not run: smoke run on the CPU" in table
    assert "| Spawn launch with CUDA init vs hand-written torch.multiprocessing spawn |" in table
    assert "| Warm pool call (CUDA tensor, synced), pool started with spawn vs fork |" in table
    assert (
        "| Launch after the kernel touched CUDA (fork server) vs a clean kernel's fork |" in table
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("variable", "fails"), [("NBACCEL_REQUIRE_GPU", True), ("NBACCEL_REQUIRE_ALL", False)]
)
def test_gpu_skips_fail_only_where_a_gpu_run_is_required(variable: str, fails: bool) -> None:
    # On the GPU machine (NBACCEL_REQUIRE_GPU=1) a skipped GPU test must fail the run; the
    # full CPU suite (NBACCEL_REQUIRE_ALL=1) must accept that GPU tests skip without a GPU.
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBACCEL_REQUIRE")}
    env[variable] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, also on a GPU machine: the test must skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["tests/gpu/test_gpu_launch.py::test_one_process_per_gpu"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    if fails:
        assert proc.returncode == 1, proc.stdout[-2000:]
        assert "NBACCEL_REQUIRE_GPU=1 and this gpu test was skipped" in proc.stdout
    else:
        assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.cluster
@pytest.mark.integration
def test_gpu_check_cluster_step_smoke_plans_and_trains_one_rank_on_its_nodes_device(
    tmp_path: Path,
) -> None:
    # the cluster step's plumbing on the CPU: a one-node loopback Ray cluster (no GPU lent),
    # one rank, compute_device "auto": its plan and its training on the CPU, the GPU part
    # skipped and said so; the cluster ends with the step (its own start and stop)
    pytest.importorskip("ray", reason="needs the ray extra: pip install 'nbaccel[ray]'")
    results, out = tmp_path / "results", tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DIR": str(results), "OUT": str(out)}
    env.pop("RAY_ADDRESS", None)
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cluster-only", "--smoke"]
    cmd += ["--no-install"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    result = json.loads((out / "cluster_check.json").read_text())
    assert result["status"] == "ok" and result["gpus_lent"] == 0, result
    assert result["rank"]["plan"] == "cpu" and result["rank"]["trained_on"] == "cpu", result
    assert "the GPU part skipped" in result["why"], result
    assert "cluster: ok: plumbing only (--smoke" in (out / "REPORT.md").read_text()
