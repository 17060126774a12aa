# ruff: noqa: F821  (a notebook cell: names come from earlier cells)
# Scenario 6: checkpointing a ~100M-parameter model (6 x Linear(4096, 4096))
# with its AdamW state (after one step), on 2 processes.
#   raw        rank 0: torch.save(model.state_dict()) and torch.save(optimizer.state_dict())
#              into two files, then a barrier; load: every rank torch.load + load_state_dict
#   raw+fsync  the same, each file fsynced (what an atomic checkpoint must pay; reference)
#   nbaccel    Accelerator.save_state(dir) / load_state(dir)
#   accelerate Accelerator.save_state(dir) / load_state(dir)
#   fabric     Fabric.save(path, state) / Fabric.load(path, state)
# Times are rank 0's wall time between barriers; bytes = everything written.
# Files go to CKPT_ROOT (default: the system temp dir; set NBACCEL_BENCH_CKPT_DIR).
CKPT_LAYERS, CKPT_WIDTH = 6, 4096
CKPT_ROOT = os.environ.get("NBACCEL_BENCH_CKPT_DIR") or tempfile.gettempdir()


def ckpt_model():
    torch.manual_seed(0)
    layers = [nn.Linear(CKPT_WIDTH, CKPT_WIDTH) for _ in range(CKPT_LAYERS)]
    return nn.Sequential(*layers)


def ckpt_step(model, optimizer, device, no_sync):
    # One AdamW step so that the optimizer has its state. Under no_sync: a 400 MB
    # gradient all-reduce would take longer than everything measured here.
    x = torch.randn(8, CKPT_WIDTH, device=device)
    with no_sync:
        model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def ckpt_bytes(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def ckpt_report(out_dir, path, save_s, load_s, params):
    bench_put(out_dir, save_s=save_s, load_s=load_s, bytes=ckpt_bytes(path), params=params)


def ckpt_timed(fn, barrier):
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


def ckpt_raw(out_dir, path, fsync):
    torch.set_num_threads(THREADS)
    rank = dist.get_rank()
    device = bench_device(rank)
    model = torch.nn.parallel.DistributedDataParallel(
        ckpt_model().to(device), device_ids=[rank] if USE_GPU else None
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ckpt_step(model, optimizer, device, model.no_sync())
    files = {
        "model": os.path.join(path, "model.pt"),
        "optimizer": os.path.join(path, "optimizer.pt"),
    }

    def save():
        if rank != 0:
            return
        os.makedirs(path, exist_ok=True)
        for name, obj in (("model", model.module), ("optimizer", optimizer)):
            with open(files[name], "wb") as fh:
                torch.save(obj.state_dict(), fh)
                if fsync:
                    fh.flush()
                    os.fsync(fh.fileno())

    def load():
        model.module.load_state_dict(torch.load(files["model"], map_location=device))
        optimizer.load_state_dict(torch.load(files["optimizer"], map_location=device))

    save_s = ckpt_timed(save, dist.barrier)
    load_s = ckpt_timed(load, dist.barrier)
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        ckpt_report(out_dir, path, save_s, load_s, params)
    dist.barrier()


def ckpt_nbaccel(out_dir, path, fsync):
    from nbaccel import Accelerator

    acc = Accelerator()
    model = ckpt_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)
    ckpt_step(model, optimizer, acc.device, acc.no_sync(model))
    save_s = ckpt_timed(lambda: acc.save_state(path), acc.wait_for_everyone)
    load_s = ckpt_timed(lambda: acc.load_state(path), acc.wait_for_everyone)
    params = sum(p.numel() for p in model.parameters())
    if acc.is_main_process:
        ckpt_report(out_dir, path, save_s, load_s, params)
    acc.wait_for_everyone()


def ckpt_accelerate(out_dir, path, fsync):
    from accelerate import Accelerator

    torch.set_num_threads(THREADS)
    acc = Accelerator(cpu=not USE_GPU)
    model = ckpt_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)
    ckpt_step(model, optimizer, acc.device, acc.no_sync(model))
    save_s = ckpt_timed(lambda: acc.save_state(path), acc.wait_for_everyone)
    load_s = ckpt_timed(lambda: acc.load_state(path), acc.wait_for_everyone)
    params = sum(p.numel() for p in model.parameters())
    if acc.is_main_process:
        ckpt_report(out_dir, path, save_s, load_s, params)
    acc.wait_for_everyone()


def ckpt_fabric(fabric, out_dir, path, fsync):
    torch.set_num_threads(THREADS)
    model = ckpt_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    ckpt_step(model, optimizer, fabric.device, fabric.no_backward_sync(model))
    state = {"model": model, "optimizer": optimizer}
    save_s = ckpt_timed(lambda: fabric.save(path, state), fabric.barrier)
    load_s = ckpt_timed(lambda: fabric.load(path, state), fabric.barrier)
    params = sum(p.numel() for p in model.parameters())
    if fabric.global_rank == 0:
        ckpt_report(out_dir, path, save_s, load_s, params)
    fabric.barrier()


def bench_checkpoint_once(system):
    with bench_outdir() as out:
        path = tempfile.mkdtemp(prefix="nbaccel-bench-ckpt-", dir=CKPT_ROOT)
        target = os.path.join(path, "ckpt")
        if system == "fabric":
            target += ".pt"
        try:
            if system in ("raw", "raw+fsync"):
                raw_launch(ckpt_raw, (out, target, system == "raw+fsync"))
            elif system == "nbaccel":
                nbaccel_launch(ckpt_nbaccel, (out, target, True))
            elif system == "accelerate":
                accelerate_launch(ckpt_accelerate, (out, target, False))
            elif system == "fabric":
                fabric_launch(ckpt_fabric, (out, target, False))
            else:
                raise ValueError(system)
        finally:
            shutil.rmtree(path, ignore_errors=True)
        return bench_take(out)[0]
