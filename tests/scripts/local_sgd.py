"""LocalSGD: train without gradient synchronisation, average the weights every K steps.

Written like Accelerate's ``examples/by_feature/local_sgd.py`` (a tiny model on generated data)
and ported by the import only. After every step the script compares the parameters of the
ranks; rank 0 also simulates the two workers in plain PyTorch (each on its own shard, averaging
every K steps) and writes both to ``--out/result.json``.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator
from nbaccel.local_sgd import LocalSGD


def make_data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 4, generator=g)
    return TensorDataset(x, x @ torch.randn(4, 1, generator=g))


def build_model():
    torch.manual_seed(2)
    return torch.nn.Linear(4, 1)


def reference(num_workers, batch_size, local_sgd_steps):
    """num_workers plain models, each on its shard of every global batch, averaged every K steps."""
    models = [build_model() for _ in range(num_workers)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    batches = list(DataLoader(make_data(), batch_size=batch_size))
    steps = len(batches) // num_workers
    for step in range(steps):
        for w in range(num_workers):
            x, y = batches[step * num_workers + w]
            F.mse_loss(models[w](x), y).backward()
            optimizers[w].step()
            optimizers[w].zero_grad()
        if (step + 1) % local_sgd_steps == 0 or step == steps - 1:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models), strict=True):
                    mean = torch.stack([p for p in params]).mean(0)
                    for p in params:
                        p.copy_(mean)
    return models[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_sgd_steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    accelerator = Accelerator()
    train_dataloader = DataLoader(make_data(), batch_size=4)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)

    in_sync = []
    with LocalSGD(
        accelerator=accelerator, model=model, local_sgd_steps=args.local_sgd_steps, enabled=True
    ) as local_sgd:
        for x, y in train_dataloader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            gathered = accelerator.gather(flat[None])
            in_sync.append(bool(torch.equal(gathered[0], gathered[-1])))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = accelerator.gather(flat[None])

    if accelerator.is_main_process:
        ref = reference(accelerator.num_processes, 4, args.local_sgd_steps)
        ref_flat = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
        result = {
            "in_sync_after_step": in_sync,
            "in_sync_at_exit": bool(torch.equal(gathered[0], gathered[-1])),
            "max_diff_to_reference": (flat - ref_flat).abs().max().item(),
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
