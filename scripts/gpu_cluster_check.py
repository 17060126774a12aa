"""One node x one rank on a loopback Ray cluster whose node lends this machine's GPU.

scripts/gpu_check.sh's cluster step (issue 51): a one-node Ray cluster on loopback (the
test suite's ``LocalCluster``, head only, ``--num-gpus=1``), driven from this process; one
``notebook_launcher(..., num_nodes=1, num_processes=1, cluster="ray")`` with
``compute_device`` left "auto". The rank says the plan it received (its node's device,
decided from that node's own facts) and where it trained; the check passes when the plan
is the GPU and the rank trained on cuda. ``--smoke`` (a CPU machine): the same plumbing
with ``--num-gpus=0``, the plan and training on the CPU, the GPU part skipped, said why.
Ray missing: skipped, said why (exit 0). The result goes to ``--out``/cluster_check.json.

Example:
    python scripts/gpu_cluster_check.py --out bench/gpu           # a GPU machine
    python scripts/gpu_cluster_check.py --out /tmp/x --smoke      # plumbing, on the CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _rank() -> dict[str, Any]:
    """What the rank received and where it trained (runs on the cluster's node)."""
    import os

    import torch
    from torch import nn

    from nbaccel import Accelerator
    from nbaccel.config.precedence import installed_launch_config

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(32, 16, device=accelerator.device)
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
    return {
        "plan": installed_launch_config().compute_device,
        "trained_on": str(next(model.parameters()).device),
        "loss": float(loss.item()),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }


def check(smoke: bool) -> dict[str, Any]:
    """Start the one-node cluster, launch, end the cluster; the result (``status``: ok,
    failed or skipped, with ``why``)."""
    if importlib.util.find_spec("ray") is None:
        return {"status": "skipped", "why": "ray is not installed here (the device tool's "
                "64 MiB carry cannot hold its wheel; a GPU image with Ray runs this part)"}  # fmt: skip
    import ray
    import torch

    gpus = torch.cuda.device_count()
    if not gpus and not smoke:
        return {"status": "failed", "why": "no CUDA GPU here (--smoke checks the plumbing)"}
    sys.path.insert(0, str(ROOT / "tests" / "cluster"))
    from conftest import HEAD_IP, LocalCluster  # the suite's loopback cluster

    from nbaccel import notebook_launcher

    lent = 1 if gpus and not smoke else 0
    cluster = LocalCluster(head_args=(f"--num-gpus={lent}",))
    began = time.monotonic()
    try:
        cluster.start(node_b=False)
        ray.init(address=cluster.address, _node_ip_address=HEAD_IP, log_to_driver=False)
        got = notebook_launcher(_rank, num_processes=1, num_nodes=1, cluster="ray")
    finally:
        ray.shutdown()
        cluster.stop()
    want = ("gpu", "cuda") if lent else ("cpu", "cpu")
    ok = got["plan"] == want[0] and got["trained_on"].startswith(want[1])
    result = {"status": "ok" if ok else "failed", "rank": got, "gpus_lent": lent,
              "seconds": round(time.monotonic() - began, 1)}  # fmt: skip
    if not ok:
        result["why"] = f"expected the plan {want[0]!r} and training on {want[1]}, got {got}"
    elif not lent:
        result["why"] = (
            "plumbing only (--smoke" + ("" if gpus else ", no CUDA GPU here")
            + "): the plan and training on the CPU; the GPU part skipped"
        )  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    result = check(args.smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 1 if result["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
