"""Early stopping decided on one rank and honoured by all, with ``set_trigger``/``check_trigger``.

Written like Accelerate's ``examples/by_feature/early_stopping.py`` (a tiny model on generated
data) and ported by the import only. The stopping callback of rank ``--stop_rank`` fires at step
``--stop_step`` (a real callback fires on one rank's local loss, at a step nobody can predict);
every rank must leave the loop at that same step and then evaluate together. Each rank writes
``--out/rank<N>.json``.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator


class EarlyStoppingCallback:
    """Stops when told to (stands for a patience rule on the local loss)."""

    def __init__(self, rank, stop_rank, stop_step):
        self.fire = rank == stop_rank
        self.stop_step = stop_step

    def check_early_stopping(self, step):
        return self.fire and step == self.stop_step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stop_rank", type=int, default=1)
    parser.add_argument("--stop_step", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(80, 4), torch.randn(80, 1))
    train_dataloader = DataLoader(data, batch_size=4)
    eval_dataloader = DataLoader(TensorDataset(torch.randn(9, 4)), batch_size=4)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    callback = EarlyStoppingCallback(accelerator.process_index, args.stop_rank, args.stop_step)

    steps_trained = 0
    stopped_at = None
    for step, (x, y) in enumerate(train_dataloader):
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps_trained += 1
        if callback.check_early_stopping(step):
            accelerator.set_trigger()
        if accelerator.check_trigger():
            stopped_at = step
            break

    model.eval()
    seen = 0
    for (x,) in eval_dataloader:
        with torch.no_grad():
            seen += len(accelerator.gather_for_metrics(model(x)))
    result = {"stopped_at": stopped_at, "steps_trained": steps_trained, "eval_seen": seen}
    with open(os.path.join(args.out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
