"""A local two-node Ray cluster on loopback, for the module that asks for it.

``ray.cluster_utils.Cluster`` binds its GCS to the machine's primary address; here each
node is its own ``ray start`` on an address of its own in the loopback range (the head on
127.0.0.2, its GCS on a free port there; node b on 127.0.0.3 joining it: Ray rewrites
127.0.0.1 to the primary address, not the rest of 127/8), with its own temp dir and a
custom resource (``node_head`` / ``node_b``) that tells the nodes apart, fixed free ports
for every agent, and no idle worker kept: a rank's actor
process ends with it (``RAY_num_workers_soft_limit=0``), so the conftest's leak check and
the tests' "nothing left" checks see the truth. At the module's end every process whose
command line names the cluster's temp dir or its head's address is ended (never ``ray
stop``, which would end any Ray on the machine).

Nothing here depends on the machine's speed or quiet (issue 49). Linux shares the CPU
between sessions first (autogroup), and in the whole suite every kernel and nbaccel worker is
a session of its own, as is each Ray node (its raylet, agents and the head's dozen dashboard
processes): a node's share was a small fraction of the machine, which the load average did
not show. Two things failed the cluster's start in whole runs, never alone:

* ``ray start`` gives a raylet a fixed 30 s (``raylet_start_wait_time_s`` in Ray's
  ``node.py``, a constant whatever its message says) to register with the GCS, and gives up
  leaving the node running; the fixture then waits for the event itself, the node listed
  alive by the cluster's state API, for as long as the node's raylet lives (its death is the
  failure, reported with the node's logs, the cause last). Node b starts once the head's
  dashboard answers, not while the head's processes still import.
* A raylet died within a second of its start, "Failed to start the grpc server" (a failed
  check: Ray's ``C`` log line), on both tries, in the fresh-clone runs of 7669dec (the head)
  and e38f9cf (node b): its ports had been found free by binding port 0, so they were
  ephemeral ones, and ``ray start`` binds them many seconds later on a loaded machine (24 s
  of its own Python there), while the suite's kernels and clients open connections whose
  source ports come from that same range. :func:`_free_ports` takes them from outside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

#: Ray replaces the literal loopback names (127.0.0.1, localhost) by the machine's primary
#: address (ray._private.services.resolve_ip_for_localhost); other addresses of the loopback
#: range are taken as they are: two "machines" on lo, and the kernel's driver on the head's
HEAD_IP, NODE_B_IP, NODE_C_IP = "127.0.0.2", "127.0.0.3", "127.0.0.4"
RAY_ENV = {
    "RAY_num_workers_soft_limit": "0",  # no idle worker kept for reuse
    "RAY_enable_worker_prestart": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    # a token in ~/.ray/auth_token (any earlier Ray on the machine may leave one) turns
    # token authentication on where this is unset: in some of the cluster's processes
    # and not others, a node then fails to join ("InvalidAuthToken", seen here)
    "RAY_AUTH_MODE": "disabled",
}
#: A hang guard, not a speed bound: a start that takes this long is stuck (an idle machine
#: starts a node in about 5 s; the slow-machine rehearsal in about 40 s)
HANG_GUARD_S = 900
#: For the nodes' own processes only (not the kernels'): Ray's start-up deadlines that a
#: loaded machine can pass become hang guards (none was seen to fire; the failures above had
#: other causes): a raylet exits when its agents do not answer within
#: agent_register_timeout_ms (30 s); a worker process not registered within
#: worker_register_timeout_seconds (60 s) is killed and its task fails; a raylet exits when
#: the GCS does not answer for gcs_rpc_server_reconnect_timeout_s (60 s).
NODE_PATIENCE = {
    "RAY_agent_register_timeout_ms": str(HANG_GUARD_S * 1000),
    "RAY_worker_register_timeout_seconds": str(HANG_GUARD_S),
    "RAY_gcs_rpc_server_reconnect_timeout_s": str(HANG_GUARD_S),
}
#: A starting node's session (its raylet, agents, GCS) runs at this autogroup nice value
#: until it is up: a raylet aborts when its dashboard agent, a Python process importing much
#: of Ray, has not written its port files within a fixed ~15 s per port (Ray's
#: WaitForDashboardAgentPorts, which no setting changes: "Timed out waiting for file
#: .../dashboard_agent_listen_port_...", in the slow-machine rehearsal of db146cd, twice).
#: Linux shares the CPU between sessions first (autogroup), so the node gets head room
#: whatever else runs; where the nice value cannot be lowered (no CAP_SYS_NICE) the node
#: starts without it.
HEAD_ROOM_NICE = -10
_WITH_HEAD_ROOM = """\
import contextlib, os, sys
with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
    f.write(sys.argv[1])
os.execv(sys.argv[2], sys.argv[2:])
"""
#: Ray's own words when a node's raylet did not register within its fixed 30 s
RAY_REGISTRATION_DEADLINE = "timed out during startup"


def _ephemeral_ports() -> range:
    """The range the kernel takes outgoing connections' source ports from."""
    with contextlib.suppress(OSError, ValueError):
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(low, high + 1)
    return range(32768, 61000)  # Linux's default


#: Ray's worker processes take ports from 10002-19999 (its --min/max-worker-port defaults)
RAY_WORKER_PORTS = range(10002, 20000)
#: Ray Client's proxy on a head starts a server per client connection on a port of its own
#: fixed range (MIN/MAX_SPECIFIC_SERVER_PORT in ray.util.client.server.proxier): a daemon of
#: this or a neighbouring cluster given one of them fails a ray:// connection ("Starting Ray
#: client server failed", seen once with two clusters on the machine)
RAY_CLIENT_SERVER_PORTS = range(23000, 24000)


def _free_ports(count: int) -> list[int]:
    """``count`` ports nothing listens on, for Ray's daemons to bind on every address.

    Never from the ephemeral range: a port found free there (bound to port 0) can be handed
    to any outgoing connection as its source port before Ray binds it, many seconds later on
    a loaded machine, and the suite's kernels and clients connect all the time. The raylet
    then dies at once, "Failed to start the grpc server" (issue 49: node b's raylet in the
    fresh-clone run of e38f9cf, both tries). Ports between Ray's worker ports and the
    ephemeral range are taken only by an explicit bind, which the probe here sees.
    """
    ephemeral = _ephemeral_ports()
    pool = range(RAY_WORKER_PORTS.stop, ephemeral.start)
    if len(pool) < 1000:  # an unusual ephemeral range: the ports above it instead
        pool = range(ephemeral.stop, 65536)
    if len(pool) < 1000:
        raise RuntimeError(
            f"no room for the cluster's ports outside the ephemeral range {ephemeral}: narrow "
            "/proc/sys/net/ipv4/ip_local_port_range"
        )
    found: list[int] = []
    for port in random.sample(pool, len(pool)):
        if port in RAY_CLIENT_SERVER_PORTS:
            continue
        probe = socket.socket()
        try:
            probe.bind(("0.0.0.0", port))  # any address: Ray's gRPC servers bind them all
        except OSError:
            continue
        finally:
            probe.close()
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"fewer than {count} free ports in {pool}")


class LocalCluster:
    """A head and a second node started with ``ray start``, on loopback only.

    ``node_b_args`` (e.g. ``("--num-gpus=2",)``) and ``node_b_env`` (e.g. a ``PATH`` that
    finds a stand-in ``nvidia-smi``) make node b unlike the head and the kernel's machine;
    ``head_args`` (e.g. ``("--num-gpus=1",)``: a GPU machine's one node) go to the head's;
    ``node_env`` is every node's (e.g. a ``PYTHONPATH`` whose ``sitecustomize`` refuses
    connections to the kernel's address). :attr:`client` is the head's Ray Client port
    (``ray://127.0.0.2:<client>``)."""

    def __init__(
        self,
        node_b_args: tuple[str, ...] = (),
        node_b_env: dict[str, str] | None = None,
        head_args: tuple[str, ...] = (),
        node_env: dict[str, str] | None = None,
    ) -> None:
        self.node_b_args, self.node_b_env = node_b_args, dict(node_b_env or {})
        self.head_args = head_args
        self.root = Path(tempfile.mkdtemp(prefix="nbr", dir="/tmp"))  # Unix sockets: short
        self.port, self.dashboard, self.client = _free_ports(3)
        self.address = f"{HEAD_IP}:{self.port}"
        self.ray = str(Path(sys.executable).parent / "ray")
        self.env = {**os.environ, **RAY_ENV, **NODE_PATIENCE, **(node_env or {})}
        self.late_nodes: list[str] = []  # nodes that joined after Ray's 30 s had passed
        self.head_room: dict[str, int | None] = {}  # each node's session nice while it started

    def _start(self, name: str, ip: str, *args: str) -> None:
        env = {**self.env, **(self.node_b_env if name == "b" else {})}
        agent, grpc, runtime_env, metrics, manager, objects = _free_ports(6)
        cmd = [
            self.ray, "start", f"--node-ip-address={ip}", "--num-cpus=2",
            f"--resources={json.dumps({f'node_{name}': 1})}",
            f"--temp-dir={self.root / name}", "--disable-usage-stats",
            f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={grpc}",
            f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
            f"--node-manager-port={manager}", f"--object-manager-port={objects}",
            *args,
        ]  # fmt: skip
        # its own process group: a test that kills "a node" kills only this one; and its own
        # session, given head room while it starts (HEAD_ROOM_NICE)
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", _WITH_HEAD_ROOM, str(HEAD_ROOM_NICE), *cmd],
            env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
            start_new_session=True,
            cwd=self.root,  # where a rank that lacks the kernel's directory would work: not the repo
        )  # fmt: skip
        self.head_room[name] = self._session_nice(name)
        late = done.returncode != 0 and RAY_REGISTRATION_DEADLINE in done.stdout + done.stderr
        joined = done.returncode == 0 or (late and self._joins(name, ip))
        self._set_session_nice(name, 0)  # up (or gone): it competes as any other session
        if not joined:
            raise RuntimeError(
                f"{' '.join(cmd)} failed after {time.monotonic() - began:.1f} s:\n{done.stdout}\n"
                f"{done.stderr}\n{self.diagnosis()}"
            )
        self.late_nodes += [name] if late else []

    def _set_session_nice(self, name: str, nice: int) -> None:
        for proc in self.processes(str(self.root / name)):
            with contextlib.suppress(OSError):
                Path(f"/proc/{proc.pid}/autogroup").write_text(str(nice))

    def _session_nice(self, name: str) -> int | None:
        """The autogroup nice value of node ``name``'s raylet's session (None: unknown)."""
        for proc in self.processes(str(self.root / name)):
            if _is_raylet(proc):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    text = Path(f"/proc/{proc.pid}/autogroup").read_text()
                    return int(text.split("nice")[1])
        return None

    def alive_nodes(self) -> list[str]:
        """The addresses of the nodes the cluster's state API lists alive (the head's
        dashboard, over HTTP: this process never imports Ray); empty while it cannot answer."""
        url = f"http://127.0.0.1:{self.dashboard}/api/v0/nodes?limit=100&detail=false"
        try:
            with urllib.request.urlopen(url, timeout=30) as reply:
                rows = json.load(reply)["data"]["result"]["result"]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        return [row["node_ip"] for row in rows if row.get("state") == "ALIVE"]

    def _joins(self, name: str, ip: str) -> bool:
        """Waits until node ``name`` (at ``ip``) is listed alive; False once its raylet is
        gone (it gave up, or crashed) without that. Ray's registration deadline passed, the
        node's processes live on: the event, not Ray's fixed 30 s, decides."""
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline:
            if ip in self.alive_nodes():
                return True
            raylets = [p for p in self.processes(str(self.root / name)) if _is_raylet(p)]
            if not raylets:
                return False
            time.sleep(0.5)
        return False

    def _wait_answering(self) -> None:
        """Waits until the head's dashboard lists the head alive: its processes (a dozen
        Python interpreters importing Ray) are up, not competing with the next node's start."""
        deadline = time.monotonic() + HANG_GUARD_S
        while HEAD_IP not in self.alive_nodes():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the head's dashboard never answered:\n{self.diagnosis()}")
            time.sleep(0.5)

    def _start_retried(self, name: str, ip: str, *args: str) -> None:
        """A start that failed otherwise than by Ray's registration deadline (a free port
        taken by another process between our choosing and Ray's binding it: the suite's
        kernels and workers bind ports all the time) is ended, then tried once more with
        fresh ports."""
        try:
            self._start(name, ip, *args)
        except RuntimeError:
            self._end(self.processes(str(self.root / name)))
            self._start(name, ip, *args)

    def start(self, *, node_b: bool = True) -> LocalCluster:
        """The head, then node b (``node_b=False``: the head alone, a one-node cluster)."""
        self._start_retried(
            "head", HEAD_IP, "--head", f"--port={self.port}", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard}", "--include-dashboard=true",
            f"--ray-client-server-port={self.client}",  # not Ray's fixed 10001
            *self.head_args,
        )  # fmt: skip
        self._wait_answering()
        if node_b:
            self._start_retried("b", NODE_B_IP, f"--address={self.address}", *self.node_b_args)
        return self

    def add_node(self, name: str, ip: str) -> None:
        """Another node joining the running cluster as node b did (its own ``ray start`` on
        ``ip``, custom resource ``node_<name>``), e.g. a replacement for a lost node; it
        returns once Ray's start returned, or the node is listed alive after Ray's 30 s."""
        self._start_retried(name, ip, f"--address={self.address}")

    def end_node(self, name: str) -> None:
        """End node ``name``'s processes (and reap them): a node a test added ends with the
        test, not with the module (the per-test check for children left running)."""
        self._end(self.processes(str(self.root / name)))

    def diagnosis(self) -> str:
        """What a failed start leaves to read: the last lines of every node's Ray logs so far,
        then every fatal and error line they hold, then the machine's load and pressure (CPU,
        I/O, memory stall shares). The cause comes last because a CI log is read from its
        end, often cut: a fatal check's own line comes before a long stack trace."""
        tails: list[str] = []
        causes: list[str] = []
        for log in sorted(self.root.glob("*/session_latest/logs/*")):
            if log.suffix in (".out", ".err", ".log") and log.stat().st_size:
                text = log.read_text(errors="replace").splitlines()
                name = log.relative_to(self.root)
                tails += [f"--- {name} (last lines)", *text[-15:]]
                # glog-style "[date time C pid tid]": C(ritical) is a failed check or a
                # fatal log (the process then aborts with a stack trace), E an error
                found = [line for line in text if re.match(r"^\[\S+ \S+ [CFE] \d+ \d+\]", line)]
                found += [line for line in text if "Traceback" in line or " ERROR " in line]
                if found:
                    causes += [f"--- {name} (fatal and error lines)", *found[:10]]
        machine = [f"load average: {os.getloadavg()}"]
        for kind in ("cpu", "io", "memory"):
            with contextlib.suppress(OSError):
                machine.append(
                    f"pressure {kind}: "
                    + Path(f"/proc/pressure/{kind}").read_text().replace("\n", "; ")
                )
        return "\n".join([*tails, "=== the cause, as the logs say it", *causes, *machine])

    def processes(self, under: str | None = None) -> list[psutil.Process]:
        """Every process of this cluster: its command line names its dir (or ``under``), or,
        for the whole cluster, its head's GCS address (the head's Ray client server names
        only that, and its parent ``ray start`` has exited: nothing else leads to it)."""
        marks = [under] if under else [str(self.root), f"--address={self.address}"]
        out = []
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(m in part for part in proc.info["cmdline"] or () for m in marks):
                    out.append(proc)
        return out

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL node ``name``'s process groups (its raylet, agents, workers): the node is
        lost as a machine is. Each node was started in its own session; the test's own
        process group is never one of them. Returns the pids that were there."""
        procs = self.processes(str(self.root / name))
        # Ray's worker processes (the ranks' actors, and what they started) are process
        # groups of their own, named by their title ("ray::RankHost"), not by the node's
        # dir: without them a rank lived on, and trained, seconds after its node was
        # "lost" (until its actor saw the raylet gone). They stay in the node's session.
        sessions = set()
        for proc in procs:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                sessions.add(os.getsid(proc.pid))
        sessions.discard(os.getsid(0))
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if proc not in procs and os.getsid(proc.pid) in sessions:
                    procs.append(proc)
        ours = os.getpgid(0)
        groups = set()
        for proc in procs:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                groups.add(os.getpgid(proc.pid))
        for group in groups - {ours}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, 9)
        psutil.wait_procs(procs, timeout=30)
        return [p.pid for p in procs]

    def idle(self) -> bool:
        """No live actor and no placement group that is not removed, as Ray's state API
        tells it (asked from a fresh process: this one never imports Ray)."""
        probe = (
            "import json, sys\n"
            "from ray.util.state import list_actors, list_placement_groups\n"
            "a = list_actors(address=sys.argv[1], filters=[('state', '!=', 'DEAD')])\n"
            "g = list_placement_groups(address=sys.argv[1], filters=[('state', '!=', 'REMOVED')])\n"
            "print(json.dumps([len(a), len(g)]))"
        )
        done = subprocess.run(
            [sys.executable, "-c", probe, f"http://127.0.0.1:{self.dashboard}"],
            env=self.env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        return done.returncode == 0 and json.loads(done.stdout.splitlines()[-1]) == [0, 0]

    def __enter__(self) -> LocalCluster:
        """The cluster started (a fixture's ``with LocalCluster(...) as cluster: yield``)."""
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._end(self.processes())
        shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def _end(procs: list[psutil.Process]) -> None:
        # the raylets and workers too: children of the daemons above
        for proc in list(procs):
            with contextlib.suppress(psutil.Error):
                procs += proc.children(recursive=True)
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        # Ray's GCS, raylets and agents outlive SIGTERM by more than 10 s (measured): a
        # short grace, then SIGKILL, as a lost machine (the cluster's files go with root)
        _, alive = psutil.wait_procs(procs, timeout=2)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=10)
        for child in psutil.Process().children():  # orphans re-parented to the subreaper
            with contextlib.suppress(psutil.Error, ChildProcessError):
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)


def nbaccel_workers(root: str | Path) -> list[psutil.Process]:
    """nbaccel worker processes started on the cluster whose temp dir is ``root``: spawned
    workers an ancestor of which (a raylet) names it; other suites' workers are not."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(proc.info["cmdline"] or ())
            if "spawn_main" not in cmd or "nbaccel.launch.worker._worker" not in cmd:
                continue
            if any(str(root) in " ".join(p.cmdline()) for p in proc.parents()):
                found.append(proc)
    return found


def _is_raylet(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.name() == "raylet" and proc.status() != psutil.STATUS_ZOMBIE
    return False


@pytest.fixture(scope="module")
def ray_cluster():
    """The local two-node cluster (skipped, saying why, without Ray): one per session, as
    one module uses it (test_cluster_kernel.py); module-scoped so that it ends with that
    module instead of idling beside every later file of its pytest-xdist worker (Ray's
    daemons use CPU while idle)."""
    pytest.importorskip("ray", reason="needs the ray extra: pip install 'nbaccel[ray]'")
    with LocalCluster() as cluster:
        yield cluster


def wait_until(predicate, every: float = 0.2):
    """Poll ``predicate`` until truthy (its value) or the hang guard (its last value).

    Every use waits for an event (actors gone, workers ended), so the bound is the guard,
    never a speed: a real leak never ends and still fails, once the guard has passed."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)
