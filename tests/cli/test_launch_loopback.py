"""``nbaccel launch`` on one machine: a free port and a store on loopback, as in notebooks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nbaccel.launch.testing import find_free_port

pytestmark = pytest.mark.integration

SCRIPT = """
import json, os, psutil
import torch, torch.distributed as dist
from nbaccel import Accelerator

accelerator = Accelerator(cpu=True)
port = int(os.environ["MASTER_PORT"])
listening = sorted({
    c.laddr.ip for c in psutil.net_connections(kind="tcp")
    if c.status == psutil.CONN_LISTEN and c.laddr.port == port
})
total = torch.tensor([1.0])
dist.all_reduce(total)
print("RESULT " + json.dumps({"rank": accelerator.process_index, "port": port,
      "addr": os.environ["MASTER_ADDR"], "listening": listening, "total": total.item(),
      "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}), flush=True)
"""


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBACCEL_")}
    env.update(
        NBACCEL_CONFIG_FILE=str(tmp_path / "config.yaml"),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        PYTHONUNBUFFERED="1",
    )
    return env


def _launch(tmp_path: Path, *extra: str) -> subprocess.Popen:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    return subprocess.Popen(
        [sys.executable, "-m", "nbaccel", "launch", "--num_processes", "2", "--cpu", *extra,
         str(script)],
        env=_env(tmp_path), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _results(proc: subprocess.Popen) -> list[dict]:
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    # two ranks share the pipe: a line may hold both results
    rows = [json.loads(found) for found in re.findall(r"RESULT (\{[^}]*\})", out)]
    return sorted(rows, key=lambda r: r["rank"])


def test_two_launches_on_one_machine_use_their_own_loopback_store(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    procs = [_launch(first), _launch(second)]  # at the same time: no fixed port to share
    runs = [_results(proc) for proc in procs]
    ports = set()
    for rows in runs:
        assert [r["rank"] for r in rows] == [0, 1]
        for row in rows:
            assert row["total"] == 2.0
            assert row["addr"] == "127.0.0.1"
            # the store listens on loopback only, not on 0.0.0.0 / ::
            assert row["listening"] and set(row["listening"]) <= {"127.0.0.1"}, row
            assert row["gloo_ifname"], "gloo was not kept on the loopback interface"
        ports.add(rows[0]["port"])
    assert len(ports) == 2 and 29500 not in ports


def test_a_busy_port_is_named(tmp_path):
    import socket

    port = find_free_port()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port))
        blocker.listen()
        proc = _launch(tmp_path, "--main_process_port", str(port))
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    assert f"use_port={port} is already in use" in err
