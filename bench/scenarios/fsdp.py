# ruff: noqa: F821  (a notebook cell: names come from earlier cells)
# Scenario 7: FSDP2 vs DDP, both through nbaccel, the same model and data, 2 processes.
# MLP 1024 -> 8 x (1024x1024) -> 10, 8.4M parameters (34 MB fp32), AdamW (two more
# copies of the parameters as optimizer state), batch 32 per process, 40 steps.
# The strategy is the only difference: notebook_launcher(config=LaunchConfig(strategy=...)),
# the training function is the same and creates a plain Accelerator().
# Every rank records the median wall time of its steps (after 5 warm-up steps) and its
# peak RSS above the RSS at the function's entry (/proc/self/status VmHWM after
# resetting it through /proc/self/clear_refs): model, gradients, optimizer state,
# activations and communication buffers, as the process really holds them.
# "+mmap" variants first call mallopt(M_MMAP_THRESHOLD, 128 KiB) in the worker: glibc's
# default threshold grows after the first large free, after which FSDP's per-step
# all-gather/reduce-scatter buffers come from the heap and their freed pages stay in
# the process (RSS grows for many steps); a fixed threshold returns them at once. Users
# get the same by starting Jupyter with MALLOC_MMAP_THRESHOLD_=131072.
import re

FSDP_WIDTH, FSDP_LAYERS, FSDP_BATCH, FSDP_STEPS, FSDP_WARMUP = 1024, 8, 32, 40, 5


def fsdp_status_kib(field):
    with open("/proc/self/status") as fh:
        return int(re.search(rf"{field}:\s+(\d+)", fh.read()).group(1))


def fsdp_fixed_mmap_threshold():
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD


def fsdp_train(out_dir, fixed_mmap):
    import torch.nn as nn
    import torch.nn.functional as F

    from nbaccel import Accelerator

    if fixed_mmap:
        fsdp_fixed_mmap_threshold()
    acc = Accelerator()  # DDP or FSDP: decided by the launch configuration only
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak-RSS counter starts here
    start_kib = fsdp_status_kib("VmRSS")
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(FSDP_WIDTH, FSDP_WIDTH), nn.ReLU()) for _ in range(FSDP_LAYERS)
    ]
    model = nn.Sequential(*blocks, nn.Linear(FSDP_WIDTH, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    gen = torch.Generator().manual_seed(acc.process_index)
    x = torch.randn(FSDP_BATCH, FSDP_WIDTH, generator=gen)
    y = torch.randint(0, 10, (FSDP_BATCH,), generator=gen)
    acc.wait_for_everyone()
    durations = []
    for step in range(FSDP_WARMUP + FSDP_STEPS):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step >= FSDP_WARMUP:
            durations.append(time.perf_counter() - t0)
    acc.wait_for_everyone()
    local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())
    bench_put(
        out_dir,
        median_step_s=bench_median(durations),
        peak_rss_mb=(fsdp_status_kib("VmHWM") - start_kib) / 1024,
        local_params=local,
        distributed_type=acc.distributed_type.value,
        final_loss=float(loss.detach()),
    )


def bench_fsdp_once(variant):
    """Both ranks' step time and peak RSS for one nbaccel run: "ddp", "fsdp", "ddp+mmap"..."""
    strategy, fixed_mmap = variant.split("+")[0], variant.endswith("+mmap")
    from nbaccel import LaunchConfig, notebook_launcher

    config = LaunchConfig(
        strategy=strategy,
        num_processes=NPROCS,
        compute_device="gpu" if USE_GPU else "cpu",
        fsdp_auto_wrap_policy="size_based_wrap",
        fsdp_min_num_params=FSDP_WIDTH * FSDP_WIDTH,  # every block is its own unit
    )
    with bench_outdir() as out:
        notebook_launcher(fsdp_train, args=(out, fixed_mmap), config=config)
        ranks = bench_take(out)
    return {
        "median_step_s": max(r["median_step_s"] for r in ranks.values()),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks.values()),
        "local_params": max(r["local_params"] for r in ranks.values()),
        "distributed_type": ranks[0]["distributed_type"],
        "per_rank": ranks,
    }
