"""Same seed, same numbers as Hugging Face Accelerate -- and still an exact resume.

``same_numbers.py`` trains a tiny model with dropout in nine data-loading modes (default,
``num_workers=2``, ``use_seedable_sampler`` with and without an epoch cut short,
``split_batches``, ``dispatch_batches``, the loader's own ``generator``, an iterable dataset
with and without workers) and records every step's
sample ids, loss (``float.hex``) and a digest of torch's global RNG state, and a digest of the
final weights. It runs under Accelerate itself (``torchrun`` over gloo, ``ACCELERATE_USE_CPU``;
one process: plain ``python``) and, with only the import changed, under nbaccel
(``nbaccel launch``; one process: plain ``python``): every rank's record must be equal, bit for
bit. The nbaccel runs also interrupt and resume the run eight ways (mid-epoch with
``skip_first_batches``, the ``continue`` pattern, a stateful loader with the default and the
seedable sampler; at an epoch's last step; after an epoch; with workers; an iterable dataset):
the resumed record must equal the uninterrupted one from the checkpoint on, global RNG digests
included. (These are the resume patterns' guard for ``nbaccel launch``'d scripts:
tests/scripts/test_real_scripts.py resumes across launches with one of them.)

Accelerate is a test-only dependency (setup.cfg's ``test`` extra pins the version compared).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_real_scripts import _kill_tree, port_to_accelerate

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
ACCELERATE = "1.15.0"  # the version whose numbers nbaccel reproduces


def _accelerate_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("accelerate")
    except Exception:
        return None


def _run(engine: str, nproc: int, out: Path) -> None:
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBACCEL_", "ACCELERATE_"))}
    env.update(
        NBACCEL_CONFIG_FILE=str(out / "no-config.yaml"),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    script = HERE / "same_numbers.py"
    args = ["--out", str(out)]
    if engine == "accelerate":
        ported = out / "accelerate_same_numbers.py"
        ported.write_text(port_to_accelerate(script.read_text()))
        script, env["ACCELERATE_USE_CPU"] = ported, "1"
    else:
        args.append("--resume")
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    elif engine == "accelerate":
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), f"--nproc_per_node={nproc}", str(script), *args]
    else:
        cmd = [sys.executable, "-m", "nbaccel", "launch", "--num_processes", str(nproc)]
        cmd += [str(script), *args]
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=out,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        log, _ = proc.communicate()
        pytest.fail(f"{engine} x{nproc} did not end within 300 s:\n{log[-5000:]}")
    assert proc.returncode == 0, f"{engine} x{nproc} exited {proc.returncode}:\n{log[-6000:]}"


@pytest.fixture(scope="module", params=[1, 2], ids=["1-process", "2-processes"])
def runs(request, tmp_path_factory):
    if _accelerate_version() != ACCELERATE:
        pytest.skip(
            f"needs accelerate=={ACCELERATE} (a test-only dependency, found "
            f"{_accelerate_version()}): pip install -e '.[test]'"
        )
    root = tmp_path_factory.mktemp(f"same-numbers-{request.param}")
    for engine in ("accelerate", "nbaccel"):
        _run(engine, request.param, root / engine)
    return request.param, root


def test_every_mode_gives_accelerates_numbers_bit_for_bit(runs):
    nproc, root = runs
    expected = sorted(p.name for p in (root / "accelerate").glob("*-rank*.json"))
    assert len(expected) == 9 * nproc
    for name in expected:
        ours = json.loads((root / "nbaccel" / name).read_text())
        theirs = json.loads((root / "accelerate" / name).read_text())
        assert ours["len"] == theirs["len"], name
        for step, (a, b) in enumerate(zip(ours["trace"], theirs["trace"], strict=True)):
            assert a == b, f"{name}: step {step} differs (nbaccel, accelerate)"
        assert ours["weights"] == theirs["weights"], name


def test_a_resumed_run_continues_exactly_as_the_uninterrupted_one(runs):
    nproc, root = runs
    files = sorted((root / "nbaccel").glob("resume-*-rank*.json"))
    assert len(files) == 8 * nproc
    for path in files:
        record = json.loads(path.read_text())
        full, resumed, at = record["full"]["trace"], record["resumed"]["trace"], record["at"]
        cut = next(
            i
            for i, entry in enumerate(full)
            if (entry[:2] == ["end", 0] if at == "epoch0" else entry[0] == at)
        )
        # the epochs the resumed run does not enter again leave no end-of-epoch record
        after = [e for e in full[cut + 1 :] if not (e[0] == "end" and e[1] < resumed[0][1])]
        assert resumed == after, path.name
        assert record["resumed"]["weights"] == record["full"]["weights"], path.name
