"""Trackers: real files read back by the tools that own the formats."""

from __future__ import annotations

import csv
import json
import math
import warnings

import pytest
import torch

from nbaccel.errors import ConfigError
from nbaccel.tracking.trackers import (
    CSVTracker,
    GeneralTracker,
    JSONLTracker,
    LoggerType,
    TensorBoardTracker,
    available_trackers,
    find_tracker,
    start_trackers,
)


def test_tensorboard_event_files_parse_and_hold_the_logged_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [tb] = start_trackers("tensorboard", "proj", tmp_path, config={"lr": 0.1, "model": object()})
    assert isinstance(tb, TensorBoardTracker)
    assert type(tb.tracker).__name__ == "SummaryWriter"
    for step in range(3):
        tb.log({"loss": 1.0 / (step + 1), "acc": torch.tensor(0.25 * step)}, step=step)
    tb.log({"note": "hello", "group": {"a": 1.0, "b": 2.0}}, step=3)
    tb.finish()

    acc = EventAccumulator(str(tmp_path / "proj"))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"loss", "acc"} <= set(scalars)
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [e.value for e in acc.Scalars("acc")] == pytest.approx([0.0, 0.25, 0.5])
    assert "note" in " ".join(acc.Tags()["tensors"])  # text summaries are stored as tensors
    # add_scalars writes one sub-run per key; add_hparams one sub-run for the config
    subdirs = {p.name for p in (tmp_path / "proj").iterdir() if p.is_dir()}
    assert {"group_a", "group_b"} <= subdirs


def test_tensorboard_writes_accelerates_hparams_yml(tmp_path):
    pytest.importorskip("tensorboard")
    import yaml

    config = {
        "lr": 0.1,
        "epochs": 3,
        "name": "tiny",
        "flag": True,
        "none": None,
        "t": torch.tensor(2),
    }
    [tb] = start_trackers("tensorboard", "proj", tmp_path, config=config)
    tb.finish()
    [path] = (tmp_path / "proj").glob("*/hparams.yml")  # Accelerate: <run>/<time>/hparams.yml
    assert yaml.safe_load(path.read_text()) == {**config, "t": 2}


def test_a_second_tensorboard_run_is_a_separate_run(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = []
    for run in range(2):
        [tb] = start_trackers("tensorboard", "proj", tmp_path)
        for step in range(3):
            tb.log({"loss": float(run)}, step=step)
        tb.finish()
        folders.append(tb.logging_dir)
    assert [f.name for f in folders] == ["proj", "proj-2"]
    for run, folder in enumerate(folders):
        acc = EventAccumulator(str(folder))
        acc.Reload()
        assert [e.value for e in acc.Scalars("loss")] == [float(run)] * 3  # not mixed
    [tb] = start_trackers(
        "tensorboard", "proj", tmp_path, init_kwargs={"tensorboard": {"resume": True}}
    )
    tb.finish()
    assert tb.logging_dir.name == "proj-2"


def test_jsonl_tracker_writes_one_json_object_per_log(tmp_path):
    [t] = start_trackers(["jsonl"], "run", tmp_path, config={"lr": 3e-4, "dims": (2, 3)})
    assert isinstance(t, JSONLTracker)
    t.log({"loss": torch.tensor(2.0), "nested": {"x": 1}}, step=0)
    t.log({"loss": float("nan")}, step=1)
    t.finish()
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["loss"] == 2.0 and rows[0]["nested"] == {"x": 1}
    assert rows[1]["loss"] is None  # NaN is not JSON; stored as null
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {
        "dims": [2, 3],
        "lr": 3e-4,
    }


def test_csv_tracker_long_format_flattens_nested_dicts(tmp_path):
    [t] = start_trackers(LoggerType.CSV, "run", tmp_path)
    assert isinstance(t, CSVTracker)
    t.log({"loss": 0.5, "eval": {"acc": 0.9}}, step=7)
    t.log({"loss": 0.25}, step=8)
    t.finish()
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["key"], float(r["value"])) for r in rows] == [
        ("7", "loss", 0.5),
        ("7", "eval/acc", 0.9),
        ("8", "loss", 0.25),
    ]
    assert all(math.isfinite(float(r["time"])) for r in rows)


@pytest.mark.parametrize("name", ["jsonl", "csv"])
def test_a_second_run_starts_a_new_file_and_keeps_the_first(tmp_path, name):
    """Restart & Run All: the second run's file holds only the second run."""
    for run in range(3):
        [t] = start_trackers(name, "run", tmp_path, config={"run": run})
        for step in range(2):
            t.log({"loss": float(run)}, step=step)
        t.finish()
    folder = tmp_path / "run"
    ext = "jsonl" if name == "jsonl" else "csv"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"metrics.{ext}", f"metrics.1.{ext}", f"metrics.2.{ext}",
         "config.json", "config.1.json", "config.2.json"]
    )  # fmt: skip
    for run, file in enumerate([f"metrics.1.{ext}", f"metrics.2.{ext}", f"metrics.{ext}"]):
        text = (folder / file).read_text()
        if name == "jsonl":
            values = [json.loads(line)["loss"] for line in text.splitlines()]
        else:
            values = [float(r["value"]) for r in csv.DictReader(text.splitlines())]
        assert values == [float(run)] * 2, (file, text)
    assert json.loads((folder / "config.json").read_text()) == {"run": 2}


def test_resume_appends_to_the_last_run(tmp_path):
    [t] = start_trackers("jsonl", "run", tmp_path)
    t.log({"loss": 1.0}, step=0)
    t.finish()
    [t] = start_trackers("jsonl", "run", tmp_path, init_kwargs={"jsonl": {"resume": True}})
    t.log({"loss": 0.5}, step=1)
    t.finish()
    assert t.previous_run is None
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    with pytest.raises(ConfigError, match="resume='yes' must be True"):
        start_trackers("jsonl", "run", tmp_path, init_kwargs={"jsonl": {"resume": "yes"}})


def test_all_starts_every_installed_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    names = available_trackers()
    assert {"jsonl", "csv"} <= set(names)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    trackers = start_trackers("all", "proj", tmp_path / "logs")
    try:
        assert [t.name for t in trackers] == names
    finally:
        for t in trackers:
            t.finish()
        if "wandb" in names:
            import wandb

            wandb.teardown()


def test_user_defined_subclass_instance_and_class(tmp_path):
    class Memory(GeneralTracker):
        name = "memory"

        def __init__(self, run_name="x"):
            self.run_name = run_name
            self.config = None
            self.rows = []

        def store_init_configuration(self, values):
            self.config = dict(values)

        def log(self, values, step=None, **kwargs):
            self.rows.append((step, dict(values), kwargs))

        @property
        def tracker(self):
            return self.rows

    mine = Memory()
    started = start_trackers([mine, "jsonl", "jsonl"], "proj", tmp_path, config={"a": 1})
    assert [t.name for t in started] == ["memory", "jsonl"]  # duplicates dropped
    assert mine.config == {"a": 1}
    mine.log({"v": 1}, step=2, commit=True)
    assert find_tracker(started, "memory") is mine
    assert find_tracker(started, "memory", unwrap=True) == [(2, {"v": 1}, {"commit": True})]
    for t in started:
        t.finish()

    [built] = start_trackers(Memory, "proj-name", None)
    assert isinstance(built, Memory) and built.run_name == "proj-name"


def test_default_methods_of_the_base_class():
    class Minimal(GeneralTracker):
        name = "minimal"

    t = Minimal()
    t.store_init_configuration({"a": 1})
    t.finish()
    assert t.tracker is t
    with pytest.raises(NotImplementedError, match="Minimal must implement log"):
        t.log({"a": 1})


@pytest.mark.parametrize(
    ("log_with", "match"),
    [
        (
            "tensorbord",
            r"log_with='tensorbord' is not a known tracker; use one of all, tensorboard",
        ),
        ([3], r"log_with got 3 \(int\); pass a tracker name"),
    ],
)
def test_bad_log_with_is_a_clear_error(log_with, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        start_trackers(log_with, "proj", tmp_path)


def test_file_tracker_without_logging_dir_names_the_fix():
    with pytest.raises(
        ConfigError, match=r"'jsonl' tracker .* needs a logging directory.*project_dir"
    ):
        start_trackers("jsonl", "proj", None)


def test_unnamed_user_tracker_and_unknown_get_tracker(tmp_path):
    class Nameless(GeneralTracker):
        def log(self, values, step=None, **kwargs):
            pass

    with pytest.raises(ConfigError, match="Nameless has no name"):
        start_trackers(Nameless(), "proj", tmp_path)
    with pytest.raises(
        ConfigError, match=r"no tracker named 'wandb' was started \(started: none\)"
    ):
        find_tracker([], "wandb")


def test_tensorboard_skips_unloggable_values_with_a_warning(tmp_path):
    pytest.importorskip("tensorboard")
    [tb] = start_trackers("tensorboard", "proj", tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tb.log({"weights": torch.ones(3)}, step=0)
    tb.finish()
    assert any("skipped 'weights'" in str(w.message) for w in caught)


@pytest.mark.integration  # under NBACCEL_REQUIRE_ALL a missing wandb fails (CI installs it)
def test_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    [t] = start_trackers(
        "wandb", "proj", tmp_path, config={"lr": 0.1}, init_kwargs={"wandb": {"mode": "offline"}}
    )
    try:
        t.log({"loss": 0.5}, step=0)
        run_dir = t.tracker.dir
        t.finish()
    finally:
        wandb.teardown()  # stop wandb's service process (the leak check would flag it)
    assert str(tmp_path) in run_dir
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


@pytest.mark.integration  # under NBACCEL_REQUIRE_ALL a missing mlflow fails (CI installs it)
def test_mlflow_local_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # used only without SQLAlchemy
    monkeypatch.chdir(tmp_path)
    [t] = start_trackers("mlflow", "proj", tmp_path, config={"lr": 0.1, "name": "x" * 1000})
    try:
        t.log({"loss": 0.5, "eval": {"acc": 0.75}}, step=3)
        run_id = t.tracker.info.run_id
    finally:
        t.finish()
    client = mlflow.tracking.MlflowClient(mlflow.get_tracking_uri())
    assert str(tmp_path) in mlflow.get_tracking_uri()
    run = client.get_run(run_id)
    assert run.data.params["lr"] == "0.1"
    assert len(run.data.params["name"]) == 500
    [point] = client.get_metric_history(run_id, "eval/acc")
    assert (point.step, point.value) == (3, 0.75)


def _log_on_two_ranks(logdir: str) -> dict:
    from nbaccel import Accelerator

    accelerator = Accelerator(log_with=["jsonl", "tensorboard"], project_dir=logdir)
    accelerator.init_trackers("run", config={"lr": 0.1})
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1), "rank": accelerator.process_index}, step=step)
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    bar = accelerator.tqdm(range(2))
    result = {"writer": type(writer).__name__, "bar_disabled": bar.disable}
    bar.close()
    accelerator.end_training()
    return result


@pytest.mark.integration
def test_accelerator_trackers_write_on_the_main_process_only(tmp_path):
    pytest.importorskip("tensorboard")
    from nbaccel.launch.testing import run_on_workers

    results = run_on_workers(_log_on_two_ranks, num_processes=2, args=(str(tmp_path),))
    assert results[0] == {"writer": "SummaryWriter", "bar_disabled": False}
    assert results[1] == {"writer": "NoneType", "bar_disabled": True}  # rank 1: no trackers, no bar
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [(r["step"], r["rank"]) for r in rows] == [(0, 0), (1, 0), (2, 0)]
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 0.1}
