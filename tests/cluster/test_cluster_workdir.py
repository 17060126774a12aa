"""Where a rank on a cluster's node works: the kernel's directory if the node has it, else
where Ray started it, said once. The real two-node run (the node has it) is in
test_cluster_kernel.py; here the node that lacks it, with a real RankHost in a process of its
own (its ``describe`` as Ray calls it) and the kernel's warning. No cluster needed."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from nbaccel.launch.start.cluster import _cluster

pytestmark = [pytest.mark.cluster]


DESCRIBE = (
    "import asyncio, json, sys\n"
    "from nbaccel.launch.start.cluster._cluster_host import RankHost\n"
    "for d in sys.argv[1:]:\n"
    "    print(json.dumps(asyncio.run(RankHost().describe(reserve_store=False, workdir=d))))"
)


def test_a_node_without_the_kernels_directory_says_where_its_rank_works(tmp_path):
    # in a process of its own, started elsewhere, as an actor is (it imports Ray: this
    # pytest worker never does)
    gone, started = str(tmp_path / "not-on-this-node"), tmp_path / "ray-start-dir"
    started.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", DESCRIBE, gone, str(tmp_path)],
        cwd=started, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    info, here = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert info["in_kernel_dir"] is False and info["workdir"] == str(started)
    assert here["in_kernel_dir"] is True and here["workdir"] == str(tmp_path)


def test_the_kernel_says_it_once_per_node_naming_ranks_and_directories(monkeypatch):
    monkeypatch.setattr(_cluster, "_SAID_WORKDIRS", set())
    infos = [
        {"in_kernel_dir": True, "workdir": "/home/me/proj"},
        {"in_kernel_dir": False, "workdir": "/tmp/ray-start-dir"},
        {"in_kernel_dir": False, "workdir": "/tmp/ray-start-dir"},
    ]
    nodes = {0: "node 10.0.0.1 (aaaa)", 1: "node 10.0.0.2 (bbbb)", 2: "node 10.0.0.2 (bbbb)"}
    with pytest.warns(RuntimeWarning) as caught:
        _cluster._say_other_workdirs("/home/me/proj", infos, nodes)
    (text,) = [str(w.message) for w in caught]
    assert "/home/me/proj does not exist on every node" in text
    assert "rank(s) [1, 2] on node 10.0.0.2 (bbbb) run in /tmp/ray-start-dir" in text
    assert "node 10.0.0.1" not in text and "Fix:" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next launch from the same directory: silent
        _cluster._say_other_workdirs("/home/me/proj", infos, nodes)
