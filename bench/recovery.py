"""Recovery bench (issue 52): a lost node to the first step after resuming, nbaccel against
Ray Train's ``FailureConfig`` on the same local Ray cluster and the same S3 store.

The cluster is the test suite's (tests/cluster/conftest.py's ``LocalCluster``: one ``ray
start`` per node, two CPUs each, all on loopback), here on addresses of its own (the head on
127.0.0.41, the second node on 127.0.0.42, each replacement on the next address), so that it
never meets a cluster the tests start beside it. The store is moto's S3 server on
127.0.0.40, a process of its own (not a thread of this driver, which also supervises
nbaccel's ranks). Everything is started and ended here; nothing leaves loopback (the AWS
clients get an explicit endpoint, dummy credentials, no profile and no instance metadata;
Ray's usage stats are off); every connection the machine holds to another address is
listed after each run.

Both systems run the same function body: ``Linear(64, 64)-ReLU-Linear(64, 1)``, AdamW, a
fixed batch of 32 per rank, DDP over gloo, two ranks on two nodes (one CPU each,
``STRICT_SPREAD``), 14 steps, a checkpoint to S3 every 4 steps, and at its start a load of
the latest checkpoint:

* nbaccel: ``notebook_launcher(..., num_processes=1, num_nodes=2, cluster="ray",
  max_restarts=1)`` with ``project_dir="s3://..."`` and automatic checkpoint naming;
  ``accelerator.load_state()`` at the start (every rank writes its own part; the store's
  address reaches the ranks as an argument, as in tests/cluster/test_cluster_resume.py).
* Ray Train: ``TorchTrainer`` with ``ScalingConfig(num_workers=2,
  placement_strategy="STRICT_SPREAD")``, ``RunConfig(storage_path=..., storage_filesystem=
  pyarrow.fs.S3FileSystem(endpoint_override=<the moto server>), failure_config=
  FailureConfig(max_failures=1))``; rank 0 reports the model, optimizer and step with
  ``ray.train.report(..., checkpoint=...)`` and the start loads
  ``ray.train.get_checkpoint()``.

At step 10 (two steps past the checkpoint of step 8) both ranks stop and wait for the driver;
the driver SIGKILLs every process of the second node (its raylet, agents and the rank's
process: the node is lost as a machine is), lets the surviving rank go on (its next
all-reduce fails on the dead peer, as it would mid-run), and at once starts a replacement
node (``ray start``, the same for both systems, at the same moment after the kill). The
clock starts at the kill and stops when the first step after the resume has ended on every
rank; it includes the system noticing the loss, ending the old group, waiting for and
placing on the replacement node, starting the rank processes, the training function's
setup (process group, model, DDP), the checkpoint's download and load, and that step. The
table splits it at the function's entry and the checkpoint's load (wall clocks of one
machine), and states when the replacement node had joined.

Rounds are interleaved (nbaccel, Ray Train, nbaccel, ...) after one unrecorded run of each
without a loss; medians with min-max.

    .venv/bin/python bench/recovery.py [--rounds 3]

Needs the ``ray`` extra with Ray Train (``ray[train]``: pyarrow), ``s3fs`` (the ``storage``
extra) and ``moto[server]`` (a test requirement): none is a runtime dependency of nbaccel.
Writes ``bench/results/recovery.md`` and ``.json``; ``bench/RESULTS_RECOVERY.md`` is the
latest run, committed.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
sys.path.insert(0, str(ROOT))

STORE_IP, HEAD_IP, SECOND_IP = "127.0.0.40", "127.0.0.41", "127.0.0.42"
BUCKET = "nbaccel-recovery"
STEPS, EVERY, PAUSE_AT = 14, 4, 10
SETTLE_S = 5.0  # between the ranks' pause at PAUSE_AT and the kill
HANG_GUARD_S = 900  # a wait this long is stuck, not slow


# -- the training function, shared --------------------------------------------------------
def _model_and_data(rank):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 64, generator=gen)
    return model, x, x.sum(1, keepdim=True)


def _loop(model, opt, x, y, rank, start, save, stamps, out, flag, pause_at):
    """Steps ``start``..STEPS; ``save(step)`` every EVERY steps; the pause for the driver at
    ``pause_at`` (a first attempt only); the end of the first step is stamped."""
    import torch

    for done in range(start + 1, STEPS + 1):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if done == start + 1:
            stamps["first_step"] = time.time()
        if done % EVERY == 0:
            save(done)
        if start == 0 and done == pause_at:
            Path(f"{out}.paused.{rank}").touch()
            while not os.path.exists(flag):
                time.sleep(0.02)
    tag = "resumed" if start else "first"
    Path(f"{out}.{tag}.{rank}.json").write_text(json.dumps({**stamps, "start": start}))


def nbaccel_fn(project_dir, store_env, out, flag, pause_at):
    entry = time.time()
    os.environ.update(store_env)
    import torch

    from nbaccel import Accelerator, ProjectConfiguration

    acc = Accelerator(project_config=ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=True))  # fmt: skip
    model, x, y = _model_and_data(acc.process_index)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with contextlib.suppress(FileNotFoundError):  # nothing saved yet on a first attempt
        acc.load_state()
    stamps = {"entry": entry, "loaded": time.time()}
    _loop(model, opt, x, y, acc.process_index, acc.step, lambda _: acc.save_state(), stamps,
          out, flag, pause_at)  # fmt: skip


def ray_train_fn(config):
    entry = time.time()
    import ray.train
    import ray.train.torch
    import torch

    rank = ray.train.get_context().get_world_rank()
    model, x, y = _model_and_data(rank)
    model = ray.train.torch.prepare_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt", weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    stamps = {"entry": entry, "loaded": time.time()}

    def save(step):
        with tempfile.TemporaryDirectory() as folder:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "step": step}, Path(folder) / "state.pt")  # fmt: skip
            ray.train.report({"step": step}, checkpoint=(
                ray.train.Checkpoint.from_directory(folder) if rank == 0 else None))  # fmt: skip

    _loop(model, opt, x, y, rank, start, save, stamps, config["out"], config["flag"],
          config["pause_at"])  # fmt: skip


# -- the two systems, as the driver runs them ---------------------------------------------
class Store:
    """moto's S3 server on STORE_IP, its own process (ended by its pid)."""

    def __init__(self, port: int, scratch: Path) -> None:
        self.port = port
        self.endpoint = f"http://{STORE_IP}:{port}"
        self.env = {
            "AWS_ACCESS_KEY_ID": "dummy-key",
            "AWS_SECRET_ACCESS_KEY": "dummy-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_CONFIG_FILE": str(scratch / "no-aws-config"),  # never a profile of this machine
            "AWS_SHARED_CREDENTIALS_FILE": str(scratch / "no-aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true",  # never the instance-metadata address
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", STORE_IP, "-p", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=5).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto's S3 server did not answer") from None
                time.sleep(0.2)
        self.client().create_bucket(Bucket=BUCKET)

    def client(self):
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id="dummy-key",
            aws_secret_access_key="dummy-secret", region_name="us-east-1",
        )  # fmt: skip

    def arrow(self):
        import pyarrow.fs

        return pyarrow.fs.S3FileSystem(
            access_key="dummy-key", secret_key="dummy-secret", region="us-east-1",
            scheme="http", endpoint_override=f"{STORE_IP}:{self.port}",
        )  # fmt: skip

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class Nodes:
    """The cluster's second node, lost and replaced once per recorded run."""

    def __init__(self, cluster: Any) -> None:
        self.cluster, self.second, self.count = cluster, "b", 0

    def lose_and_replace(self, out: str, flag: str) -> dict[str, float]:
        deadline = time.monotonic() + HANG_GUARD_S
        while not all(Path(f"{out}.paused.{r}").exists() for r in range(2)):
            if time.monotonic() > deadline:
                raise RuntimeError("the ranks never reached the step of the loss")
            time.sleep(0.05)
        # the last checkpoint's report reaches Ray Train's controller when it polls its
        # workers (every 2 s): the loss comes a few seconds after the pause, for both
        time.sleep(SETTLE_S)
        kill = time.time()
        pids = self.cluster.kill_node(self.second)
        Path(flag).touch()  # the surviving rank goes on into the dead peer
        self.count += 1
        name, ip = f"r{self.count}", str(ipaddress.ip_address(SECOND_IP) + self.count)
        join = time.time()
        self.cluster.add_node(name, ip)
        joined = time.time()
        self.cluster.end_node(self.second)  # reaps what is left of the lost node
        self.second = name
        return {"kill": kill, "join_started": join, "joined": joined, "killed": len(pids)}


def run_nbaccel(store: Store, out: str, nodes: Nodes | None) -> dict[str, Any]:
    from nbaccel import notebook_launcher

    flag, lines = f"{out}.flag", []

    def output(rank, stream, line):  # the launcher's own lines, timed; the ranks' too
        if line.startswith("nbaccel:"):
            lines.append((time.time(), line))
        print(f"[nbaccel {rank} {stream}] {line}", file=sys.stderr)

    handle = notebook_launcher(
        nbaccel_fn, (f"s3://{BUCKET}/{Path(out).name}", store.env, out, flag,
                     PAUSE_AT if nodes else 0),
        num_processes=1, num_nodes=2, cluster="ray", max_restarts=1,
        replace_timeout=HANG_GUARD_S, block=False, output=output,
    )  # fmt: skip
    loss = nodes.lose_and_replace(out, flag) if nodes else {}
    handle.result(timeout=HANG_GUARD_S)
    return {**loss, "said": lines}


def run_ray_train(store: Store, out: str, nodes: Nodes | None) -> dict[str, Any]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    flag = f"{out}.flag"
    trainer = TorchTrainer(
        ray_train_fn,
        train_loop_config={"out": out, "flag": flag, "pause_at": PAUSE_AT if nodes else 0},
        scaling_config=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(
            name=Path(out).name, storage_path=f"{BUCKET}/ray-train",
            storage_filesystem=store.arrow(), failure_config=FailureConfig(max_failures=1),
        ),
    )  # fmt: skip
    failed: list[BaseException] = []

    def fit():
        try:
            trainer.fit()
        except BaseException as err:
            failed.append(err)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    loss = nodes.lose_and_replace(out, flag) if nodes else {}
    thread.join(HANG_GUARD_S)
    if thread.is_alive() or failed:
        raise RuntimeError(f"Ray Train's run did not end well: {failed or 'still running'}")
    return loss


def _ranks(out: str, tag: str) -> list[dict[str, float]]:
    return [json.loads(Path(f"{out}.{tag}.{r}.json").read_text()) for r in range(2)]


def measure(out: str, loss: dict[str, Any]) -> dict[str, Any]:
    """Seconds from the kill: to the resumed function's entry (every rank in), to its
    checkpoint loaded, to its first step ended; and to the replacement node's join."""
    ranks = _ranks(out, "resumed")
    kill = loss["kill"]
    return {
        "resumed_at_step": sorted({r["start"] for r in ranks}),  # 8: the latest checkpoint
        "to_first_step": max(r["first_step"] for r in ranks) - kill,
        "to_entry": max(r["entry"] for r in ranks) - kill,
        "to_loaded": max(r["loaded"] for r in ranks) - kill,
        "to_joined": loss["joined"] - kill,
        "join": loss["joined"] - loss["join_started"],
        "said": loss.get("said", []),
    }


def foreign_connections(pids: set[int]) -> list[str]:
    """The connections of processes ``pids`` to an address outside loopback (should be none:
    the bench never leaves it)."""
    import psutil

    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid not in pids:
            continue
        if not conn.raddr:
            continue
        ip = ipaddress.ip_address(conn.raddr.ip)
        if not (getattr(ip, "ipv4_mapped", None) or ip).is_loopback:  # ::ffff:127.x is loopback
            found.append(f"pid {conn.pid}: {conn.laddr.ip}:{conn.laddr.port} -> "
                         f"{conn.raddr.ip}:{conn.raddr.port}")  # fmt: skip
    return found


def ours(cluster: Any, store: Store) -> set[int]:
    """This driver, the store and every process of the cluster, with their children."""
    import psutil

    procs = [psutil.Process(), psutil.Process(store.proc.pid), *cluster.processes()]
    pids = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            pids |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
    return pids


def _fmt(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{statistics.median(values):.1f} s ({min(values):.1f}–{max(values):.1f})"


def table(samples: dict[str, list[dict[str, Any]]], rounds: int, info: dict[str, Any]) -> str:
    rows = [
        ("lost node → first step after resuming", "to_first_step"),
        ("lost node → function entered again (every rank)", "to_entry"),
        ("lost node → checkpoint loaded (every rank)", "to_loaded"),
        ("lost node → replacement node joined (`ray start` returned)", "to_joined"),
    ]
    names = {"nbaccel": "nbaccel", "ray_train": "Ray Train"}
    lines = [
        "# Recovery bench (issue 52): lost node → first step after resuming",
        "",
        "Local Ray cluster on loopback (2 CPUs per node), 2 ranks on 2 nodes (1 CPU each, "
        "gloo), moto S3 on loopback; Linear(64, 64)-ReLU-Linear(64, 1), AdamW, a checkpoint "
        f"every {EVERY} steps, node 2 SIGKILLed at step {PAUSE_AT} and a replacement started "
        f"at once; {rounds} interleaved rounds, median (min–max).",
        "",
        "| | " + " | ".join(names[k] for k in samples) + " |",
        "|---|" + "---|" * len(samples),
    ]
    for label, key in rows:
        cells = [_fmt([s[key] for s in samples[k]]) for k in samples]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = [_fmt([s["to_first_step"] - s["to_joined"] for s in samples[k]]) for k in samples]
    lines.append("| replacement joined → first step after resuming | " + " | ".join(cells) + " |")
    cells = [", ".join(str(s["resumed_at_step"]) for s in samples[k]) or "–" for k in samples]
    lines.append("| resumed at step (each run; 8 = the latest checkpoint) | " + " | ".join(cells)
                 + " |")  # fmt: skip
    cells = [str(len(samples[k])) for k in samples]
    lines.append("| runs measured | " + " | ".join(cells) + " |")
    ratio = {}
    for label, fn in (
        ("lost node → first step", lambda s: s["to_first_step"]),
        ("replacement joined → first step", lambda s: s["to_first_step"] - s["to_joined"]),
    ):
        if samples["nbaccel"] and samples["ray_train"]:
            a = statistics.median(fn(s) for s in samples["nbaccel"])
            b = statistics.median(fn(s) for s in samples["ray_train"])
            ratio[label] = a / b
    lines += ["", "| ratio of medians, nbaccel / Ray Train | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in ratio.items()]
    lines += ["", "Machine and versions: " + ", ".join(f"{k} {v}" for k, v in info.items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import conftest

    # this bench's own loopback addresses (LocalCluster reads these names when it starts)
    conftest.HEAD_IP, conftest.NODE_B_IP = HEAD_IP, SECOND_IP
    scratch = Path(tempfile.mkdtemp(prefix="nbrecov"))
    store = Store(conftest._free_ports(1)[0], scratch)
    # no AWS profile of this machine and no instance metadata, in this driver and (through
    # the environment LocalCluster gives its nodes) in every process of the cluster
    os.environ.update({k: store.env[k] for k in (
        "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_EC2_METADATA_DISABLED")})  # fmt: skip
    cluster = conftest.LocalCluster()
    systems = {"nbaccel": run_nbaccel, "ray_train": run_ray_train}
    samples: dict[str, list[dict[str, Any]]] = {k: [] for k in systems}
    errors: list[str] = []
    foreign: list[str] = []
    try:
        cluster.start()
        import ray

        ray.init(address=cluster.address, _node_ip_address=HEAD_IP, log_to_driver=False)
        nodes = Nodes(cluster)
        for name, run in systems.items():  # one unrecorded run each, no loss
            run(store, str(scratch / f"warm-{name.replace('_', '-')}"), None)
        for i in range(args.rounds):
            for name, run in systems.items():
                out = str(scratch / f"{name.replace('_', '-')}-{i}")
                try:
                    samples[name].append(measure(out, run(store, out, nodes)))
                    print(f"{name} round {i}: {samples[name][-1]}", file=sys.stderr)
                except Exception as err:
                    errors.append(f"{name} round {i}: {type(err).__name__}: {err}")
                    print(errors[-1], file=sys.stderr)
                foreign += foreign_connections(ours(cluster, store))
    finally:
        with contextlib.suppress(Exception):
            sys.modules["ray"].shutdown()
        cluster.stop()
        store.stop()
        shutil.rmtree(scratch, ignore_errors=True)  # the ranks' marker files
    left = [p.pid for p in cluster.processes()]
    left += [store.proc.pid] if store.proc.poll() is None else []
    import ray
    import torch
    from report import machine_info

    info = machine_info({"torch": torch.__version__, "ray": ray.__version__}, sys.executable)
    for package in ("moto", "s3fs", "pyarrow"):
        info[package] = __import__(package).__version__
    text = table(samples, args.rounds, info)
    text += f"\nConnections off loopback during the runs: {sorted(set(foreign)) or 'none'}.\n"
    text += f"Cluster processes left after the bench: {left or 'none'}.\n"
    if errors:
        text += "\nFailed runs (not in the table):\n" + "".join(f"- {e}\n" for e in errors)
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "recovery.md").write_text(text)
    (out_dir / "recovery.json").write_text(json.dumps(
        {"samples": samples, "errors": errors, "info": info, "left": left}, indent=1))  # fmt: skip
    print(text)
    return 1 if errors or left else 0


if __name__ == "__main__":
    sys.exit(main())
