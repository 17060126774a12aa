# ruff: noqa: F821  (a notebook cell: names come from earlier cells)
# Scenario 1: launch latency. Every system runs the same work: form the group
# (creating the Accelerator where the system has one), one all-reduce, a barrier.
# The kernel times the whole launch call (start workers .. workers gone, result back).


def launch_fn_raw():
    t = torch.ones(1, device=bench_device(dist.get_rank()))
    dist.all_reduce(t)
    dist.barrier()


def launch_fn_nbaccel():
    from nbaccel import Accelerator

    acc = Accelerator()
    t = torch.ones(1, device=acc.device)
    dist.all_reduce(t)
    acc.wait_for_everyone()


def launch_fn_accelerate():
    from accelerate import Accelerator

    acc = Accelerator(cpu=not USE_GPU)
    t = torch.ones(1, device=acc.device)
    dist.all_reduce(t)
    acc.wait_for_everyone()


def launch_fn_fabric(fabric):
    t = torch.ones(1, device=fabric.device)
    fabric.all_reduce(t)
    fabric.barrier()


def bench_launch_once(system, start_method="fork"):
    """Seconds for one launch of the all-reduce + barrier function with ``system``."""
    t0 = time.perf_counter()
    if system == "raw":
        raw_launch(launch_fn_raw, start_method=start_method)
    elif system == "nbaccel":
        nbaccel_launch(launch_fn_nbaccel, start_method=start_method)
    elif system == "accelerate":
        accelerate_launch(launch_fn_accelerate)
    elif system == "fabric":
        fabric_launch(launch_fn_fabric)
    else:
        raise ValueError(system)
    return time.perf_counter() - t0


# First launch of a training function (issue 26): a small model, an optimizer, DDP, a few
# steps, launched once in a fresh kernel. Nothing is pre-imported by the bench here: the
# first optimizer and DDP import torch._dynamo wherever the system lets that happen.
def _first_train_steps(model, opt, device):
    x = torch.randn(64, 32, device=device)
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


def first_train_fn_raw():
    torch.set_num_threads(1)  # as the baseline does in every scenario
    device = bench_device(dist.get_rank())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 8).to(device))
    _first_train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), device)


def first_train_fn_nbaccel():
    from nbaccel import Accelerator

    acc = Accelerator()
    model = torch.nn.Linear(32, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    _first_train_steps(model, opt, acc.device)


def bench_first_train_once(system):
    """Seconds for the first launch of the training function in this kernel."""
    t0 = time.perf_counter()
    if system == "raw":
        raw_launch(first_train_fn_raw)
    elif system == "nbaccel":
        nbaccel_launch(first_train_fn_nbaccel)
    else:
        raise ValueError(system)
    return time.perf_counter() - t0
