"""notebook_launcher and the warm pool on a real local two-node Ray cluster, from a real kernel.

The session's cluster (conftest: two ``ray start`` nodes on 127.0.0.2 / 127.0.0.3) and one
kernel per module, connected to it with ``ray.init`` as a user would (Ray's own forwarding
of actor output left on: each line must still show once). Every test ends by checking that
nothing is left: no placement group that is not removed, no live actor (Ray's state API),
no nbaccel worker process on the machine, no child of the kernel.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import HEAD_IP, NODE_B_IP, RAY_ENV, LocalCluster, nbaccel_workers, wait_until
from kernel_harness import WAITS_FOR_FLAG, KernelSession, isolated_env

pytestmark = [pytest.mark.cluster, pytest.mark.kernel, pytest.mark.integration]

# A kernel's set-up in two cells: IMPORTS while the cluster starts (the module's kernels start
# beside `ray start`, which mostly waits), then CONNECT, as a user would, to the started cluster.
IMPORTS = (
    """
import os, sys, time
import ray, torch
from torch import nn
from nbaccel import Accelerator, notebook_launcher, start_workers

def train(steps, fail_rank=None):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = accelerator.process_index
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        accelerator.backward(loss)
        optimizer.step()
    print(f"line-of-rank-{rank}-node-{os.environ['GROUP_RANK']}")
    if rank == fail_rank:
        raise ValueError(f"bad batch on rank {rank}")
    return accelerator.unwrap_model(model).weight.detach().clone()

def logged(steps):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(accelerator.process_index)
    losses = []
    for step in range(steps):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
        losses.append(loss.item())
        time.sleep(0.05)
    return losses

def spin():
    print("spinning", flush=True)
    while True:
        time.sleep(0.05)

def node_ids():
    return {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}

def left_on_cluster():
    from ray.util import placement_group_table
    from ray.util.state import list_actors
    groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
    actors = list_actors(address=STATE, filters=[("state", "!=", "DEAD")])
    return {"groups": len(groups), "actors": len(actors)}
"""
    + WAITS_FOR_FLAG
)
CONNECT = """
CONTEXT = ray.init(address={address!r}, _node_ip_address={ip!r}, log_to_driver=True)
STATE = "http://" + CONTEXT.dashboard_url
"""


_CLUSTER_ROOT: list[str] = []  # the session cluster's temp dir, set by the kernel fixture


def _workers() -> list[psutil.Process]:
    """nbaccel workers started on this module's cluster."""
    return nbaccel_workers(_CLUSTER_ROOT[0])


def _importing_kernel(workdir: Path) -> tuple[KernelSession, str]:
    """A kernel started and sent IMPORTS (not waited for): (session, the cell's msg id)."""
    session = KernelSession(cwd=workdir, env={**isolated_env(workdir), **RAY_ENV})
    session.start()
    return session, session.submit(IMPORTS)


def _connected(kernel: tuple[KernelSession, str], cluster: LocalCluster) -> KernelSession:
    session, imports = kernel
    session.collect(imports, timeout=180).raise_for_error()
    session.run(CONNECT.format(address=cluster.address, ip=HEAD_IP), timeout=180)
    return session


@pytest.fixture(scope="module")
def _kernels(tmp_path_factory) -> Iterator[list[tuple[KernelSession, str]]]:
    """The module's two kernels (the shared one; the one a test kills), importing: requested
    before ``ray_cluster``, so they start beside it."""
    kernels = [_importing_kernel(tmp_path_factory.mktemp(name)) for name in ("kernel", "killed")]
    try:
        yield kernels
    finally:
        for session, _ in kernels:
            session.stop()


@pytest.fixture(scope="module")
def kernel(_kernels, ray_cluster) -> KernelSession:
    _CLUSTER_ROOT[:] = [str(ray_cluster.root)]
    return _connected(_kernels[0], ray_cluster)


def _nothing_left(kernel: KernelSession) -> None:
    def clean():
        left = kernel.evaluate_json("left_on_cluster()")
        return left == {"groups": 0, "actors": 0} and not _workers()

    assert wait_until(clean), (
        kernel.evaluate_json("left_on_cluster()"),
        [p.cmdline() for p in _workers()],
    )
    kernel.assert_no_descendants(timeout=5)


@pytest.fixture(autouse=True)
def _left_clean(kernel: KernelSession) -> Iterator[None]:
    yield
    if kernel.busy or not kernel.is_alive():
        pytest.fail("the kernel was left busy or died")
    _nothing_left(kernel)


def test_same_numbers_as_two_local_processes_with_every_rank_output_once(kernel):
    cell = kernel.run(
        "local = notebook_launcher(train, (3,), num_processes=2, return_all_ranks=True)\n"
        "remote = notebook_launcher(train, (3,), num_processes=1, num_nodes=2, cluster='ray',"
        " return_all_ranks=True)\n"
        "print('SAME', all(torch.equal(a, b) for a, b in zip(local, remote)), len(remote))",
        timeout=300,
    )
    assert "SAME True 2" in cell.stdout
    # each launch printed each rank's line once (Ray's own forwarding is on): rank 1 ran on
    # node 0 in the local run and on node 1 in the cluster launch; rank 0 on node 0 in both
    counts = {line: cell.stdout.count(f"] {line}\n") for line in (
        "line-of-rank-0-node-0", "line-of-rank-1-node-0", "line-of-rank-1-node-1")}  # fmt: skip
    assert counts == {
        "line-of-rank-0-node-0": 2, "line-of-rank-1-node-0": 1, "line-of-rank-1-node-1": 1
    }, cell.stdout  # fmt: skip


def test_the_first_real_exception_names_type_rank_and_user_frame(kernel):
    cell = kernel.execute(
        "notebook_launcher(train, (1, 1), num_processes=1, num_nodes=2, cluster='ray')",
        timeout=300,
    )
    assert cell.error is not None
    assert cell.error.ename == "ValueError", cell.error
    text = "\n".join(cell.error.traceback)
    assert "bad batch on rank 1" in text and "rank 1" in text
    assert "in train" in text  # the user's frame


def test_a_request_the_cluster_cannot_hold_is_refused_before_any_rank_starts(kernel):
    cell = kernel.execute(
        "notebook_launcher(train, (1,), num_processes=1, num_nodes=3, cluster='ray')",
        timeout=120,
    )
    assert cell.error is not None and cell.error.ename == "LaunchError", cell.error
    text = cell.error.evalue
    assert "needs 3 node(s)" in text and "2 of its 2" in text, text


def test_a_warm_pool_across_cells_then_closed(kernel):
    kernel.run(
        "pool = start_workers(num_processes=1, num_nodes=2, cluster='ray')\n"
        "a = pool.call(train, (2,), return_all_ranks=True)",
        timeout=300,
    )
    cell = kernel.run(
        "b = pool.call(train, (2,), return_all_ranks=True)\n"
        "first = pool.call(train, (2,))  # rank 0's value alone\n"
        "print('POOL', len(b), all(torch.equal(x, y) for x, y in zip(a, b)),"
        " torch.equal(first, a[0]), torch.equal(a[0], a[1]))",
        timeout=300,
    )
    assert "POOL 2 True True True" in cell.stdout  # DDP: the same weights on both ranks
    assert len(_workers()) == 2  # warm: the workers live between the cells
    # %%distributed cells on the cluster's pool: names kept per rank across cells, output
    # per rank, rank 0's last expression as the cell's result
    kernel.run("%load_ext nbaccel")
    cell = kernel.run(
        "%%distributed\n"
        "import os\n"
        "mine = accelerator.process_index * 10 + int(os.environ['GROUP_RANK'])\n"
        "print(f'cell-rank-{accelerator.process_index}')\n"
        "mine + 0.5",
        timeout=300,
    )
    assert cell.text == "0.5", cell.describe()
    assert "cell-rank-0" in cell.stdout and "cell-rank-1" in cell.stdout, cell.stdout
    assert kernel.evaluate_json("pool.pull('mine', rank=None)") == [0, 11]  # rank 1: node 1
    kernel.run("pool.close()", timeout=120)


def test_an_interrupt_ends_every_remote_rank(kernel):
    msg = kernel.submit("notebook_launcher(spin, num_processes=1, num_nodes=2, cluster='ray')")
    kernel.wait_for_output(msg, r"spinning", timeout=300)
    assert len(_workers()) == 2
    kernel.interrupt()
    cell = kernel.collect(msg, timeout=120)
    assert cell.error is not None and cell.error.ename == "KeyboardInterrupt", cell.error


def test_the_state_api_sees_the_launch_while_it_runs(kernel):
    """The "nothing left" checks can fail: while a run is in flight they see its group and
    actors (a check that could not see them would prove nothing)."""
    kernel.run(
        "handle = notebook_launcher(spin, num_processes=1, num_nodes=2, cluster='ray',"
        " block=False)",
        timeout=300,
    )
    seen = wait_until(lambda: kernel.evaluate_json("left_on_cluster()")["actors"] == 2)
    assert seen and kernel.evaluate_json("left_on_cluster()")["groups"] == 1
    assert wait_until(lambda: len(_workers()) == 2)
    kernel.run("handle.stop()\ntry:\n    handle.result()\nexcept Exception as e:\n    print(type(e))",
               timeout=120)  # fmt: skip


def test_live_charts_of_a_background_cluster_run_in_the_cell(kernel):
    """``watch`` on a background run on the cluster charts every rank's logged values at
    their steps: the events cross the machines on nbaccel's own channel."""
    pytest.importorskip("ipywidgets")
    kernel.run(
        "from nbaccel.monitor import watch\n"
        "handle = notebook_launcher(logged, (20,), num_processes=1, num_nodes=2,"
        " cluster='ray', block=False, return_all_ranks=True)\n"
        "monitor = watch(handle)",
        timeout=300,
    )
    losses = kernel.evaluate_json("handle.result(timeout=240)", timeout=300)
    kernel.drain(1.5)
    data = kernel.evaluate_json("{r: v for r, v in monitor.chart_data()['loss'].items()}")
    assert sorted(data) == ["0", "1"], data
    for rank in (0, 1):  # every logged value, at its step, per rank
        assert data[str(rank)] == [[float(s), v] for s, v in enumerate(losses[rank])]


def test_the_kernels_death_leaves_nothing_on_the_cluster(_kernels, ray_cluster):
    """A kernel killed (-9) in the middle of a cluster run: Ray ends its driver's actors and
    placement group, and the workers end with their channels."""
    session = _kernels[1][0]
    try:
        _connected(_kernels[1], ray_cluster)
        session.run(
            "handle = notebook_launcher(spin, num_processes=1, num_nodes=2, cluster='ray',"
            " block=False)",
            timeout=300,
        )
        assert wait_until(lambda: len(_workers()) == 2)
        assert not ray_cluster.idle()  # the check below can fail: it sees the run now
        os.kill(session.pid, signal.SIGKILL)
    finally:
        with contextlib.suppress(Exception):
            session.stop()
    assert wait_until(lambda: not _workers()), [p.cmdline() for p in _workers()]
    assert wait_until(lambda: ray_cluster.idle()), "actors or groups left on the cluster"


def test_the_hang_report_brings_every_remote_rank_stack_into_the_cell(kernel, tmp_path):
    flag = tmp_path / "go"  # one machine's filesystem: both "nodes" see it
    msg = kernel.submit(
        f"print('result', notebook_launcher(waits, ({str(flag)!r},), num_processes=1,"
        " num_nodes=2, cluster='ray', hang_after=2))"
    )
    kernel.wait_for_output(msg, "waiting in torch.distributed.all_reduce", timeout=300)
    flag.touch()  # rank 1 comes: nothing was killed, the launch completes
    cell = kernel.collect(msg, timeout=120).raise_for_error()
    assert "result 2.0" in cell.stdout
    assert "os.path.exists(flag)" in cell.stderr  # rank 1's Python stack, from its node
    # every rank the report names, with its pid and node: the live line, the stuck ranks
    # (or, were rank 1's polling judged work, the ranks that wait for it), each stack's header
    zero, one = _named(kernel, 0, HEAD_IP), _named(kernel, 1, NODE_B_IP)
    assert re.search(zero + r": waiting in torch\.distributed\.all_reduce", cell.stderr), (
        cell.stderr
    )
    assert re.search(f"--- where {one} (was|is) ---", cell.stderr), cell.stderr
    bare = [p.removeprefix(re.escape("rank ")) for p in (zero, one)]
    stuck = f"rank\\(s\\) {bare[0]}, {bare[1]} appear stuck"
    waits = f"rank\\(s\\) {bare[0]} wait for {one}, which is busy"
    assert re.search(f"{stuck}|{waits}", cell.stderr), cell.stderr


def _named(kernel: KernelSession, rank: int, ip: str) -> str:
    """The pattern of ``rank`` as every message names a cluster rank: its pid and node."""
    node_id = kernel.evaluate_json("node_ids()")[ip]
    return re.escape(f"rank {rank} (pid ") + r"\d+" + re.escape(f" on node {ip} ({node_id[:8]}))")


def test_pdb_on_a_failed_remote_rank_from_the_cell(kernel):
    kernel.run(
        "import nbaccel\n"
        "def check(batch):\n"
        "    x = batch * 41 // batch\n"
        "    raise ValueError(f'bad batch {batch}')\n"
        "def fails_on_one():\n"
        "    import torch.distributed as dist\n"
        "    accelerator = Accelerator()\n"
        "    if accelerator.process_index == 1:\n"
        "        check(11)\n"
        "    dist.barrier()\n"
        "try:\n"
        "    notebook_launcher(fails_on_one, num_processes=1, num_nodes=2, cluster='ray',"
        " debug=True, debug_timeout=120)\n"
        "except ValueError as err:\n"
        "    print('launch failed on rank', err.rank)\n",
        timeout=300,
    )
    assert len(_workers()) == 1  # rank 1 waits on its node for nbaccel.debug()
    cell, prompts = kernel.execute_answering("nbaccel.debug()", ["p x", "q"], timeout=120)
    cell.raise_for_error()
    assert prompts == ["(Pdb) "] * 2 and "41" in cell.stdout.splitlines(), cell.stdout
    # the session's header names each rank with its pid and node: the failed one, and where
    # the other one was when it failed
    one, zero = _named(kernel, 1, NODE_B_IP), _named(kernel, 0, HEAD_IP)
    assert re.search(f"post-mortem of {one}: ValueError: bad batch 11\n", cell.stdout), cell.stdout
    assert re.search(f"The other ranks when {one} failed:\n--- {zero}:", cell.stdout), cell.stdout


SAVES = """
import warnings
def saves():
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Linear(4, 4))
    expected = [p.detach().clone() for p in model.parameters()]
    accelerator.save_state("ckpt")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state("ckpt")
    return [os.getcwd(), all(torch.equal(a, b) for a, b in zip(expected, model.parameters()))]

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ranks = notebook_launcher(saves, num_processes=1, num_nodes=2, cluster="ray",
                              return_all_ranks=True)
saved = [ranks, os.getcwd(), sorted(os.listdir("ckpt")),
         [str(w.message) for w in caught if "does not exist on every node" in str(w.message)]]
"""


def test_ranks_work_in_the_kernels_directory_and_save_state_there(kernel):
    # the nodes have the kernel's directory (one disk here, as a shared home or project
    # mount): relative paths mean what they mean in the notebook, and the checkpoint is
    # beside it, not in the directory Ray's node was started from
    kernel.run(SAVES, timeout=300)
    ranks, here, files, warned = kernel.evaluate_json("saved")
    assert ranks == [[here, True], [here, True]], (ranks, here)
    assert {"rank_0.pt", "rank_1.pt", "nbaccel_checkpoint.json"} <= set(files), files
    assert warned == []


SCRIPT = """\
import os, sys
import torch
from nbaccel import Accelerator

accelerator = Accelerator()
total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), "sum")
rank, node = accelerator.process_index, os.environ["GROUP_RANK"]
print(f"script-rank-{rank}-node-{node}-sum-{total.item():g}", flush=True)
sys.exit(3 if rank == 1 else 0)
"""


def test_nbaccel_launch_runs_a_script_on_the_cluster_with_the_failing_ranks_exit_code(
    ray_cluster, tmp_path
):
    # the command line's face of `cluster`: its own Ray driver (no kernel), the ranks on
    # both nodes in one process group, their lines on stdout once, rank 1's exit code back
    (tmp_path / "train.py").write_text(SCRIPT)  # relative: the ranks run in the shell's dir
    command = [sys.executable, "-m", "nbaccel", "launch", "--cluster", ray_cluster.address,
               "--num_nodes", "2", "--num_processes", "1", "--cpu", "train.py"]  # fmt: skip
    env = {k: v for k, v in ray_cluster.env.items() if not k.startswith(("NBACCEL_", "HF_"))}
    env["XDG_CACHE_HOME"] = str(tmp_path)  # no saved config file of nbaccel's or Accelerate's
    done = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    lines = done.stdout.splitlines()
    assert sorted(lines) == ["script-rank-0-node-0-sum-3", "script-rank-1-node-1-sum-3"], done
    assert done.returncode == 3, done
    assert "nbaccel launch: rank 1 (pid " in done.stderr and "exited with code 3" in done.stderr


# A failure injected at each step of a cluster start, in the kernel (nbaccel's own steps
# replaced for one launch: never Ray's or torch's): whatever the start had opened is closed.
INJECT = """
import gc, threading
from collections import Counter
import nbaccel.launch.start.cluster._cluster as _cl

class Injected(RuntimeError):
    pass

def _raise(*args, **kwargs):
    raise Injected("injected")

def _after(real):  # the step's own work done, then the failure
    def step(*args, **kwargs):
        real(*args, **kwargs)
        raise Injected("injected")
    return step

def _on_call(real, n):  # the n-th call fails, before it does anything
    calls = []
    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise Injected("injected")
        return real(*args, **kwargs)
    return step

STEPS = {  # step -> (owner, name, replacement)
    "placement reserved": (_cl, "_actors", lambda real: _raise),
    "actors created": (_cl, "_actors", _after),
    "described": (_cl, "_say_other_workdirs", lambda real: _raise),
    "listening": (_cl, "_accept", lambda real: _raise),
    "mid-accept": (_cl._cluster_wire.AuthListener, "accept", lambda real: _on_call(real, 3)),
    "after pids": (_cl, "Channel", lambda real: _raise),
    "mid-workers": (_cl, "Channel", lambda real: _on_call(real, 2)),
    "send_setups": (_cl, "send_setups", lambda real: _raise),
}

def _fds():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own, closed again
            pass
    return out

def opened():
    gc.collect()  # what only a dropped traceback held is not a leak
    return {"fds": _fds(), "threads": [t.name for t in threading.enumerate()],
            **left_on_cluster()}

def grown(before):
    # what is open now that was not before: fds (what they are: a socket's or pipe's inode
    # is its own), threads, the cluster's actors and placement groups (empty: nothing left)
    now = opened()
    fds = list((Counter(now["fds"].values()) - Counter(before["fds"].values())).elements())
    threads = list((Counter(now["threads"]) - Counter(before["threads"])).elements())
    return {"fds": fds, "threads": threads, "actors": now["actors"], "groups": now["groups"]}

def start_failing_at(step):
    owner, name, replace = STEPS[step]
    real = getattr(owner, name)
    setattr(owner, name, replace(real))
    try:
        notebook_launcher(train, (1,), num_processes=1, num_nodes=2, cluster="ray")
    except Injected:
        return "injected"
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    finally:
        setattr(owner, name, real)
    return "started"
"""


@pytest.fixture(scope="module")
def injecting(kernel: KernelSession) -> KernelSession:
    """The kernel with :data:`INJECT`, after one whole cluster launch and one failed start:
    what Ray opens once per driver is open before the first count (its connections to each
    node; the thread and fd with which it first reports an actor call's error that nobody
    read: the ranks' launch calls of a start that failed while they connected)."""
    kernel.run(INJECT, timeout=60)
    kernel.run("notebook_launcher(train, (1,), num_processes=1, num_nodes=2, cluster='ray')",
               timeout=300)  # fmt: skip
    assert kernel.evaluate_json("start_failing_at('listening')", timeout=300) == "injected"
    return kernel


@pytest.mark.parametrize(
    "step",
    ["placement reserved", "actors created", "described", "listening", "mid-accept",
     "after pids", "mid-workers", "send_setups"],
)  # fmt: skip
def test_a_start_failing_at_any_step_leaves_nothing_open(injecting, step):
    """The kernel's fds and threads come back to what they were, and the cluster holds no
    actor or placement group of the launch (waited for: Ray ends a killed actor in its time)."""
    before = injecting.evaluate_json("opened()")
    assert before["actors"] == 0 and before["groups"] == 0, before
    ray_workers = {p.pid for p in _ray_workers()}
    assert injecting.evaluate_json(f"start_failing_at({step!r})", timeout=300) == "injected"
    nothing = {"fds": [], "threads": [], "actors": 0, "groups": 0}
    left = wait_until(lambda: injecting.evaluate_json(f"grown({before!r})") == nothing)
    assert left, injecting.evaluate_json(f"grown({before!r})")
    # a worker process Ray started for an actor killed while it was being created idles
    # until Ray ends it (no idle worker kept: conftest), which the leak check waits for
    assert wait_until(lambda: not [p for p in _ray_workers() if p.pid not in ray_workers])


def _ray_workers() -> list[psutil.Process]:
    """Ray's worker processes below this test process (the cluster's nodes are)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            ray = " ".join(proc.cmdline()).startswith("ray::")
            if ray and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


# Last in this module (one module: one pytest worker, one cluster): node b is gone after it.
def test_a_lost_node_ends_the_launch_naming_the_node_and_its_ranks(kernel, ray_cluster):
    msg = kernel.submit("notebook_launcher(spin, num_processes=1, num_nodes=2, cluster='ray')")
    kernel.wait_for_output(msg, r"spinning[\s\S]*spinning", timeout=300)
    assert ray_cluster.kill_node("b")
    cell = kernel.collect(msg, timeout=180)
    assert cell.error is not None and cell.error.ename == "LaunchError", cell.error
    text = cell.error.evalue
    assert "lost node 127.0.0.3" in text and "with rank(s) [" in text, text
    # what happens next, as it does: no restart was asked for, so the launch ends
    assert "The launch ends here (max_restarts=0)." in text, text
