"""Resume in the middle of an epoch, each of the three ways of Accelerate's checkpointing guide.

Written like Accelerate's ``examples/by_feature/checkpointing.py`` (a tiny model on generated
data) and ported by the import only.

``--phase full`` trains ``--num_epochs`` epochs and saves the state after global step
``--save_at``; ``--phase resume`` loads that state and finishes the run, skipping the batches the
first run already trained on in one of three ways (``--pattern``):

* ``continue``: ``for step, batch in enumerate(loader): if step < resume_step: continue``;
* ``skip``: ``accelerator.skip_first_batches(loader, resume_step)``;
* ``stateful``: ``DataLoaderConfiguration(use_stateful_dataloader=True)`` (both phases): the loader
  itself resumes where the checkpoint was written.

Every global step, the sample indices of the batch (gathered from every rank) are recorded; rank
0 writes them, the final weights and the optimizer's momentum to ``--out/<phase>.json``.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator
from nbaccel.utils import DataLoaderConfiguration, set_seed


def make_data(n):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, 1, generator=g)
    return TensorDataset(torch.arange(n), x, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["full", "resume"], required=True)
    parser.add_argument("--pattern", choices=["continue", "skip", "stateful"], required=True)
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--save_at", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    checkpoint = os.path.join(args.out, f"step_{args.save_at}")

    dataloader_config = DataLoaderConfiguration(use_stateful_dataloader=args.pattern == "stateful")
    accelerator = Accelerator(dataloader_config=dataloader_config)
    set_seed(42)
    train_dataloader = DataLoader(make_data(48), batch_size=4, shuffle=True)
    model = torch.nn.Linear(6, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )

    overall_step = 0
    starting_epoch = 0
    resume_step = None
    if args.phase == "resume":
        accelerator.print(f"Resumed from checkpoint: {checkpoint}")
        accelerator.load_state(checkpoint)
        overall_step = args.save_at
        starting_epoch = overall_step // len(train_dataloader)
        resume_step = overall_step - starting_epoch * len(train_dataloader)

    seen = {}
    for epoch in range(starting_epoch, args.num_epochs):
        model.train()
        if args.pattern == "skip" and resume_step and epoch == starting_epoch:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for step, (index, x, y) in enumerate(active_dataloader):
            if args.pattern == "continue" and resume_step is not None and epoch == starting_epoch:  # noqa: SIM102
                if step < resume_step:
                    continue
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            seen[overall_step] = [epoch, accelerator.gather(index).tolist()]
            if args.phase == "full" and overall_step == args.save_at:
                accelerator.save_state(checkpoint)

    if accelerator.is_main_process:
        weights = accelerator.unwrap_model(model).state_dict()
        momentum = [optimizer.state[p]["momentum_buffer"].tolist() for p in model.parameters()]
        result = {
            "steps_per_epoch": len(train_dataloader),
            "seen": seen,
            "weights": {k: v.tolist() for k, v in weights.items()},
            "momentum": momentum,
            "lr": lr_scheduler.get_last_lr()[0],
        }
        with open(os.path.join(args.out, f"{args.phase}.json"), "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
