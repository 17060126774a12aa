"""A DDP communication hook chosen through ``DistributedDataParallelKwargs``.

Written like Accelerate's ``examples/by_feature/ddp_comm_hook.py`` (a tiny model on generated
data) and ported by the import only. Rank 0 writes the name of the hook DDP reports, the final
loss, and the largest difference from the same training without a hook (run in this process
after the first) to ``--out/result.json``.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator
from nbaccel.utils import DDPCommunicationHookType, DistributedDataParallelKwargs


def train(accelerator):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 6, generator=g)
    train_dataloader = DataLoader(
        TensorDataset(x, x @ torch.randn(6, 1, generator=g)), batch_size=4
    )
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    for x, y in train_dataloader:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    hook = getattr(model, "_get_ddp_logging_data", dict)().get("comm_hook")
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hook, loss.item(), weights


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp_comm_hook", default="fp16")
    parser.add_argument("--ddp_comm_wrapper", default="no")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    ddp_kwargs = DistributedDataParallelKwargs(
        comm_hook=DDPCommunicationHookType(args.ddp_comm_hook),
        comm_wrapper=DDPCommunicationHookType(args.ddp_comm_wrapper),
    )
    accelerator = Accelerator(kwargs_handlers=[ddp_kwargs])
    hook, loss, weights = train(accelerator)
    _, plain_loss, plain_weights = train(Accelerator())
    if accelerator.is_main_process:
        result = {
            "comm_hook": hook,
            "loss": loss,
            "plain_loss": plain_loss,
            "max_diff_to_plain": (weights - plain_weights).abs().max().item(),
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
