"""Profile a few training steps with ``ProfileKwargs`` and ``accelerator.profile()``.

Written like Accelerate's ``examples/by_feature/profiler.py`` (a tiny model on generated data)
and ported by the import only. Every rank exports a Chrome trace to ``--out/trace``; rank 0
writes the operator table's first lines and the names of the trace files to
``--out/result.json``.
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import Accelerator
from nbaccel.utils import ProfileKwargs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    trace_dir = os.path.join(args.out, "trace")
    profile_kwargs = ProfileKwargs(
        activities=["cpu"], record_shapes=True, output_trace_dir=trace_dir
    )
    accelerator = Accelerator(kwargs_handlers=[profile_kwargs])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    train_dataloader = DataLoader(data, batch_size=4)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    with accelerator.profile() as prof:
        for x, y in train_dataloader:
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=-1)
    if accelerator.is_main_process:
        result = {"table": table, "trace_files": sorted(os.listdir(trace_dir))}
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
