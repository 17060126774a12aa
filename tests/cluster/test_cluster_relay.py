"""A kernel the cluster's nodes cannot reach: the ranks' streams travel through Ray.

The module's own two-node loopback cluster (conftest's :class:`LocalCluster`) whose nodes
refuse every connection to 127.0.0.9: a ``sitecustomize`` first on their ``PYTHONPATH``
makes ``socket.connect`` raise ``ConnectionRefusedError`` for that address, as a NAT or a
firewall in front of a notebook does (Colab, Kaggle, a laptop). Two real kernels listen
for their ranks there (``NBACCEL_CLUSTER_HOST=127.0.0.9``): one connected with ``ray.init``
as a user would, one that passes ``cluster="ray://127.0.0.2:<client port>"`` (Ray Client).
Each launch must return rank 0's value, show each rank's output once, raise the first
error naming rank and node, serve ``nbaccel.debug()``, say once that it relays, and leave
nothing behind (no actor, placement group, worker, kernel child or relay thread).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import HANG_GUARD_S, HEAD_IP, RAY_ENV, LocalCluster, nbaccel_workers, wait_until
from kernel_harness import KernelSession, isolated_env
from test_cluster_kernel import IMPORTS

pytestmark = [pytest.mark.cluster, pytest.mark.kernel, pytest.mark.integration]

#: the kernel's address, which the nodes' Python refuses to connect to
UNREACHABLE = "127.0.0.9"
SITECUSTOMIZE = '''\
"""This node cannot reach the test's kernel: connections to UNREACHABLE_HOSTS are refused."""
import errno, os, socket

_HOSTS = set(filter(None, os.environ.get("UNREACHABLE_HOSTS", "").split(",")))
_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex


def _refused(address):
    return isinstance(address, tuple) and bool(address) and address[0] in _HOSTS


def connect(self, address):
    if _refused(address):
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused (by the test)")
    return _connect(self, address)


def connect_ex(self, address):
    return errno.ECONNREFUSED if _refused(address) else _connect_ex(self, address)


if _HOSTS:
    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex

# The first server the head's Ray Client proxy forks for a connection dies as it starts, as
# Ray's own do in about 7% of starts (ray-project/ray#63202; CI's run of 8a2759b met it).
_MARK = os.environ.get("CLIENT_SERVER_DIES_ONCE")
if _MARK:
    with open("/proc/self/cmdline", "rb") as _file:
        _cmd = _file.read().split(b"\\0")
    if b"--mode=specific-server" in _cmd:
        try:
            os.close(os.open(_MARK, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            os._exit(134)
'''
SAID = "could not reach this kernel at 127.0.0.9"

# the cluster module's functions (train, node_ids, ...), then this module's own
SETUP = (
    IMPORTS
    + """
import threading
import nbaccel

def check(batch):
    x = batch * 41 // batch
    raise ValueError(f'bad batch {batch}')

def fails_on_one():
    import torch.distributed as dist
    accelerator = Accelerator()
    if accelerator.process_index == 1:
        check(11)
    dist.barrier()

def relay_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("nbaccel-relay")]
"""
)
#: how each kernel reaches the cluster: ray.init first, or Ray Client through nbaccel's
#: own connect (what cluster="ray://..." calls; called here in the module's set-up because
#: the client's first connection starts a server process of the head's, which the per-test
#: check for processes left would otherwise count against the first test)
CONNECT = {
    "ray.init": "import ray\nray.init(address={address!r}, _node_ip_address={ip!r})\n"
    "CLUSTER = 'ray'",
    "ray://": "from nbaccel.launch.start.cluster import _cluster_place\n"
    "CLUSTER = 'ray://{ip}:{client}'\n"
    "assert _cluster_place.connect(CLUSTER).util.client.ray.is_connected()",
}


def _workers(cluster: LocalCluster) -> list[psutil.Process]:
    """nbaccel workers started on ``cluster``."""
    return nbaccel_workers(cluster.root)


@pytest.fixture(scope="module")
def _started(tmp_path_factory) -> Iterator[dict[str, tuple[KernelSession, str]]]:
    """The module's two kernels, importing (started beside the cluster)."""
    kernels = {}
    try:
        for way in CONNECT:
            workdir = tmp_path_factory.mktemp("kernel")
            env = {**isolated_env(workdir), **RAY_ENV, "NBACCEL_CLUSTER_HOST": UNREACHABLE}
            session = KernelSession(cwd=workdir, env=env)
            session.start()
            kernels[way] = (session, session.submit(SETUP))
        yield kernels
    finally:
        for session, _ in kernels.values():
            session.stop()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The nodes' ``sitecustomize`` (:data:`SITECUSTOMIZE`), and the mark it leaves there
    when it ended the first Ray Client server (``client-server-died``)."""
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return site


@pytest.fixture(scope="module")
def unreachable_cluster(site) -> Iterator[LocalCluster]:
    """A two-node loopback cluster whose nodes cannot connect to :data:`UNREACHABLE`, whose
    head's first Ray Client server dies as it starts."""
    pytest.importorskip("ray", reason="needs the ray extra: pip install 'nbaccel[ray]'")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        "PYTHONPATH": path,
        "UNREACHABLE_HOSTS": UNREACHABLE,
        "CLIENT_SERVER_DIES_ONCE": str(site / "client-server-died"),
    }
    with LocalCluster(node_env=env) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def kernels(_started, unreachable_cluster) -> dict[str, KernelSession]:
    out = {}
    for way, (session, setup) in _started.items():
        session.collect(setup, timeout=HANG_GUARD_S).raise_for_error()
        cell = session.execute(
            CONNECT[way].format(
                address=unreachable_cluster.address, ip=HEAD_IP, client=unreachable_cluster.client
            ),
            timeout=HANG_GUARD_S,
        )
        if cell.status != "ok" or cell.error is not None:
            # Ray's side of it is in the head's logs, which go with the cluster
            raise AssertionError(f"{way}: {cell.describe()}\n{unreachable_cluster.diagnosis()}")
        out[way] = session
    return out


@pytest.fixture(params=list(CONNECT))
def kernel(request, kernels, unreachable_cluster) -> Iterator[KernelSession]:
    """Each test once per way of reaching the cluster; nothing may be left after it."""
    session = kernels[request.param]
    yield session
    if session.busy or not session.is_alive():
        pytest.fail("the kernel was left busy or died")
    assert wait_until(lambda: not _workers(unreachable_cluster)), [
        p.cmdline() for p in _workers(unreachable_cluster)
    ]
    assert wait_until(unreachable_cluster.idle), "actors or groups left"
    assert wait_until(lambda: session.evaluate_json("relay_threads()") == [])
    session.assert_no_descendants(timeout=HANG_GUARD_S)


def test_a_ray_client_server_that_dies_as_it_starts_is_replaced(kernels, site):
    # the module's set-up connected its ray:// kernel though the head's first server for it
    # died as it started (the sitecustomize's mark): nbaccel's connect tried once more
    assert (site / "client-server-died").exists()
    assert kernels["ray://"].evaluate("ray.util.client.ray.is_connected()") == "True"


def test_a_launch_the_nodes_cannot_connect_back_for_goes_through_ray(kernel):
    cell = kernel.run(
        "local = notebook_launcher(train, (3,), num_processes=2, return_all_ranks=True)\n"
        "value = notebook_launcher(train, (3,), num_processes=1, num_nodes=2, cluster=CLUSTER)\n"
        "print('SAME', torch.equal(value, local[0]))",
        timeout=HANG_GUARD_S,
    )
    assert "SAME True" in cell.stdout, cell.describe()
    # each launch's lines once: rank 1 ran on node 0 in the local run and on node 1 on the
    # cluster; rank 0 on node 0 in both
    counts = {line: cell.stdout.count(f"] {line}\n") for line in (
        "line-of-rank-0-node-0", "line-of-rank-1-node-0", "line-of-rank-1-node-1")}  # fmt: skip
    assert counts == {
        "line-of-rank-0-node-0": 2, "line-of-rank-1-node-0": 1, "line-of-rank-1-node-1": 1
    }, cell.stdout  # fmt: skip
    assert cell.stderr.count(SAID) == 1, cell.stderr  # said once, not once per rank
    # the first error, naming its rank and node; the relay is not said again
    cell = kernel.execute(
        "notebook_launcher(train, (1, 1), num_processes=1, num_nodes=2, cluster=CLUSTER)",
        timeout=HANG_GUARD_S,
    )
    assert cell.error is not None and cell.error.ename == "ValueError", cell.describe()
    text = cell.error.evalue + "\n".join(cell.error.traceback)
    assert "bad batch on rank 1" in text, text
    assert re.search(r"rank 1 \(pid \d+ on node 127\.0\.0\.3 \(\w+\)\)", text), text
    assert "in train" in text  # the user's frame
    assert SAID not in cell.stderr, cell.stderr


def test_pdb_on_a_failed_rank_the_kernel_cannot_be_reached_from(kernel):
    kernel.run(
        "try:\n"
        "    notebook_launcher(fails_on_one, num_processes=1, num_nodes=2, cluster=CLUSTER,"
        " debug=True, debug_timeout=120)\n"
        "except ValueError as err:\n"
        "    print('launch failed on rank', err.rank)\n",
        timeout=HANG_GUARD_S,
    )
    cell, prompts = kernel.execute_answering("nbaccel.debug()", ["p x", "q"], timeout=HANG_GUARD_S)
    cell.raise_for_error()
    assert prompts == ["(Pdb) "] * 2 and "41" in cell.stdout.splitlines(), cell.stdout
    assert "node 127.0.0.3" in cell.stdout, cell.stdout  # the header names where it runs


def test_a_warm_pool_and_a_hang_report_over_the_relay(kernel, tmp_path):
    # a pool's ranks across cells; then a launch whose rank 1 holds back its all_reduce:
    # the hang report brings each rank's stack (a channel message) into the cell
    cell = kernel.run(
        "from nbaccel import start_workers\n"
        "pool = start_workers(num_processes=1, num_nodes=2, cluster=CLUSTER)\n"
        "a = pool.call(train, (2,), return_all_ranks=True)\n"
        "b = pool.call(train, (2,), return_all_ranks=True)\n"
        "pool.close()\n"
        "print('POOL', len(b), all(torch.equal(x, y) for x, y in zip(a, b)))",
        timeout=HANG_GUARD_S,
    )
    assert "POOL 2 True" in cell.stdout, cell.describe()
    flag = tmp_path / "go"  # one machine's filesystem: both "nodes" see it
    msg = kernel.submit(
        f"print('result', notebook_launcher(waits, ({str(flag)!r},), num_processes=1,"
        " num_nodes=2, cluster=CLUSTER, hang_after=2))"
    )
    kernel.wait_for_output(msg, "waiting in torch.distributed.all_reduce", timeout=HANG_GUARD_S)
    flag.touch()  # rank 1 comes: nothing was killed, the launch completes
    cell = kernel.collect(msg, timeout=HANG_GUARD_S).raise_for_error()
    assert "result 2.0" in cell.stdout
    assert "os.path.exists(flag)" in cell.stderr, cell.stderr  # rank 1's stack, from its node
