# ruff: noqa: F821  (a notebook cell: names come from earlier cells)
# Scenario 2: training throughput. MLP 256-512-512-10 on a synthetic 8192x256
# dataset, batch 64 per process, 2 epochs, SGD. Variants: fp32, bf16 autocast,
# gradient accumulation 4 (a "step" is one micro-batch). Rank 0 records the
# wall time of every iteration (data loading included) between two barriers,
# and the process's CPU time per step (all its threads; less sensitive than wall
# time to other load on the machine, which stalls whichever rank it hits).
#
# Threads: the issue fixes 1 compute thread per process. The hand-written
# baseline and the peers call torch.set_num_threads(THREADS) themselves (without
# it they oversubscribe the cores and the comparison would measure that instead
# of the framework); nbaccel is left to its own default, which must already be
# the per-process share of the cores. Every system reports the thread count it
# had at entry ("default_threads") and during the loop ("threads").
import itertools

import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

TRAIN_SAMPLES, TRAIN_FEATURES, TRAIN_CLASSES = 8192, 256, 10
TRAIN_BATCH, TRAIN_EPOCHS, TRAIN_LR = 64, 2, 0.05
THREADS = 1  # issue 7: 1 compute thread per process


def train_make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(TRAIN_FEATURES, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, TRAIN_CLASSES),
    )


def train_make_dataset():
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(TRAIN_SAMPLES, TRAIN_FEATURES, generator=gen)
    y = torch.randint(0, TRAIN_CLASSES, (TRAIN_SAMPLES,), generator=gen)
    return TensorDataset(x, y)


def train_report(out_dir, default_threads, ticks, steps, loss, cpu_s):
    durations = [b - a for a, b in itertools.pairwise(ticks)]
    bench_put(
        out_dir,
        steps=steps,
        cpu_per_step_s=cpu_s / steps,
        loop_s=ticks[-1] - ticks[0],
        steps_per_s=steps / (ticks[-1] - ticks[0]),
        median_step_s=bench_median(durations),
        default_threads=default_threads,
        threads=torch.get_num_threads(),
        final_loss=float(loss.detach()),
    )


def train_raw(out_dir, precision, accum):
    default_threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = bench_device(rank)
    model = torch.nn.parallel.DistributedDataParallel(
        train_make_model().to(device), device_ids=[rank] if USE_GPU else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=TRAIN_LR)
    dataset = train_make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=TRAIN_BATCH, sampler=sampler)
    autocast_on = precision == "bf16"
    dist.barrier()
    ticks, steps, cpu0 = [time.perf_counter()], 0, time.process_time()
    for epoch in range(TRAIN_EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            sync = (i + 1) % accum == 0 or i + 1 == len(loader)
            with model.no_sync() if not sync else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_on):
                    out = model(x)
                loss = F.cross_entropy(out.float(), y) / accum
                loss.backward()
            if sync:
                optimizer.step()
                optimizer.zero_grad()
            bench_sync()
            ticks.append(time.perf_counter())
            steps += 1
    dist.barrier()
    train_report(out_dir, default_threads, ticks, steps, loss, time.process_time() - cpu0)


def train_nbaccel(out_dir, precision, accum):
    from nbaccel import Accelerator

    default_threads = torch.get_num_threads()  # nbaccel's own default: not overridden
    acc = Accelerator(mixed_precision=precision, gradient_accumulation_steps=accum)
    model = train_make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=TRAIN_LR)
    loader = DataLoader(train_make_dataset(), batch_size=TRAIN_BATCH, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    acc.wait_for_everyone()
    ticks, steps, cpu0 = [time.perf_counter()], 0, time.process_time()
    for _epoch in range(TRAIN_EPOCHS):
        for x, y in loader:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            bench_sync()
            ticks.append(time.perf_counter())
            steps += 1
    acc.wait_for_everyone()
    train_report(out_dir, default_threads, ticks, steps, loss, time.process_time() - cpu0)


def train_accelerate(out_dir, precision, accum):
    from accelerate import Accelerator

    default_threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    acc = Accelerator(cpu=not USE_GPU, mixed_precision=precision, gradient_accumulation_steps=accum)
    model = train_make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=TRAIN_LR)
    loader = DataLoader(train_make_dataset(), batch_size=TRAIN_BATCH, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    acc.wait_for_everyone()
    ticks, steps, cpu0 = [time.perf_counter()], 0, time.process_time()
    for _epoch in range(TRAIN_EPOCHS):
        for x, y in loader:
            with acc.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            bench_sync()
            ticks.append(time.perf_counter())
            steps += 1
    acc.wait_for_everyone()
    train_report(out_dir, default_threads, ticks, steps, loss, time.process_time() - cpu0)


def train_fabric(fabric, out_dir, precision, accum):
    default_threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    model = train_make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=TRAIN_LR)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(
        DataLoader(train_make_dataset(), batch_size=TRAIN_BATCH, shuffle=True)
    )
    fabric.barrier()
    ticks, steps, cpu0 = [time.perf_counter()], 0, time.process_time()
    for _epoch in range(TRAIN_EPOCHS):  # Fabric's loader sets the sampler's epoch itself
        for i, (x, y) in enumerate(loader):
            accumulating = (i + 1) % accum != 0 and i + 1 != len(loader)
            with fabric.no_backward_sync(model, enabled=accumulating):
                loss = F.cross_entropy(model(x), y) / accum
                fabric.backward(loss)
            if not accumulating:
                optimizer.step()
                optimizer.zero_grad()
            bench_sync()
            ticks.append(time.perf_counter())
            steps += 1
    fabric.barrier()
    train_report(out_dir, default_threads, ticks, steps, loss, time.process_time() - cpu0)


def bench_train_once(system, precision="no", accum=1):
    """Rank 0's throughput numbers for one training run with ``system``."""
    with bench_outdir() as out:
        args = (out, precision, accum)
        if system == "raw":
            raw_launch(train_raw, args)
        elif system == "nbaccel":
            nbaccel_launch(train_nbaccel, args, mixed_precision=precision)
        elif system == "accelerate":
            accelerate_launch(train_accelerate, args, mixed_precision=precision)
        elif system == "fabric":
            fabric_launch(
                train_fabric, args, precision="bf16-mixed" if precision == "bf16" else "32-true"
            )
        else:
            raise ValueError(system)
        ranks = bench_take(out)
    result = dict(ranks[0])
    result["threads_all_ranks"] = [ranks[r]["threads"] for r in sorted(ranks)]
    result["default_threads_all_ranks"] = [ranks[r]["default_threads"] for r in sorted(ranks)]
    return result
