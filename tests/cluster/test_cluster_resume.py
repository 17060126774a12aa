"""A lost node does not end a cluster launch with ``max_restarts``: the group is re-placed on a
node that joins and the function resumes from its latest complete checkpoint on S3 (issue 52).

A real kernel connected to this module's own two-node loopback cluster (conftest), a real S3
server on loopback (moto's server mode, in this process) with s3fs as the ranks' client. The
training function checkpoints every few steps under ``project_dir="s3://..."`` and calls
``accelerator.load_state()`` at its start (nothing there on the first run). Node b is
SIGKILLed while its rank waits for the test (after the second checkpoint, two steps past it:
those steps are lost and done again); the restart waits for the cluster to hold two nodes
again, a third node joins on 127.0.0.4, the run resumes and its final weights are compared,
bit for bit, with the same run done uninterrupted by two local processes.

The ranks get the store's address and (dummy) credentials as an argument they put in their
environment: the nodes were started before the server, and a real node would have its own
``~/.aws``. Every wait is for an event (a line in the cell, a node alive); the timeouts are
hang guards.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HEAD_IP, NODE_C_IP, RAY_ENV, LocalCluster, wait_until
from kernel_harness import KernelSession, isolated_env

pytestmark = [pytest.mark.cluster, pytest.mark.kernel, pytest.mark.integration]

moto_server = pytest.importorskip("moto.server")
pytest.importorskip("s3fs")  # the `storage` extra

BUCKET = "nbaccel-resume"
HANG_GUARD_S = 900  # as the cluster fixture's: a wait this long is stuck, not slow

TRAIN = """
import os, time, json
import ray, torch
from torch import nn
from nbaccel import notebook_launcher

def resumable(base, store_env, flag=None, steps=14, every=4, pause_at=10):
    os.environ.update(store_env)
    from torch.utils.data import DataLoader, TensorDataset
    from nbaccel import Accelerator, ProjectConfiguration
    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir=base, automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    try:
        resumed = accelerator.load_state()  # the latest complete checkpoint under project_dir
    except FileNotFoundError:
        resumed = None
    done = accelerator.step
    while done < steps:
        skip = done % len(loader)  # mid-epoch: the loader restarts its epoch, skip what was seen
        for xb, yb in accelerator.skip_first_batches(loader, skip) if skip else loader:
            accelerator.backward(nn.functional.mse_loss(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done % every == 0:
                accelerator.save_state()
            if flag and resumed is None and done == pause_at:  # the test kills a node now
                print("paused-for-the-test", flush=True)
                while not os.path.exists(flag):
                    time.sleep(0.05)
            if done == steps:
                break
    weights = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return weights, resumed, accelerator.step
"""
CONNECT = """
CONTEXT = ray.init(address={address!r}, _node_ip_address={ip!r}, log_to_driver=True)
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[tuple[dict[str, str], Any]]:
    """An S3 server on 127.0.0.1 with one bucket; yields the environment its clients need."""
    import socket

    import botocore.session

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    urllib.request.urlopen(
        urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST")
    ).close()
    nowhere = tmp_path_factory.mktemp("aws")
    env = {
        "AWS_ACCESS_KEY_ID": "dummy-key",
        "AWS_SECRET_ACCESS_KEY": "dummy-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_CONFIG_FILE": str(nowhere / "config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(nowhere / "credentials"),
    }
    # this process's own client, told the address: its environment stays as it was
    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    client.create_bucket(Bucket=BUCKET)
    try:
        yield env, client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def kernel(tmp_path_factory, ray_cluster: LocalCluster) -> Iterator[KernelSession]:
    workdir = tmp_path_factory.mktemp("kernel")
    session = KernelSession(cwd=workdir, env={**isolated_env(workdir), **RAY_ENV})
    session.start()
    try:
        session.run(TRAIN, timeout=300)
        session.run(CONNECT.format(address=ray_cluster.address, ip=HEAD_IP), timeout=300)
        yield session
    finally:
        session.stop()


def _keys(client, prefix: str) -> list[str]:
    found = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in found.get("Contents", []))


def test_a_lost_node_is_replaced_and_the_run_resumes_from_its_s3_checkpoint(
    kernel, ray_cluster, store, tmp_path
):
    env, client = store
    kernel.run(f"STORE_ENV = {json.dumps(env)}")
    # the same run, uninterrupted, by two local processes (gloo over loopback): the reference
    kernel.run(
        f"reference = notebook_launcher(resumable, ('s3://{BUCKET}/reference', STORE_ENV),"
        " num_processes=2)",
        timeout=HANG_GUARD_S,
    )
    flag = tmp_path / "never"  # never created: the paused ranks wait until their node is gone
    msg = kernel.submit(
        f"result = notebook_launcher(resumable, ('s3://{BUCKET}/resume', STORE_ENV,"
        f" {str(flag)!r}), num_processes=1, num_nodes=2, cluster='ray', max_restarts=1,"
        f" replace_timeout={HANG_GUARD_S * 2})\n"
        "print('SAME', all(torch.equal(a, b) for a, b in zip(reference[0], result[0])),"
        " result[1], result[2])"
    )
    kernel.wait_for_output(msg, r"paused-for-the-test", count=2, timeout=HANG_GUARD_S)
    assert ray_cluster.kill_node("b")
    # the restart cannot be placed on the head alone (two nodes of one rank each): it waits
    kernel.wait_for_output(msg, r"waiting up to .*replace_timeout", timeout=HANG_GUARD_S)
    try:
        ray_cluster.add_node("c", NODE_C_IP)
        cell = kernel.collect(msg, timeout=HANG_GUARD_S).raise_for_error()
        # nothing of the launch is left on the cluster (its actors and placement groups)
        assert wait_until(ray_cluster.idle), "actors or groups left on the cluster"
    finally:
        ray_cluster.end_node("c")  # the test's own node ends with it

    latest = f"s3://{BUCKET}/resume/checkpoints/checkpoint_1"  # step 8; steps 9, 10 redone
    same = f"SAME True {latest} 14"
    assert same in cell.stdout, cell.describe()
    said = cell.stderr
    print(said)  # the restart as the cell showed it (pytest -rP)
    assert "the Ray cluster lost node 127.0.0.3" in said and "restarting, attempt 1 of 1" in said
    assert "waiting up to" in said and "for the Ray cluster to hold 2 node(s)" in said, said
    # how long it took: said twice, from the failure to the new group and to the loaded state
    assert re.search(r"attempt 1 started, \d+\.\ds after the failure", said), said
    resumed = rf"attempt 1 resumed from {re.escape(latest)} \(step 8\), \d+\.\ds after the failure"
    assert re.search(resumed, said), said
    # the reference did not resume; both runs wrote their checkpoints to the store only
    assert kernel.evaluate_json("[reference[1], reference[2]]") == [None, 14]
    keys = _keys(client, "resume/checkpoints/")
    assert {k.split("/")[2] for k in keys} == {f"checkpoint_{i}" for i in range(3)}, keys
    workdir = Path(kernel.evaluate_json("os.getcwd()"))
    assert not any(p.name.endswith(":") for p in workdir.iterdir())  # no local folder "s3:"
    # nor any checkpoint file left on a disk: not where the kernel works, not under the
    # nodes' folders (where a rank without the kernel's directory works); each rank's
    # private staging is tests/checkpoint/test_object_storage.py's to check
    parts = {"nbaccel_checkpoint.json", "model.safetensors", "optimizer.bin", "rank_0.pt"}
    local = [p for d in (workdir, ray_cluster.root) for p in d.rglob("*") if p.name in parts]
    assert local == [], local
