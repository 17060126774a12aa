"""Gradient accumulation with a scheduler, evaluated with ``gather_for_metrics``.

Written like Accelerate's ``examples/by_feature/gradient_accumulation.py`` (a tiny MLP on
generated data instead of BERT on GLUE) and ported by the import only. After the distributed
run, rank 0 trains the same model in plain PyTorch in one process, with the semantics Accelerate
documents (the loss is averaged over the accumulated micro-batches and the processes, a prepared
scheduler steps once per process per optimizer step), and writes both results to ``--out``.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator
from nbaccel.utils import set_seed


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, generator=g) > 0).long()
    return TensorDataset(x, y)


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def lr_lambda(step):
    return 1.0 / (1.0 + 0.1 * step)


def reference(args, num_processes):
    """One process, plain PyTorch: what the distributed run must equal."""
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    global_batch = args.batch_size * num_processes * args.gradient_accumulation_steps
    loader = DataLoader(make_data(64, 1), batch_size=global_batch)
    for _ in range(args.num_epochs):
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            for _ in range(num_processes):
                scheduler.step()
            optimizer.zero_grad()
    logits = model(make_data(37, 2).tensors[0]).detach()
    return model, scheduler.get_last_lr()[0], logits


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(42)
    train_dataloader = DataLoader(make_data(64, 1), batch_size=args.batch_size)
    eval_dataloader = DataLoader(make_data(37, 2), batch_size=5)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    optimizer_steps = 0
    micro_batches = 0
    for _epoch in range(args.num_epochs):
        model.train()
        for x, y in train_dataloader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            micro_batches += 1
            if accelerator.sync_gradients:
                optimizer_steps += 1

    model.eval()
    all_logits, all_labels = [], []
    for x, y in eval_dataloader:
        with torch.no_grad():
            logits = model(x)
        logits, labels = accelerator.gather_for_metrics((logits, y))
        all_logits.append(logits.cpu())
        all_labels.append(labels.cpu())
    logits = torch.cat(all_logits)

    if accelerator.is_main_process:
        ref_model, ref_lr, ref_logits = reference(args, accelerator.num_processes)
        unwrapped = accelerator.unwrap_model(model)
        max_diff = max(
            (a - b).abs().max().item()
            for a, b in zip(
                unwrapped.state_dict().values(), ref_model.state_dict().values(), strict=True
            )
        )
        result = {
            "num_processes": accelerator.num_processes,
            "micro_batches": micro_batches,
            "optimizer_steps": optimizer_steps,
            "lr": lr_scheduler.get_last_lr()[0],
            "reference_lr": ref_lr,
            "max_weight_diff": max_diff,
            "eval_count": len(logits),
            "eval_labels": torch.cat(all_labels).tolist(),
            "max_logit_diff": (logits - ref_logits).abs().max().item(),
            "accelerate_imported": "accelerate" in sys.modules,
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
