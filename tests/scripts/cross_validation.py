"""K-fold cross-validation: one Accelerator, a fresh model, optimizer and loaders per fold.

Written like Accelerate's ``examples/by_feature/cross_validation.py`` (a tiny MLP on generated
data) and ported by the import only. Each fold prepares new objects, trains, evaluates its
validation split and predicts the shared test set with ``gather_for_metrics``, then calls
``free_memory()``. Rank 0 trains every fold again in plain PyTorch in one process (the global
batch is the sum of the per-rank batches) and writes both to ``--out/result.json``.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

from nbaccel import Accelerator


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def build_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def fold_indices(n, num_folds, fold):
    valid = list(range(fold, n, num_folds))
    return [i for i in range(n) if i not in valid], valid


def train_reference(train_set, test_set, global_batch, epochs):
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    for _ in range(epochs):
        for x, y in DataLoader(train_set, batch_size=global_batch):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model(test_set.tensors[0]).detach()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_folds", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    accelerator = Accelerator()
    dataset = make_data(48, 0)
    test_set = make_data(23, 1)
    folds = []
    for fold in range(args.num_folds):
        train_idxs, valid_idxs = fold_indices(len(dataset), args.num_folds, fold)
        train_dataloader = DataLoader(Subset(dataset, train_idxs), batch_size=args.batch_size)
        eval_dataloader = DataLoader(Subset(dataset, valid_idxs), batch_size=3)
        test_dataloader = DataLoader(test_set, batch_size=5)
        model = build_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
        model, optimizer, train_dataloader, eval_dataloader, test_dataloader = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, test_dataloader
        )
        for _epoch in range(args.num_epochs):
            model.train()
            for x, y in train_dataloader:
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        model.eval()
        correct, seen = 0, 0
        for x, y in eval_dataloader:
            with torch.no_grad():
                predictions, references = accelerator.gather_for_metrics((model(x).argmax(-1), y))
            correct += (predictions == references).sum().item()
            seen += len(references)
        test_logits = []
        for x, _ in test_dataloader:
            with torch.no_grad():
                test_logits.append(accelerator.gather_for_metrics(model(x)).cpu())
        folds.append(
            {
                "valid_size": len(valid_idxs),
                "valid_seen": seen,
                "accuracy": correct / seen,
                "test_logits": torch.cat(test_logits),
                "train_subset": Subset(dataset, train_idxs),
            }
        )
        accelerator.free_memory()

    if accelerator.is_main_process:
        global_batch = args.batch_size * accelerator.num_processes
        result = {"folds": []}
        for fold in folds:
            ref = train_reference(fold["train_subset"], test_set, global_batch, args.num_epochs)
            result["folds"].append(
                {
                    "valid_size": fold["valid_size"],
                    "valid_seen": fold["valid_seen"],
                    "accuracy": fold["accuracy"],
                    "test_seen": len(fold["test_logits"]),
                    "max_logit_diff": (fold["test_logits"] - ref).abs().max().item(),
                }
            )
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
