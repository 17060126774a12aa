"""Fault injection on checkpoints: SIGKILL at random points, a full disk, a read-only project.

Every trial is a real process writing real files; after each fault the previous
checkpoint must load with consistent contents, the error (where there is one) must
say what happened and what to do, and no process may be left (conftest checks).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import resource
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch._dynamo
from waits import HANG_GUARD_S

import nbaccel.runtime.facade.accelerator  # noqa: F401  (likewise: forked children inherit it)
from nbaccel.launch.testing import run_on_workers
from nbaccel.platform.forksafe import release_openmp_threads

pytestmark = pytest.mark.faults

TRIALS = 20


class Counter:
    """A registered custom object: its value must always match the weights."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _build(root: str, total_limit: int | None = 2):
    from nbaccel import Accelerator
    from nbaccel.runtime.facade.options import ProjectConfiguration
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    config = ProjectConfiguration(
        project_dir=root, automatic_checkpoint_naming=True, total_limit=total_limit
    )
    acc = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, optimizer, counter


def _set_step(model, optimizer, counter, step: int) -> None:
    x = torch.randn(4, 128)
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    counter.value = step


def _train_and_save_forever(root: str, ready: str) -> None:
    """Child: train and save every step until killed (the first save signals ready)."""
    acc, model, optimizer, counter = _build(root)
    step = 0
    while True:
        step += 1
        _set_step(model, optimizer, counter, step)
        acc.save_state()
        if step == 1:
            Path(ready).touch()


def _fork(target, *args) -> mp.Process:
    release_openmp_threads()  # else the forked child can hang in its first parallel op
    child = mp.get_context("fork").Process(target=target, args=args)
    child.start()
    return child


def _wait_for(path: Path, child: mp.Process, seconds: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.exists(), f"the child never got ready (exit code {child.exitcode})"


def _load_all(roots: list[str]) -> list[dict]:
    """Worker: load the latest checkpoint of every root; report what came back."""
    out = []
    for root in roots:
        acc, model, optimizer, counter = _build(root)
        loaded = acc.load_state()
        values = {p.detach().flatten()[0].item() for p in model.parameters()}
        uniform = all(torch.all(p == p.flatten()[0]).item() for p in model.parameters())
        out.append(
            {
                "loaded": Path(loaded).name,
                "counter": counter.value,
                "weights": sorted(values),
                "uniform": uniform,
                "optimizer_steps": len(optimizer.state_dict()["state"]),
            }
        )
    return out


def test_sigkill_at_random_points_of_training_and_save_state(tmp_path, record_property):
    rng = random.Random(13)
    roots, mid_save = [], 0
    for trial in range(TRIALS):
        root = tmp_path / f"trial{trial}"
        ready = tmp_path / f"ready{trial}"
        child = _fork(_train_and_save_forever, str(root), str(ready))
        try:
            _wait_for(ready, child)
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join()
        assert child.exitcode == -signal.SIGKILL
        names = os.listdir(root / "checkpoints")
        mid_save += any(".tmp-" in n or ".old-" in n for n in names)
        roots.append(str(root))
    results = run_on_workers(_load_all, 1, args=(roots,))[0]
    for trial, result in enumerate(results):
        # the weights, the optimizer and the custom object all come from one save
        assert result["uniform"] and result["weights"] == [float(result["counter"])], (
            trial,
            result,
        )
        assert result["counter"] >= 1 and result["optimizer_steps"] > 0, (trial, result)
    record_property("kills", TRIALS)
    record_property("kills_mid_save", mid_save)
    print(f"{TRIALS} kills, {mid_save} of them inside save_state; every previous checkpoint loaded")
    assert mid_save >= 1, "no kill landed inside save_state: the trial timing is off"


# -- a full disk ---------------------------------------------------------------------------


@contextlib.contextmanager
def _small_disk(path: Path, size: str, mount: bool = True):
    """A tmpfs of ``size`` at ``path`` (root with mount rights); yields whether it mounted."""
    path.mkdir()
    mounted = False
    if mount and os.geteuid() == 0 and shutil.which("mount"):
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
        )
        mounted = done.returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def _save_until_full(root: str, file_limit: int | None, report: str) -> None:
    """Child: one good checkpoint, then a bigger save that cannot fit; report the error."""
    acc, model, optimizer, counter = _build(root, total_limit=None)
    _set_step(model, optimizer, counter, 1)
    acc.save_state()
    if file_limit is not None:  # no tmpfs here: a per-process file size limit instead
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))
    _set_step(model, optimizer, counter, 2)
    try:
        acc.save_state()
        Path(report).write_text("no error")
    except Exception as err:
        Path(report).write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")


@pytest.mark.parametrize("kind", ["small-filesystem", "file-size-limit"])
def test_disk_full_during_save_state(tmp_path, kind, record_property):
    """A 600 KB tmpfs where mounting is allowed (root with CAP_SYS_ADMIN); elsewhere, and
    always in the second case, a per-process RLIMIT_FSIZE of 64 KB (no privileges needed)."""
    disk = tmp_path / "disk"
    # one checkpoint is ~0.4 MB (weights + AdamW moments): the second does not fit
    with _small_disk(disk, "600k", mount=kind == "small-filesystem") as mounted:
        tmpfs = kind == "small-filesystem" and mounted
        ran = "tmpfs (600 KB)" if tmpfs else "RLIMIT_FSIZE (64 KB)"
        print(f"disk full via {ran}")
        record_property("disk_full", ran)
        report = tmp_path / "report.txt"
        child = _fork(_save_until_full, str(disk), None if tmpfs else 64 * 1024, str(report))
        child.join(120)
        assert child.exitcode == 0, child.exitcode
        message = report.read_text()
        assert "no error" not in message
        first = message.splitlines()[0]
        assert "save_state could not write" in first and "previous checkpoint" in first, message
        assert ("No space left" if tmpfs else "File too large") in first, message
        names = sorted(os.listdir(disk / "checkpoints"))
        assert names == ["checkpoint_0"], names  # nothing half-written left behind
        result = run_on_workers(_load_all, 1, args=([str(disk)],))[0][0]
        assert result["loaded"] == "checkpoint_0" and result["weights"] == [1.0], result


# -- a read-only project directory ---------------------------------------------------------


def _save_as_other_user(root: str, report: str) -> None:
    acc, *_ = _build(root)
    warm = os.path.join(os.path.dirname(root), "warm-up")
    acc.save_state(warm)  # imports everything saving needs while files are still readable
    shutil.rmtree(warm)
    if os.geteuid() == 0:  # root ignores permissions: drop to nobody, as a user would be
        os.setgid(65534)
        os.setuid(65534)
    try:
        acc.save_state()
        Path(report).write_text("no error")
    except Exception as err:
        Path(report).write_text(f"{type(err).__name__}: {err}")


def test_read_only_project_directory(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="nbaccel-ro-"))  # reachable by the unprivileged child
    try:
        project = base / "project"
        project.mkdir()
        (project / "notes.txt").write_text("mine")
        report = base / "report"
        base.chmod(0o777)
        project.chmod(0o555)
        child = _fork(_save_as_other_user, str(project), str(report))
        child.join(120)
        assert child.exitcode == 0
        message = report.read_text()
        assert message.startswith("CheckpointError: save_state could not write"), message
        assert str(project) in message and "Permission denied" in message, message
        assert sorted(os.listdir(project)) == ["notes.txt"]
    finally:
        project.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)
