"""An importable worker for the hand-written spawn reference (bench scenario 5).

torch.multiprocessing's spawn pickles the function by reference, so a
function typed into a notebook cell cannot be spawned by hand; the hand-written
reference therefore imports its worker from this module. This file is a real
module (imported, not executed as a cell).
"""

import os

import torch
import torch.distributed as dist


def raw_spawn_entry(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()


def raw_cuda_entry(rank: int) -> None:
    """The GPU bench's launch function, for a hand-written torch.multiprocessing spawn:
    create the CUDA context, put a tensor on the GPU, synchronise (the CPU without one)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.ones(1, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    float(t.sum())
