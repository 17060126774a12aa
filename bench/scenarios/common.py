# Kernel-side helpers shared by every scenario.
#
# bench/run.py executes this file's source as a notebook cell in a real IPython
# kernel (it is not imported), so everything here lives in the kernel's
# ``__main__`` like code a user typed into a notebook. The scenario files that
# follow use these names.
#
# Each "system" is one way of launching the same work on NPROCS processes:
#   raw        hand-written torch.multiprocessing.start_processes + init_process_group
#   nbaccel    nbaccel.notebook_launcher (+ nbaccel.Accelerator inside)
#   accelerate accelerate.notebook_launcher (+ accelerate.Accelerator inside)
#   fabric     lightning.fabric.Fabric(strategy="ddp_notebook").launch
# Worker functions report measurements by writing JSON files (bench_put); the
# kernel reads them back (bench_take). Every system pays that same tiny cost.
import contextlib
import json
import os
import shutil
import socket
import statistics
import tempfile
import time  # noqa: F401  (the scenario cells use it)

import torch
import torch.distributed as dist

NPROCS = 2


def _bench_gpu_count():
    # Count GPUs without initialising CUDA in the kernel (fork must stay possible).
    try:
        from nbaccel.platform.environment import gpu_count

        return gpu_count()
    except Exception:
        return 0


# GPU only when every process gets its own device; otherwise CPU processes over gloo.
USE_GPU = _bench_gpu_count() >= NPROCS
BACKEND = "nccl" if USE_GPU else "gloo"


def bench_device(rank):
    """The device a worker of ``rank`` computes on (same rule for every system)."""
    return torch.device("cuda", rank) if USE_GPU else torch.device("cpu")


def bench_sync():
    if USE_GPU:
        torch.cuda.synchronize()


def bench_free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_put(out_dir, **values):
    """Worker side: write this rank's measurements to ``out_dir/rank{r}.json``."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(values, fh)
    os.replace(path + ".tmp", path)


@contextlib.contextmanager
def bench_outdir():
    path = tempfile.mkdtemp(prefix="nbaccel-bench-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def bench_take(out_dir):
    """Kernel side: {rank: values} written by the workers."""
    found = {}
    for name in os.listdir(out_dir):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as fh:
                found[int(name[4:-5])] = json.load(fh)
    return found


# ---------------------------------------------------------------- the hand-written baseline
def _raw_entry(rank, world_size, port, fn, args):
    # What a user writes by hand: rank env, one process group, the function, clean-up.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    if USE_GPU:
        torch.cuda.set_device(rank)
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def raw_launch(fn, args=(), start_method="fork"):
    torch.multiprocessing.start_processes(
        _raw_entry,
        args=(NPROCS, bench_free_port(), fn, tuple(args)),
        nprocs=NPROCS,
        start_method=start_method,
    )


# ---------------------------------------------------------------- the systems
def nbaccel_launch(fn, args=(), mixed_precision="no", start_method="fork"):
    from nbaccel import notebook_launcher

    return notebook_launcher(
        fn,
        args=tuple(args),
        num_processes=NPROCS,
        mixed_precision=mixed_precision,
        start_method=start_method,
    )


def accelerate_launch(fn, args=(), mixed_precision="no"):
    from accelerate import notebook_launcher

    # A fresh port per launch, as nbaccel picks one (the default 29500 may be in TIME_WAIT).
    return notebook_launcher(
        fn,
        args=tuple(args),
        num_processes=NPROCS,
        mixed_precision=mixed_precision,
        use_port=str(bench_free_port()),
    )


def fabric_launch(fn, args=(), precision="32-true", strategy="ddp_notebook"):
    from lightning.fabric import Fabric

    fabric = Fabric(
        accelerator="cuda" if USE_GPU else "cpu",
        devices=NPROCS,
        strategy=strategy,
        precision=precision,
    )
    return fabric.launch(fn, *args)


def bench_available():
    """Systems importable in this kernel's interpreter."""
    found = ["raw", "nbaccel"]
    for system, module in (("accelerate", "accelerate"), ("fabric", "lightning.fabric")):
        try:
            __import__(module)
        except Exception:
            continue
        found.append(system)
    return found


def bench_quiet_peers():
    # Lightning prints tips/warnings on every launch; they are noise in the cell output.
    import logging
    import warnings

    for name in ("lightning", "lightning.fabric", "lightning_fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", module="lightning_fabric")


def bench_median(values):
    return statistics.median(values) if values else None


def bench_json(obj):
    """What a measurement cell returns: its result as JSON text."""
    return json.dumps(obj)


def bench_versions():
    import platform

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("nbaccel", "accelerate", "lightning"):
        with contextlib.suppress(Exception):
            versions[name] = __import__(name).__version__
    versions["backend"] = BACKEND
    versions["gpus_used"] = NPROCS if USE_GPU else 0
    return versions
