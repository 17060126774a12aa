"""Write the GPU check report (scripts/gpu_check.sh): device, driver, torch, every test, bench.

    python3 bench/gpu_report.py --env > bench/gpu/env.json     # facts of this machine
    python3 bench/gpu_report.py --dir bench/gpu                 # REPORT.md + report.json

``--dir`` reads what the check left there: ``env.json``, ``gpu_tests.xml`` (pytest's
JUnit XML: every test's outcome, time and message), ``gpu_tests.exit`` (pytest's exit
status), ``gpu_bench.md``/``gpu_bench.json`` (bench/gpu.py) and ``steps.txt`` (the
status of each step of the check). Parts that are missing are reported as not run,
so the report can also be rebuilt here from files fetched from the GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from report import project_commit  # noqa: E402

_TORCH = """
import json, torch
ok = torch.cuda.is_available()
print(json.dumps({
    "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version() if ok else None,
    "nccl": ".".join(map(str, torch.cuda.nccl.version())) if ok else None,
    "gpus": [{"name": torch.cuda.get_device_name(i),
              "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
              "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
             for i in range(torch.cuda.device_count())] if ok else [],
}))
"""


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def collect_env() -> dict[str, Any]:
    """Device, driver, torch and friends, without initialising CUDA in this process."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    smi = _run(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
            "--format=csv,noheader",
        ]
    )
    env["nvidia_smi"] = smi.splitlines() if smi else None
    torch_facts = _run([sys.executable, "-c", _TORCH])
    env.update(json.loads(torch_facts) if torch_facts else {"torch": None})
    env["commit"] = project_commit(str(ROOT))  # NBACCEL_COMMIT in a copy without .git
    for name in ("torchao", "ipykernel", "jupyter_client", "pytest"):
        with contextlib.suppress(Exception):  # read, not imported: no CUDA is touched
            env[name] = importlib.metadata.version(name)
    return env


def read_tests(xml_path: Path) -> list[dict[str, Any]]:
    """Every testcase of a JUnit XML file: id, outcome, seconds, message."""
    tests = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = (node.get("message") or node.text or "").strip()
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        tests.append(
            {
                "test": name,
                "outcome": outcome,
                "seconds": round(float(case.get("time") or 0), 1),
                "message": message,
            }
        )
    return tests


def _env_lines(env: dict[str, Any]) -> list[str]:
    if not env:
        return ["Machine facts: not collected (env.json missing)."]
    gpus = env.get("gpus") or []
    smi = env.get("nvidia_smi") or ["nvidia-smi not available"]
    described = [
        f"{g.get('name')} (sm {g.get('capability')}, {g.get('memory_gib')} GiB)" for g in gpus
    ]
    rows = [
        "| | |",
        "|---|---|",
        f"| GPUs (torch) | {'; '.join(described) or 'none'} |",
        f"| nvidia-smi (name, driver, memory, max SM clock) | {'; '.join(smi)} |",
        f"| torch | {env.get('torch')} (CUDA {env.get('torch_cuda')}, cuDNN {env.get('cudnn')}, NCCL {env.get('nccl')}) |",
        f"| Python | {env.get('python')} ({env.get('python_executable')}) |",
        f"| torchao / ipykernel / jupyter_client / pytest | {env.get('torchao')} / {env.get('ipykernel')} / {env.get('jupyter_client')} / {env.get('pytest')} |",
        f"| platform, CPUs | {env.get('platform')}, {env.get('cpu_count')} |",
        f"| nbaccel commit | {env.get('commit')} |",
    ]
    return rows


def render(folder: Path) -> tuple[str, dict[str, Any]]:
    env_path, xml_path = folder / "env.json", folder / "gpu_tests.xml"
    env = json.loads(env_path.read_text()) if env_path.exists() else {}
    tests = read_tests(xml_path) if xml_path.exists() else None
    exit_path = folder / "gpu_tests.exit"
    pytest_exit = exit_path.read_text().strip() if exit_path.exists() else None
    steps_path = folder / "steps.txt"
    steps = steps_path.read_text().strip().splitlines() if steps_path.exists() else []
    bench_md = folder / "gpu_bench.md"
    summary: dict[str, Any] = {"env": env, "tests": tests, "pytest_exit": pytest_exit}
    summary["steps"] = steps
    lines = ["# nbaccel GPU check (scripts/gpu_check.sh)", ""]
    lines += [*_env_lines(env), ""]
    if steps:
        lines += ["## Steps", ""] + [f"- {s}" for s in steps] + [""]
    lines += ["## Tests (pytest -m gpu tests/gpu)", ""]
    if tests is None:
        lines.append(f"Not run, or no JUnit XML was written (pytest exit: {pytest_exit}).")
    else:
        counts: dict[str, int] = {}
        for t in tests:
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        summary["counts"] = counts
        lines.append(
            ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
            + f" (pytest exit {pytest_exit})"
        )
        lines += ["", "| test | result | s | message |", "|---|---|---|---|"]
        for t in tests:
            msg = t["message"].replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| {t['test']} | {t['outcome']} | {t['seconds']} | {msg} |")
    lines += ["", "## Benchmark (bench/gpu.py)", ""]
    if bench_md.exists():
        body = bench_md.read_text().split("\n", 1)[1]  # drop its own title
        lines.append(body.replace("\n## ", "\n### ").strip())
    else:
        lines.append("Not run.")
    return "\n".join(lines) + "\n", summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="store_true", help="print this machine's facts as JSON")
    parser.add_argument("--dir", default=None, help="folder with the check's outputs")
    args = parser.parse_args(argv)
    if args.env:
        print(json.dumps(collect_env(), indent=1))
        return 0
    if not args.dir:
        parser.error("pass --env or --dir FOLDER")
    folder = Path(args.dir)
    text, summary = render(folder)
    (folder / "REPORT.md").write_text(text)
    (folder / "report.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {folder / 'REPORT.md'} and report.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
