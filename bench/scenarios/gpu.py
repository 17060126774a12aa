# ruff: noqa: F821  (a notebook cell: names come from earlier cells)
# GPU scenarios (bench/gpu.py). Executed as a notebook cell in a kernel that never
# touches CUDA itself, so nbaccel and the hand-written baseline can both fork.
# The driver sets GPU_CFG (sizes, steps, the device type) in an earlier cell.
#
# Step time: one worker on GPU 0 builds the same model (a stack of MLP blocks,
# >= 100M parameters in the full run), runs warm-up steps, then WINDOWS windows of
# STEPS steps each between two torch.cuda.synchronize() calls; a window's time /
# STEPS is one "per-step" sample, the worker reports every window. Systems:
#   raw      plain loop: model.to(device), torch.autocast, AdamW; no process group
#   raw-ddp  the same inside a hand-written 1-rank process group + DDP(device_ids=[0])
#   nbaccel  Accelerator(mixed_precision=...) + prepare + accelerator.backward
# Launch latency with CUDA init: launch call -> function has created its CUDA
# context, put a tensor on the GPU and synchronised -> result back in the kernel.
import importlib.metadata
import json
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing
import torch.nn as nn
import torch.nn.functional as F

from nbaccel.platform import cudafork

ON_GPU = GPU_CFG["device"] == "cuda"


def gpu_device():
    return torch.device("cuda", 0) if ON_GPU else torch.device("cpu")


def gpu_sync():
    if ON_GPU:
        torch.cuda.synchronize()


def gpu_model():
    torch.manual_seed(0)
    d, blocks = GPU_CFG["width"], GPU_CFG["blocks"]
    layers = []
    for _ in range(blocks):
        layers += [nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)]
    return nn.Sequential(*layers)


def gpu_batch(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GPU_CFG["tokens"], GPU_CFG["width"], generator=g)
    return x.to(device), torch.randn(GPU_CFG["tokens"], GPU_CFG["width"], generator=g).to(device)


def _gpu_timed_loop(step):
    for _ in range(GPU_CFG["warmup"]):
        step()
    gpu_sync()
    windows = []
    for _ in range(GPU_CFG["windows"]):
        t0 = time.perf_counter()
        for _ in range(GPU_CFG["steps"]):
            step()
        gpu_sync()
        windows.append((time.perf_counter() - t0) / GPU_CFG["steps"])
    return windows


def _gpu_report(path, windows, model, loss):
    values = {
        "step_s": sorted(windows)[len(windows) // 2],
        "windows_s": windows,
        "params": sum(p.numel() for p in model.parameters()),
        "loss": float(loss.detach()),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if ON_GPU else None,
    }
    with open(path, "w") as fh:
        json.dump(values, fh)


def _gpu_raw_step_fn(model, opt, x, y, precision):
    def step():
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.loss = loss

    return step


def gpu_train_raw(rank, path, precision, ddp):
    device = gpu_device()
    if ON_GPU:
        torch.cuda.set_device(device)
    if ddp:  # what a user writes by hand for one GPU: a 1-rank group and DDP
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_gpu_free_port()))
        kwargs = {"device_id": device} if ON_GPU else {}
        dist.init_process_group("nccl" if ON_GPU else "gloo", rank=0, world_size=1, **kwargs)
    try:
        model = gpu_model().to(device)
        if ddp:
            ids = [0] if ON_GPU else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = gpu_batch(device)
        step = _gpu_raw_step_fn(model, opt, x, y, precision)
        windows = _gpu_timed_loop(step)
        _gpu_report(path, windows, model, step.loss)
    finally:
        if ddp:
            dist.destroy_process_group()


def gpu_train_nbaccel(path, precision):
    from nbaccel import Accelerator

    acc = Accelerator(mixed_precision=precision, cpu=not ON_GPU)
    model = gpu_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    x, y = gpu_batch(acc.device)

    def step():
        loss = F.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.loss = loss

    windows = _gpu_timed_loop(step)
    _gpu_report(path, windows, acc.unwrap_model(model), step.loss)


def _gpu_free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gpu_step_once(system, precision):
    """One launch of one system; the worker's step-time numbers (dict)."""
    from nbaccel import notebook_launcher

    fd, path = tempfile.mkstemp(prefix="nbaccel-gpu-bench-", suffix=".json")
    os.close(fd)
    try:
        if system in ("raw", "raw-ddp"):
            torch.multiprocessing.start_processes(
                gpu_train_raw,
                args=(path, "bf16" if precision == "bf16" else "no", system == "raw-ddp"),
                nprocs=1,
                start_method="fork",
            )
        elif system == "nbaccel":
            notebook_launcher(
                gpu_train_nbaccel,
                args=(path, precision),
                num_processes=1,
                start_method="fork",
                block=False,
            ).result(timeout=600)
        else:
            raise ValueError(system)
        with open(path) as fh:
            return json.load(fh)
    finally:
        os.remove(path)


def gpu_launch_fn_raw(rank):
    t = torch.ones(1, device=gpu_device())
    gpu_sync()
    return float(t.sum())


def gpu_launch_fn_nbaccel():
    from nbaccel import Accelerator

    acc = Accelerator(cpu=not ON_GPU)
    t = torch.ones(1, device=acc.device)
    gpu_sync()
    return float(t.sum())


def gpu_launch_once(system):
    """Seconds for one launch whose function initialises CUDA and syncs (fresh worker)."""
    from nbaccel import notebook_launcher

    t0 = time.perf_counter()
    if system == "raw":
        torch.multiprocessing.start_processes(gpu_launch_fn_raw, nprocs=1, start_method="fork")
    elif system in ("nbaccel", "nbaccel-spawn"):
        method = "spawn" if system == "nbaccel-spawn" else "fork"
        notebook_launcher(
            gpu_launch_fn_nbaccel, num_processes=1, start_method=method, block=False
        ).result(timeout=300)
    else:
        raise ValueError(system)
    return time.perf_counter() - t0


def gpu_train_fp8(path, precision):
    """fp8 vs bf16 where torchao's tables show a gain: a 4096->16384->4096 MLP between a
    small first and last layer (256 wide; they stay bf16 under fp8, as in Accelerate),
    16384 tokens, compiled (fp8 runs slower than bf16 eagerly), AdamW."""
    from nbaccel import Accelerator

    backend = "inductor" if ON_GPU else "no"
    acc = Accelerator(mixed_precision=precision, cpu=not ON_GPU, dynamo_backend=backend)
    torch.manual_seed(0)
    w, h = GPU_CFG["fp8_width"], GPU_CFG["fp8_hidden"]
    e = GPU_CFG["fp8_edge"]
    model = nn.Sequential(
        nn.Linear(e, w),
        nn.GELU(),
        nn.Linear(w, h),
        nn.GELU(),
        nn.Linear(h, w),
        nn.GELU(),
        nn.Linear(w, e),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GPU_CFG["fp8_tokens"], e, generator=g).to(acc.device)

    def step():
        loss = model(x).float().pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.loss = loss

    windows = _gpu_timed_loop(step)
    kinds = sorted({type(m).__name__ for m in acc.unwrap_model(model).modules()})
    _gpu_report(path, windows, acc.unwrap_model(model), step.loss)
    with open(path) as fh:
        values = json.load(fh)
    values["kinds"] = kinds
    with open(path, "w") as fh:
        json.dump(values, fh)


def gpu_fp8_once(precision):
    """One launch of the fp8-vs-bf16 shape (one fresh worker each)."""
    from nbaccel import notebook_launcher

    fd, path = tempfile.mkstemp(prefix="nbaccel-gpu-bench-", suffix=".json")
    os.close(fd)
    try:
        notebook_launcher(
            gpu_train_fp8,
            args=(path, precision),
            num_processes=1,
            start_method="fork",
            block=False,
        ).result(timeout=600)
        with open(path) as fh:
            return json.load(fh)
    finally:
        os.remove(path)


def gpu_spawn_once(system):
    """Seconds for one spawned launch whose function initialises CUDA: nbaccel's spawn of
    the notebook's function vs a hand-written torch.multiprocessing spawn of the same
    function from a module (spawn pickles by reference: a notebook's own cannot be)."""
    from nbaccel import notebook_launcher

    t0 = time.perf_counter()
    if system == "raw-spawn":
        import sys

        if GPU_CFG["scenarios"] not in sys.path:
            sys.path.insert(0, GPU_CFG["scenarios"])
        from spawn_reference import raw_cuda_entry

        torch.multiprocessing.start_processes(raw_cuda_entry, nprocs=1, start_method="spawn")
    elif system == "nbaccel-spawn":
        notebook_launcher(
            gpu_launch_fn_nbaccel, num_processes=1, start_method="spawn", block=False
        ).result(timeout=300)
    else:
        raise ValueError(system)
    return time.perf_counter() - t0


def gpu_pool_fn():
    t = torch.ones(1, device=gpu_device())
    gpu_sync()
    return float(t.sum())


def gpu_pool_call_s(method, calls=10):
    """Median seconds of a warm pool's call (a CUDA tensor, synced) for a pool started with
    ``method``: spawn pays its start once, later calls should cost what fork's do."""
    from nbaccel import start_workers

    pool = start_workers(num_processes=1, start_method=method)
    try:
        pool.call(gpu_pool_fn)  # the first call creates the worker's CUDA context
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            pool.call(gpu_pool_fn)
            times.append(time.perf_counter() - t0)
    finally:
        pool.close()
    return sorted(times)[len(times) // 2]


def gpu_versions():
    import platform

    import nbaccel

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nbaccel": nbaccel.__version__,
        "kernel_cuda_initialized": torch.cuda.is_initialized(),
        # the driver initialised by anyone breaks every forked row (issue 32)
        "kernel_cuda_driver_initialized": cudafork.fork_state().broken,
    }
    try:  # read from the metadata: `import torchao` initialises the CUDA driver
        versions["torchao"] = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        versions["torchao"] = None
    return versions


def gpu_json(obj):
    return json.dumps(obj)
