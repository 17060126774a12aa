# ruff: noqa: F821  (a notebook cell: names come from earlier cells)
# Scenario 10 (issue 36): a ZeRO-2 step three ways, the same model, data and optimizer as the
# fsdp scenario (MLP 1024 -> 8 x (1024x1024) -> 10, 8.4M parameters, AdamW, batch 32 per
# process, 2 processes, 40 measured steps after 5 warm-up steps):
#   "fsdp2"     nbaccel, LaunchConfig(strategy="fsdp", fsdp_reshard_after_forward=False):
#               FSDP2 keeping gathered parameters until backward (ZeRO-2's sharding);
#   "nbaccel"   nbaccel, LaunchConfig(strategy="deepspeed", deepspeed_zero_stage=2):
#               DeepSpeed's engine behind the plain Accelerator() of the same function;
#   "deepspeed" DeepSpeed driven by hand in the launched function: deepspeed.initialize,
#               engine(x), engine.backward(loss), engine.step() (what nbaccel wraps).
# Gradient clipping is off in both DeepSpeed runs (DeepSpeed's default would clip at 1.0
# and add a norm all-reduce that FSDP2 does not do). Every rank records the median of its
# step times and its peak RSS above the function's entry (as the fsdp scenario).

ZERO2_CONFIG = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0}


def zero2_model():
    import torch.nn as nn

    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(FSDP_WIDTH, FSDP_WIDTH), nn.ReLU()) for _ in range(FSDP_LAYERS)
    ]
    return nn.Sequential(*blocks, nn.Linear(FSDP_WIDTH, 10))


def zero2_train(out_dir, variant):
    import torch.distributed as dist
    import torch.nn.functional as F

    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak-RSS counter starts here
    start_kib = fsdp_status_kib("VmRSS")
    model = zero2_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if variant == "deepspeed":  # by hand: the group from the launcher's environment
        import deepspeed
        import deepspeed.ops

        if not USE_GPU:  # the same gloo collectives as nbaccel (no shm kernel C++ build)
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        dist.init_process_group("nccl" if USE_GPU else "gloo")
        rank = dist.get_rank()
        config = {**ZERO2_CONFIG, "train_micro_batch_size_per_gpu": FSDP_BATCH}
        config["train_batch_size"] = FSDP_BATCH * dist.get_world_size()
        config["zero_allow_untested_optimizer"] = True
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

        def step(x, y):
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss

        barrier = dist.barrier
    else:
        from nbaccel import Accelerator

        acc = Accelerator()  # FSDP2 or DeepSpeed: decided by the launch configuration only
        rank = acc.process_index
        if variant == "nbaccel":  # no dataloader here: the micro-batch size said in the plugin
            acc.strategy.config.update(ZERO2_CONFIG, train_micro_batch_size_per_gpu=FSDP_BATCH)
        model, optimizer = acc.prepare(model, optimizer)

        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return loss

        barrier = acc.wait_for_everyone
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(FSDP_BATCH, FSDP_WIDTH, generator=gen)
    y = torch.randint(0, 10, (FSDP_BATCH,), generator=gen)
    if USE_GPU:
        x, y = x.cuda(), y.cuda()
    barrier()
    durations = []
    for i in range(FSDP_WARMUP + FSDP_STEPS):
        t0 = time.perf_counter()
        loss = step(x, y)
        if i >= FSDP_WARMUP:
            durations.append(time.perf_counter() - t0)
    barrier()
    bench_put(
        out_dir,
        median_step_s=bench_median(durations),
        peak_rss_mb=(fsdp_status_kib("VmHWM") - start_kib) / 1024,
        final_loss=float(loss.detach()),
    )


def bench_zero2_once(variant):
    """Both ranks' step time and peak RSS for one run: "fsdp2", "nbaccel" or "deepspeed"."""
    from nbaccel import LaunchConfig, notebook_launcher

    strategy = {"fsdp2": "fsdp", "nbaccel": "deepspeed", "deepspeed": "ddp"}[variant]
    config = LaunchConfig(
        strategy=strategy,
        num_processes=NPROCS,
        compute_device="gpu" if USE_GPU else "cpu",
        fsdp_auto_wrap_policy="size_based_wrap",
        fsdp_min_num_params=FSDP_WIDTH * FSDP_WIDTH,  # every block is its own unit
        fsdp_reshard_after_forward=False,  # ZeRO-2: parameters stay gathered until backward
        deepspeed_zero_stage=2,
    )
    with bench_outdir() as out:
        notebook_launcher(zero2_train, args=(out, variant), config=config)
        ranks = bench_take(out)
    return {
        "median_step_s": max(r["median_step_s"] for r in ranks.values()),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks.values()),
        "final_loss": ranks[0]["final_loss"],
        "per_rank": ranks,
    }
