"""Checkpoints on object storage: save_state / load_state / save_model with fsspec URLs.

An S3 server on loopback (moto's server mode, started and stopped by each test on a free
port) and s3fs as the client; credentials and endpoint come from the environment only
(``AWS_*``), as they would for a user. Two real ranks over gloo save and load through
``s3://`` and ``file://``; through ``s3://`` each rank writes on local disk only inside
temporary folders of its own, never in one another rank reads (Python's audit events tell
what each opens); a save cut short by the store going away leaves the previous checkpoint
loadable; a URL whose package is missing or whose scheme nothing handles is refused before
anything is written; nothing named ``s3:`` ever appears in the cwd.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~3 s): once here, not in every forked worker
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.launch.testing import find_free_port, run_on_workers
from nbaccel.runtime.facade.options import ProjectConfiguration

pytestmark = [
    pytest.mark.integration,
    # the S3 server's thread runs in this process when it forks the workers; it never
    # holds a lock they need (logging's locks are re-made in a forked child)
    pytest.mark.filterwarnings("ignore:nbaccel forks its workers:RuntimeWarning"),
]

s3fs = pytest.importorskip("s3fs")  # the `storage` extra (scripts/setup.sh installs it)
moto_server = pytest.importorskip("moto.server")

BUCKET = "nbaccel-test"
SHORT = {"NBACCEL_TIMEOUT": "30"}


@pytest.fixture
def s3(tmp_path, monkeypatch):
    """A fresh S3 server on 127.0.0.1 with one bucket; yields (server, env) and stops it."""
    port = find_free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # moto keeps its objects per process, not per server: start from an empty store
    urllib.request.urlopen(
        urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST")
    ).close()
    env = {
        "AWS_ACCESS_KEY_ID": "dummy-key",
        "AWS_SECRET_ACCESS_KEY": "dummy-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",  # botocore reads it: no nbaccel setting
        # never a real profile of this machine; a dead store fails fast
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "AWS_MAX_ATTEMPTS": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance cached for an earlier server's port
    _Bucket().client.create_bucket(Bucket=BUCKET)
    try:
        yield server, env
    finally:
        server.stop()
        _stop_fsspec_io()


def _stop_fsspec_io():
    """End fsspec's IO thread (and its loop's executor thread) that a test in this
    process started: later tests fork workers and warn about threads they do not know."""
    import asyncio

    import fsspec.asyn

    running = fsspec.asyn.loop[0]
    for fs in list(s3fs.S3FileSystem._cache.values()):  # their HTTP sessions, on that loop
        if running is not None and getattr(fs, "_s3", None) is not None:
            s3fs.S3FileSystem.close_session(running, fs._s3)
    s3fs.S3FileSystem.clear_instance_cache()
    if running is None:
        return
    asyncio.run_coroutine_threadsafe(running.shutdown_default_executor(), running).result(10)
    running.call_soon_threadsafe(running.stop)
    fsspec.asyn.iothread[0].join(10)
    running.close()
    fsspec.asyn.loop[0] = fsspec.asyn.iothread[0] = None


class _Bucket:
    """The test's view of the bucket, through botocore's plain client: no fsspec event-loop
    thread in the test process, which forks the workers."""

    def __init__(self):
        import botocore.session

        self.client = botocore.session.get_session().create_client("s3")

    def cat(self, key):
        return self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    def size(self, key):
        return self.client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]

    def keys(self, prefix):
        found = self.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
        return sorted(o["Key"][len(prefix) :] for o in found.get("Contents", []))

    def put(self, key, body):
        self.client.put_object(Bucket=BUCKET, Key=key, Body=body)

    def rm(self, key):
        self.client.delete_object(Bucket=BUCKET, Key=key)


def _build(seed=0, **kwargs):
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(cpu=True, **kwargs)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    return (acc, *acc.prepare(model, optimizer, loader))


def _train(acc, model, optimizer, loader, steps):
    done = 0
    while done < steps:
        for x, y in loader:
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                return


def _weights(acc, model):
    return [p.detach().clone() for p in acc.unwrap_model(model).parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# -- two ranks over gloo ---------------------------------------------------------------------


def _two_rank_worker(base):
    from nbaccel import load_checkpoint_in_model

    acc, model, optimizer, loader = _build()
    _train(acc, model, optimizer, loader, 3)
    saved, rng_at_save = _weights(acc, model), torch.get_rng_state()
    path = acc.save_state(f"{base}/ckpt")  # every rank: each writes its own part
    acc.save_model(model, f"{base}/model", max_shard_size="100B")  # shards + index
    acc.wait_for_everyone()
    torch.manual_seed(100 + acc.process_index)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    loaded = acc.load_state(f"{base}/ckpt")
    restored = _same(saved, _weights(acc, model)) and torch.equal(
        torch.get_rng_state(), rng_at_save
    )
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    load_checkpoint_in_model(fresh, f"{base}/model")
    from_model = _same(saved, [p.detach() for p in fresh.parameters()])

    # automatic naming under project_dir, total_limit=2; load_state() takes the latest
    acc2, model2, optimizer2, loader2 = _build(
        project_config=ProjectConfiguration(
            project_dir=f"{base}/run", automatic_checkpoint_naming=True, total_limit=2
        )
    )
    history = []
    for _ in range(3):
        _train(acc2, model2, optimizer2, loader2, 1)
        history.append(_weights(acc2, model2))
        acc2.save_state()
    acc2.wait_for_everyone()
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    latest = acc2.load_state()
    return {
        "path": path,
        "loaded": loaded,
        "restored": restored,
        "from_model": from_model,
        "latest": latest,
        "latest_restored": _same(history[-1], _weights(acc2, model2)),
        "iteration": acc2.project_configuration.iteration,
        "step": acc2.step,
    }


def _recording_local_files(fn, *args):
    """``fn(*args)``, and what this rank did on local disk meanwhile, as Python's audit events
    tell it: the temporary folders it made, every path it opened for writing (or made, or
    renamed to), and the paths under the temporary directory it opened to read."""
    import tempfile

    seen = {"folders": [], "written": [], "read": []}
    state = {"on": True, "inside": False}
    tmp = os.path.realpath(tempfile.gettempdir()) + os.sep

    def hook(event, args):
        if not state["on"] or state["inside"] or event not in _FILE_EVENTS:
            return
        state["inside"] = True  # realpath's own calls are not this rank's files
        try:
            path = args[1] if event in ("os.rename", "os.replace") else args[0]
            if isinstance(path, int):  # an open file descriptor: its file was seen opened
                return
            path = os.path.realpath(os.fsdecode(path))
            if event == "tempfile.mkdtemp":
                seen["folders"].append(path)
            elif event != "open" or _opens_to_write(args):
                seen["written"].append(path)
            elif path.startswith(tmp):
                seen["read"].append(path)
        finally:
            state["inside"] = False

    sys.addaudithook(hook)  # this worker process ends with the launch: it goes with it
    try:
        result = fn(*args)
    finally:
        state["on"] = False
    left = [f for f in seen["folders"] if os.path.exists(f)]
    return {"result": result, **seen, "left": left}


_FILE_EVENTS = {"open", "tempfile.mkdtemp", "os.mkdir", "os.rename", "os.replace"}


def _opens_to_write(args):
    """An "open" audit event's (path, mode, flags): open() gives a mode, os.open flags."""
    _, mode, flags = args
    if mode is None:
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    return bool(set(mode) & set("wax+"))


def _inside(path, folders):
    return any(path == f or path.startswith(f + os.sep) for f in folders)


def test_two_ranks_save_and_load_through_s3(s3, tmp_path, monkeypatch):
    _, env = s3
    monkeypatch.chdir(tmp_path)  # the workers' cwd too: where the bug wrote a folder "s3:"
    base = f"s3://{BUCKET}/run1"
    recorded = run_on_workers(
        _recording_local_files, 2, args=(_two_rank_worker, base), env={**SHORT, **env}
    )
    # no file of a save or a load touches a disk another rank could read (issue 52): each
    # rank writes only inside temporary folders it made itself, reads no other rank's, and
    # removes them; everything else goes to the store
    for rank, mine in enumerate(recorded):
        theirs = recorded[1 - rank]["folders"]
        assert mine["folders"] and not set(mine["folders"]) & set(theirs), (rank, mine)
        outside = [p for p in mine["written"] if not _inside(p, mine["folders"])]
        assert outside == [], (rank, outside)
        assert [p for p in mine["read"] if _inside(p, theirs)] == [], rank
        assert mine["left"] == [], (rank, mine["left"])
    results = [r["result"] for r in recorded]
    for rank, result in enumerate(results):
        assert result["path"] == result["loaded"] == f"{base}/ckpt", rank
        assert result["restored"] and result["from_model"], rank
        assert result["latest"] == f"{base}/run/checkpoints/checkpoint_2", rank
        assert result["latest_restored"] and result["iteration"] == 3, rank
    bucket = _Bucket()
    manifest = json.loads(bucket.cat("run1/ckpt/nbaccel_checkpoint.json"))
    data = f"run1/ckpt/{manifest['data']}"
    assert {"model.safetensors", "optimizer.bin", "rank_0.pt"} <= set(manifest["files"])
    for name, size in manifest["files"].items():
        assert bucket.size(f"{data}/{name}") == size
        assert len(manifest["sha256"][name]) == 64
    # rank 1 wrote its own part into the same save; nothing but the manifest and one save
    assert "rank_1.pt" in bucket.keys(f"{data}/")
    assert {k.split("/")[0] for k in bucket.keys("run1/ckpt/")} == {
        "nbaccel_checkpoint.json",
        manifest["data"],
    }
    names = bucket.keys("run1/model/")
    assert "model.safetensors.index.json" in names and len(names) > 2
    kept = {k.split("/")[0] for k in bucket.keys("run1/run/checkpoints/")}
    assert kept == {"checkpoint_1", "checkpoint_2"}  # total_limit=2: the oldest went
    assert os.listdir(tmp_path) == []  # no local "s3:" folder, nothing else


def test_two_ranks_save_and_load_through_file_urls(tmp_path, monkeypatch):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    base = f"file://{tmp_path}/store"
    results = run_on_workers(_two_rank_worker, 2, args=(base,), env=SHORT)
    for rank, result in enumerate(results):
        assert result["restored"] and result["from_model"] and result["latest_restored"], rank
        assert Path(result["loaded"]) == tmp_path / "store" / "ckpt", rank
    assert (tmp_path / "store" / "ckpt" / "nbaccel_checkpoint.json").is_file()
    kept = sorted(os.listdir(tmp_path / "store" / "run" / "checkpoints"))
    assert kept == ["checkpoint_1", "checkpoint_2"]
    assert os.listdir(work) == []  # no local "file:" folder


def _fsdp_worker(target):
    from nbaccel import Accelerator, FullyShardedDataParallelPlugin
    from nbaccel.runtime.process.state import reset_state

    def build(seed):
        reset_state()
        plugin = FullyShardedDataParallelPlugin(
            auto_wrap_policy="size_based_wrap",
            state_dict_type="SHARDED_STATE_DICT",
            min_num_params=50,
        )
        acc = Accelerator(fsdp_plugin=plugin)
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return (acc, *acc.prepare(model, optimizer))

    acc, model, optimizer = build(0)
    for _ in range(3):
        acc.backward(model(torch.randn(4, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    saved = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    acc.save_state(target)  # every rank uploads its own shard
    acc, model, optimizer = build(1234)
    acc.load_state(target)
    got = acc.get_state_dict(model)
    return {"same": all(torch.equal(saved[k], got[k]) for k in saved), "step": acc.step}


def test_fsdp_ranks_each_upload_their_shard_and_load_it_back(s3, tmp_path, monkeypatch):
    _, env = s3
    monkeypatch.chdir(tmp_path)
    target = f"s3://{BUCKET}/fsdp/ckpt"
    results = run_on_workers(_fsdp_worker, 2, args=(target,), env={**SHORT, **env})
    assert all(r["same"] and r["step"] == 3 for r in results), results
    manifest = json.loads(_Bucket().cat("fsdp/ckpt/nbaccel_checkpoint.json"))
    # each rank's shard file is listed (so confirmed uploaded) before the manifest was written
    for folder in ("model.dcp", "optimizer.dcp"):
        assert {f"{folder}/__0_0.distcp", f"{folder}/__1_0.distcp", f"{folder}/.metadata"} <= set(
            manifest["files"]
        )
    assert {"rank_0.pt", "rank_1.pt"} <= set(manifest["sha256"])
    assert os.listdir(tmp_path) == []


# -- a save that the store's going away cuts short -------------------------------------------


def test_interrupted_save_leaves_the_previous_checkpoint_loadable(s3, tmp_path, monkeypatch):
    server, _ = s3
    monkeypatch.chdir(tmp_path)
    target = f"s3://{BUCKET}/run2/ckpt"
    acc, model, optimizer, loader = _build()
    _train(acc, model, optimizer, loader, 2)
    first = _weights(acc, model)
    acc.save_state(target)
    assert os.listdir(tmp_path) == []  # into the store, not into a local folder "s3:"

    from nbaccel.checkpoint import remote, store
    from nbaccel.errors import CheckpointError

    _train(acc, model, optimizer, loader, 2)
    assert not _same(first, _weights(acc, model))

    uploads = []
    real_upload = store.upload

    def upload_then_lose_the_store(fs, local, path):
        result = real_upload(fs, local, path)
        uploads.append(path)
        if len(uploads) == 1:  # one part is in the store: now the store goes away
            server.stop()
        return result

    monkeypatch.setattr(remote, "upload", upload_then_lose_the_store)
    with pytest.raises(CheckpointError) as caught:
        acc.save_state(target)
    message = str(caught.value)
    assert target in message and "reachable" in message, message
    assert len(uploads) == 1  # it died mid-save, after a part was written
    monkeypatch.setattr(remote, "upload", real_upload)

    # the store comes back (moto keeps its objects in this process): the old one loads
    server.start()
    s3fs.S3FileSystem.clear_instance_cache()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert acc.load_state(target) == target
    assert _same(first, _weights(acc, model))
    assert acc.step == 2
    # the interrupted save's part is not a checkpoint; the next save there removes it
    bucket = _Bucket()
    assert len({k.split("/")[0] for k in bucket.keys("run2/ckpt/")}) == 3
    acc.save_state(target)  # at the loaded step: a new save, not taken for the loaded one
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(target)
    assert _same(first, _weights(acc, model))
    _train(acc, model, optimizer, loader, 3)  # past the step of the interrupted save
    acc.save_state(target)
    manifest = json.loads(bucket.cat("run2/ckpt/nbaccel_checkpoint.json"))
    assert {k.split("/")[0] for k in bucket.keys("run2/ckpt/")} == {
        "nbaccel_checkpoint.json",
        manifest["data"],
    }
    assert os.listdir(tmp_path) == []


def test_a_partial_or_damaged_checkpoint_is_never_loaded(s3, tmp_path, monkeypatch):
    from nbaccel.errors import CheckpointError

    monkeypatch.chdir(tmp_path)
    acc, *_ = _build(
        project_config=ProjectConfiguration(
            project_dir=f"s3://{BUCKET}/run3", automatic_checkpoint_naming=True
        )
    )
    acc.save_state()
    acc.save_state()
    bucket = _Bucket()
    root = "run3/checkpoints"
    # checkpoint_1 loses its manifest (a save that died before it): not a checkpoint
    bucket.rm(f"{root}/checkpoint_1/nbaccel_checkpoint.json")
    with pytest.raises(CheckpointError, match=r"no nbaccel_checkpoint\.json"):
        acc.load_state(f"s3://{BUCKET}/{root}/checkpoint_1")
    with pytest.warns(UserWarning, match="skipping"):
        assert acc.load_state() == f"s3://{BUCKET}/{root}/checkpoint_0"  # latest complete
    # a listed file with another size: damaged, refused
    manifest = json.loads(bucket.cat(f"{root}/checkpoint_0/nbaccel_checkpoint.json"))
    data = f"{root}/checkpoint_0/{manifest['data']}"
    bucket.put(f"{data}/optimizer.bin", b"truncated")
    with pytest.raises(CheckpointError, match="incomplete or damaged"):
        acc.load_state(f"s3://{BUCKET}/{root}/checkpoint_0")
    # the same size but other bytes: the sha256 catches it while downloading
    size = manifest["files"]["optimizer.bin"]
    bucket.put(f"{data}/optimizer.bin", b"x" * size)
    with pytest.raises(CheckpointError, match="sha256"):
        acc.load_state(f"s3://{BUCKET}/{root}/checkpoint_0")
    assert os.listdir(tmp_path) == []


# -- refused before anything is written ------------------------------------------------------


def test_a_url_nothing_handles_or_whose_package_is_missing_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    acc, model, *_ = _build()
    with pytest.raises(Exception, match="no installed package handles nosuchstore://") as caught:
        acc.save_state("nosuchstore://bucket/ckpt")
    assert type(caught.value).__name__ == "StorageError"
    assert os.listdir(tmp_path) == []

    from nbaccel.errors import StorageError

    # gs:// needs gcsfs: refused naming it (made missing here whether or not it is installed)
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    with pytest.raises(StorageError, match="pip install gcsfs"):
        acc.save_state("gs://bucket/ckpt")
    with pytest.raises(StorageError, match="pip install gcsfs"):
        acc.save_model(model, "gs://bucket/model")
    with pytest.raises(StorageError, match="pip install gcsfs"):
        acc.load_state("gs://bucket/ckpt")
    # without fsspec itself: refused naming fsspec and the store's package
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(StorageError, match="pip install fsspec s3fs"):
        acc.save_state("s3://bucket/ckpt")
    with pytest.raises(StorageError, match="pip install fsspec s3fs"):
        _build(
            project_config=ProjectConfiguration(
                project_dir="s3://bucket/run", automatic_checkpoint_naming=True
            )
        )
    assert os.listdir(tmp_path) == []  # no "s3:", "gs:" or "nosuchstore:" folder


def test_trackers_refuse_a_store_logging_dir_instead_of_a_local_s3_folder(tmp_path, monkeypatch):
    from nbaccel.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    acc, *_ = _build(project_dir=f"s3://{BUCKET}/run", log_with="jsonl")
    with pytest.raises(ConfigError, match="trackers write local files"):
        acc.init_trackers("exp")
    # a local logging_dir beside a store project_dir works
    acc, *_ = _build(
        project_config=ProjectConfiguration(
            project_dir=f"s3://{BUCKET}/run", logging_dir=str(tmp_path / "logs")
        ),
        log_with="jsonl",
    )
    acc.init_trackers("exp")
    acc.end_training()
    assert os.listdir(tmp_path) == ["logs"]


def _touches(project_dir, marker):
    with open(marker, "w") as out:  # a rank started
        out.write(str(project_dir))


def test_a_launch_whose_argument_is_a_store_url_it_cannot_reach_is_refused_before_any_rank(
    tmp_path, monkeypatch
):
    from nbaccel import notebook_launcher
    from nbaccel.errors import StorageError
    from nbaccel.runtime.process.state import reset_state

    reset_state()  # an earlier test's Accelerator in this process
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    marker = tmp_path / "a-rank-started"
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # missing, whether or not it is installed
    with pytest.raises(StorageError, match=r"args\[0\]='gs://bucket/run'.*pip install gcsfs"):
        notebook_launcher(_touches, ("gs://bucket/run", str(marker)), num_processes=2)
    # one level inside a dict too; without fsspec: both packages named, and the extra
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(StorageError, match=r"args\[0\]\['project_dir'\]='s3://b/run'") as caught:
        notebook_launcher(_touches, ({"project_dir": "s3://b/run"}, str(marker)), num_processes=2)
    assert "pip install fsspec s3fs (or pip install 'nbaccel[storage]')" in str(caught.value)
    # another scheme may be anything the function handles itself: not refused
    notebook_launcher(_touches, ("postgres://db/run", str(marker)), num_processes=2)
    assert marker.read_text() == "postgres://db/run"
    assert os.listdir(work) == []  # no local folder "gs:" or "s3:"
