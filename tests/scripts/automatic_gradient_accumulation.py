"""``find_executable_batch_size`` with automatic gradient accumulation.

Written like Accelerate's ``examples/by_feature/automatic_gradient_accumulation.py`` (a tiny
model on generated data) and ported by the import only. The training step allocates a buffer
that is too big for the machine when the batch is larger than ``--fits``: the allocator's real
out-of-memory error makes the decorator halve the batch size, and the script keeps the observed
batch size by raising ``accelerator.gradient_accumulation_steps``. Rank 0 writes what happened to
``--out/result.json``.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator
from nbaccel.utils import find_executable_batch_size, set_seed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--observed_batch_size", type=int, default=64)
    parser.add_argument("--fits", type=int, default=16)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    accelerator = Accelerator()
    tried = []
    record = {}

    @find_executable_batch_size(starting_batch_size=args.observed_batch_size)
    def inner_training_loop(batch_size):
        nonlocal accelerator
        tried.append(batch_size)
        accelerator.gradient_accumulation_steps = args.observed_batch_size // batch_size
        accelerator.free_memory()
        set_seed(0)
        data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
        train_dataloader = DataLoader(data, batch_size=batch_size)
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
        optimizer_steps = 0
        for x, y in train_dataloader:
            with accelerator.accumulate(model):
                # activations that grow with the batch: past --fits they exceed the machine
                scratch = torch.empty(batch_size * (2**50 if batch_size > args.fits else 1))
                del scratch
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                if accelerator.sync_gradients:
                    optimizer_steps += 1
        record.update(
            batch_size=batch_size,
            gradient_accumulation_steps=accelerator.gradient_accumulation_steps,
            optimizer_steps=optimizer_steps,
            batches=len(train_dataloader),
        )

    inner_training_loop()
    accelerator.end_training()
    if accelerator.is_main_process:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"tried": tried, **record}, f)


if __name__ == "__main__":
    main()
