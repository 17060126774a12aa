"""The examples of the peer's documentation, run with only the import changed.

Quick tour (training + distributed evaluation), gradient accumulation (with clipping),
checkpointing (save_state / load_state / register_for_checkpointing / skip_first_batches),
experiment tracking and the notebook launcher: each runs on 1 and on 2 CPU processes and
the 2-process run gives the 1-process results. The scripts follow the documentation's
code; the only choice made for the comparison is the per-process batch size (the global
batch, 8, is the same on 1 and 2 processes) and a learning-rate schedule that does not
change within these short runs (schedulers advance ``num_processes`` times per step, as in
the peer, so a decaying schedule is not comparable across process counts).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.launch.testing import run_on_workers

pytestmark = pytest.mark.integration

GLOBAL_BATCH = 8


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def _pieces(accelerator_num_processes: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000)
    batch_size = GLOBAL_BATCH // accelerator_num_processes
    train = DataLoader(
        _data(32, 1),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(2),
    )
    valid = DataLoader(_data(13, 3), batch_size=batch_size)
    return model, optimizer, scheduler, train, valid


def _weights(accelerator, model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


# ------------------------------------------------------------------ quick tour


def quick_tour() -> dict:
    from nbaccel import Accelerator

    accelerator = Accelerator()
    device = accelerator.device
    model, optimizer, scheduler, training_dataloader, validation_dataloader = _pieces(
        accelerator.num_processes
    )
    loss_function = torch.nn.CrossEntropyLoss()
    model, optimizer, training_dataloader, scheduler = accelerator.prepare(
        model, optimizer, training_dataloader, scheduler
    )
    for _epoch in range(2):
        for batch in training_dataloader:
            optimizer.zero_grad()
            inputs, targets = batch
            inputs = inputs.to(device)
            targets = targets.to(device)
            outputs = model(inputs)
            loss = loss_function(outputs, targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
    validation_dataloader = accelerator.prepare(validation_dataloader)
    correct, seen = 0, 0
    model.eval()
    for inputs, targets in validation_dataloader:
        with torch.no_grad():
            predictions = model(inputs).argmax(dim=-1)
        all_predictions, all_targets = accelerator.gather_for_metrics((predictions, targets))
        correct += int((all_predictions == all_targets).sum())
        seen += len(all_targets)
    accelerator.wait_for_everyone()
    return {"weights": _weights(accelerator, model), "correct": correct, "seen": seen}


# ------------------------------------------------------------------ gradient accumulation


def gradient_accumulation() -> dict:
    from nbaccel import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, scheduler, training_dataloader, _ = _pieces(accelerator.num_processes)
    loss_function = torch.nn.CrossEntropyLoss()
    model, optimizer, training_dataloader, scheduler = accelerator.prepare(
        model, optimizer, training_dataloader, scheduler
    )
    norms = []
    for batch in training_dataloader:
        with accelerator.accumulate(model):
            inputs, targets = batch
            outputs = model(inputs)
            loss = loss_function(outputs, targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return {"weights": _weights(accelerator, model), "norms": norms, "step": accelerator.step}


# ------------------------------------------------------------------ checkpointing


class EpochCounter:
    def __init__(self) -> None:
        self.epochs = 0

    def state_dict(self) -> dict:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict) -> None:
        self.epochs = state["epochs"]


def checkpointing(project_dir: str) -> dict:
    from nbaccel import Accelerator
    from nbaccel.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True)
    accelerator = Accelerator(project_config=config)
    model, optimizer, scheduler, train_dataloader, _ = _pieces(accelerator.num_processes)
    loss_function = torch.nn.CrossEntropyLoss()
    model, optimizer, train_dataloader, scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, scheduler
    )
    counter = EpochCounter()
    accelerator.register_for_checkpointing(counter)

    def one_epoch(dataloader) -> None:
        for inputs, targets in dataloader:
            optimizer.zero_grad()
            accelerator.backward(loss_function(model(inputs), targets))
            optimizer.step()
            scheduler.step()
        counter.epochs += 1

    one_epoch(train_dataloader)
    accelerator.save_state()  # project_dir/checkpoints/checkpoint_0
    one_epoch(train_dataloader)
    uninterrupted = _weights(accelerator, model)

    accelerator.load_state(os.path.join(project_dir, "checkpoints", "checkpoint_0"))
    restored_epochs = counter.epochs
    # resume in the middle of the second epoch: replay 1 batch by hand, skip it after
    iterator = iter(train_dataloader)
    inputs, targets = next(iterator)
    optimizer.zero_grad()
    accelerator.backward(loss_function(model(inputs), targets))
    optimizer.step()
    accelerator.save_state()  # checkpoint_1, taken mid-epoch
    accelerator.load_state()  # the latest one
    skipped_dataloader = accelerator.skip_first_batches(train_dataloader, num_batches=1)
    one_epoch(skipped_dataloader)
    return {
        "uninterrupted": uninterrupted,
        "resumed": _weights(accelerator, model),
        "restored_epochs": restored_epochs,
        "checkpoints": sorted(os.listdir(os.path.join(project_dir, "checkpoints"))),
    }


# ------------------------------------------------------------------ tracking


def tracking(project_dir: str) -> dict:
    from nbaccel import Accelerator

    accelerator = Accelerator(log_with="all", project_dir=project_dir)
    config = {"num_iterations": 4, "learning_rate": 0.1, "loss_function": "CrossEntropyLoss"}
    accelerator.init_trackers("example_project", config=config)
    model, optimizer, _, train_dataloader, _ = _pieces(accelerator.num_processes)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    loss_function = torch.nn.CrossEntropyLoss()
    for iteration in range(config["num_iterations"]):
        for step, (inputs, targets) in enumerate(train_dataloader):
            optimizer.zero_grad()
            loss = loss_function(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            accelerator.log({"training_loss": loss}, step=iteration * 100 + step)
    accelerator.end_training()
    return {"weights": _weights(accelerator, model), "main": accelerator.is_main_process}


# ------------------------------------------------------------------ the comparisons


def _assert_same_weights(single: dict, double: dict) -> None:
    for name, value in single.items():
        torch.testing.assert_close(double[name], value, msg=name)


def test_quick_tour_on_one_and_two_processes():
    (single,) = run_on_workers(quick_tour, num_processes=1)
    for result in run_on_workers(quick_tour, num_processes=2):
        _assert_same_weights(single["weights"], result["weights"])
        assert result["seen"] == single["seen"] == 13  # every sample exactly once
        assert result["correct"] == single["correct"]


def test_gradient_accumulation_on_one_and_two_processes():
    (single,) = run_on_workers(gradient_accumulation, num_processes=1)
    for result in run_on_workers(gradient_accumulation, num_processes=2):
        _assert_same_weights(single["weights"], result["weights"])
        assert result["step"] == single["step"] == 2
        torch.testing.assert_close(result["norms"], single["norms"])


def test_checkpointing_on_one_and_two_processes(tmp_path):
    (single,) = run_on_workers(checkpointing, 1, args=(str(tmp_path / "one"),))
    _assert_same_weights(single["uninterrupted"], single["resumed"])
    assert single["restored_epochs"] == 1
    assert single["checkpoints"] == ["checkpoint_0", "checkpoint_1"]
    for result in run_on_workers(checkpointing, 2, args=(str(tmp_path / "two"),)):
        _assert_same_weights(single["uninterrupted"], result["uninterrupted"])
        _assert_same_weights(single["resumed"], result["resumed"])
        assert result["restored_epochs"] == 1 and result["checkpoints"] == single["checkpoints"]


def _logged_losses(project_dir) -> list:
    found = []
    for root, _dirs, files in os.walk(project_dir):
        for name in files:
            if name == "metrics.jsonl":
                with open(os.path.join(root, name)) as fh:
                    found += [json.loads(line) for line in fh if line.strip()]
    return found


def test_tracking_on_one_and_two_processes(tmp_path):
    # "all" starts every installed tracker; keep the online ones off the network
    env = {
        "WANDB_MODE": "disabled",
        "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    (single,) = run_on_workers(tracking, 1, args=(one,), env=env)
    double = run_on_workers(tracking, 2, args=(two,), env=env)
    for result in double:
        _assert_same_weights(single["weights"], result["weights"])
    one, two = _logged_losses(tmp_path / "one"), _logged_losses(tmp_path / "two")
    assert len(one) == len(two) == 16  # the main process logged, once per step
    # the same steps; the values are the main process's own loss (its half of each batch)
    assert [a["step"] for a in one] == [b["step"] for b in two]
    assert all(0 < b["training_loss"] < 10 for b in two)


def training_loop(mixed_precision: str = "no", seed: int = 42, batch_size: int = 8) -> dict:
    from nbaccel import Accelerator
    from nbaccel.utils import set_seed

    set_seed(seed)
    accelerator = Accelerator(mixed_precision=mixed_precision)
    model, optimizer, _, train_dataloader, _ = _pieces(accelerator.num_processes)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    for inputs, targets in train_dataloader:
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.cross_entropy(model(inputs), targets))
        optimizer.step()
    return _weights(accelerator, model)


def test_notebook_launcher_example_on_one_and_two_processes():
    from nbaccel import notebook_launcher
    from nbaccel.runtime.process.state import reset_state

    reset_state()  # an Accelerator made in this process by an earlier test is not launched
    args = ("no", 42, 8)
    single = notebook_launcher(training_loop, args, num_processes=1)
    double = notebook_launcher(training_loop, args, num_processes=2)
    _assert_same_weights(single, double)
