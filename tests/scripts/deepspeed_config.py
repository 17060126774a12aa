"""DeepSpeed with a config file, ``DummyOptim`` and ``DummyScheduler``.

Written like Accelerate's ``examples/by_feature/deepspeed_with_config_support.py`` and its
DeepSpeed guide (a tiny MLP on generated data instead of a causal LM) and ported by the
import only: the DeepSpeed JSON file owns the optimizer and the scheduler and says
``"auto"`` where the script knows the value; the script picks ``DummyOptim`` /
``DummyScheduler`` because the config has those sections, trains with accumulation,
evaluates with ``gather_for_metrics``, saves the state, resumes from it, and exports the
consolidated weights (ZeRO-3). Writes what it saw to ``--out/result.json``.
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator, DeepSpeedPlugin
from nbaccel.utils import DummyOptim, DummyScheduler, set_seed


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x @ torch.randn(8, generator=g) > 0).long())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num_epochs", type=int, default=2)
    args = parser.parse_args()

    deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=args.deepspeed_config, zero_stage=3)
    accelerator = Accelerator(deepspeed_plugin=deepspeed_plugin, gradient_accumulation_steps=2)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    train_dataloader = DataLoader(make_data(64, 1), batch_size=4, shuffle=True)
    eval_dataloader = DataLoader(make_data(37, 2), batch_size=5)

    # as in the example: the config's optimizer/scheduler, else torch's
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    optimizer_cls = torch.optim.AdamW if "optimizer" not in config else DummyOptim
    optimizer = optimizer_cls(model.parameters(), lr=0.01)
    updates_per_epoch = math.ceil(len(train_dataloader) / 2 / accelerator.num_processes)
    total = args.num_epochs * updates_per_epoch * accelerator.num_processes
    if "scheduler" not in config:
        lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=total)
    else:
        lr_scheduler = DummyScheduler(optimizer, total_num_steps=total, warmup_num_steps=2)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    def train_epoch():  # the epoch's mean loss: one batch's loss depends on the data order
        model.train()
        losses = []
        for x, y in train_dataloader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        return sum(losses) / len(losses)

    def evaluate():
        model.eval()
        seen = correct = 0
        for x, y in eval_dataloader:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, y))
            seen += len(references)
            correct += (predictions == references).sum().item()
        return seen, correct / seen

    first_loss = train_epoch()
    checkpoint = accelerator.save_state(os.path.join(args.out, "checkpoint"))
    for _ in range(args.num_epochs - 1):
        last_loss = train_epoch()
    accelerator.wait_for_everyone()
    before = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    accelerator.load_state(checkpoint)  # resume: the same epochs again give the same weights
    train_dataloader.set_epoch(1)
    for _ in range(args.num_epochs - 1):
        train_epoch()
    after = accelerator.get_state_dict(model)
    seen, accuracy = evaluate()
    unwrapped_model = accelerator.unwrap_model(model)
    accelerator.save_model(model, os.path.join(args.out, "model"))
    if accelerator.is_main_process:
        result = {
            "distributed_type": str(accelerator.distributed_type),
            "num_processes": accelerator.num_processes,
            "optimizer": type(optimizer.optimizer).__name__,
            "zero_stage": config["zero_optimization"]["stage"],
            "train_batch_size": config["train_batch_size"],
            "total_num_steps": config["scheduler"]["params"]["total_num_steps"],
            "lr": lr_scheduler.get_last_lr()[0],
            "step": accelerator.step,
            "losses": [first_loss, last_loss],
            "eval_seen": seen,
            "accuracy": accuracy,
            "resumed_exactly": all(torch.equal(before[k], after[k]) for k in before),
            "weights": sorted(before),
            "unwrapped": type(unwrapped_model).__name__,
            "checkpoint": sorted(os.listdir(checkpoint)),
            "exported": sorted(os.listdir(os.path.join(args.out, "model"))),
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
