# ruff: noqa: F821  (a notebook cell: names come from earlier cells)
# Scenario 3: distributed evaluation over 8191 samples (not a multiple of the
# 2 x 64 global batch). Each system runs the same forward pass per batch and
# gathers (prediction, sample index) from every process with its own API:
#   raw        DistributedSampler (pads to 8192 with a duplicate) + dist.all_gather
#   nbaccel    prepared DataLoader + Accelerator.gather_for_metrics
#   accelerate prepared DataLoader + Accelerator.gather_for_metrics
#   fabric     setup_dataloaders (DistributedSampler) + Fabric.all_gather
# Exact = the gathered indices are exactly 0..8190, each once. Time: the sum of
# the gather calls only ("gather_s") and the whole loop ("loop_s"), medians of
# EVAL_REPEATS passes inside one launch.
EVAL_SAMPLES, EVAL_BATCH, EVAL_REPEATS = 8191, 64, 3


def eval_dataset():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(EVAL_SAMPLES, TRAIN_FEATURES, generator=gen)
    return TensorDataset(x, torch.arange(EVAL_SAMPLES))


def eval_summary(out_dir, passes):
    gathered = passes[-1][2]
    bench_put(
        out_dir,
        gather_s=bench_median([p[0] for p in passes]),
        loop_s=bench_median([p[1] for p in passes]),
        count=len(gathered),
        unique=len(set(gathered)),
        exact=sorted(gathered) == list(range(EVAL_SAMPLES)),
    )


def eval_pass(model, batches, gather):
    gather_s, indices = 0.0, []
    t0 = time.perf_counter()
    with torch.no_grad():
        for x, idx in batches:
            pred = model(x).argmax(dim=-1)
            g0 = time.perf_counter()
            _, idx_all = gather(pred, idx)
            gather_s += time.perf_counter() - g0
            indices.extend(idx_all.tolist())
    return gather_s, time.perf_counter() - t0, indices


def gather_raw(out_dir):
    torch.set_num_threads(THREADS)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = bench_device(rank)
    model = train_make_model().to(device).eval()
    dataset = eval_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=EVAL_BATCH, sampler=sampler)

    def gather(pred, idx):
        outs = []
        for t in (pred, idx.to(device)):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t)
            outs.append(torch.cat(parts))
        return outs

    def batches():
        for x, idx in loader:
            yield x.to(device), idx

    passes = [eval_pass(model, batches(), gather) for _ in range(EVAL_REPEATS)]
    eval_summary(out_dir, passes)


def gather_nbaccel(out_dir):
    from nbaccel import Accelerator

    acc = Accelerator()
    model = acc.prepare(train_make_model()).eval()
    loader = acc.prepare(DataLoader(eval_dataset(), batch_size=EVAL_BATCH))
    passes = [
        eval_pass(model, loader, lambda p, i: acc.gather_for_metrics((p, i)))
        for _ in range(EVAL_REPEATS)
    ]
    eval_summary(out_dir, passes)


def gather_accelerate(out_dir):
    from accelerate import Accelerator

    torch.set_num_threads(THREADS)
    acc = Accelerator(cpu=not USE_GPU)
    model = acc.prepare(train_make_model()).eval()
    loader = acc.prepare(DataLoader(eval_dataset(), batch_size=EVAL_BATCH))
    passes = [
        eval_pass(model, loader, lambda p, i: acc.gather_for_metrics((p, i)))
        for _ in range(EVAL_REPEATS)
    ]
    eval_summary(out_dir, passes)


def gather_fabric(fabric, out_dir):
    torch.set_num_threads(THREADS)
    model = fabric.setup(train_make_model()).eval()
    loader = fabric.setup_dataloaders(DataLoader(eval_dataset(), batch_size=EVAL_BATCH))

    def gather(pred, idx):
        pred_all, idx_all = fabric.all_gather((pred, idx))  # (world, batch) each
        return pred_all.reshape(-1), idx_all.reshape(-1)

    passes = [eval_pass(model, loader, gather) for _ in range(EVAL_REPEATS)]
    eval_summary(out_dir, passes)


def bench_gather_once(system):
    with bench_outdir() as out:
        if system == "raw":
            raw_launch(gather_raw, (out,))
        elif system == "nbaccel":
            nbaccel_launch(gather_nbaccel, (out,))
        elif system == "accelerate":
            accelerate_launch(gather_accelerate, (out,))
        elif system == "fabric":
            fabric_launch(gather_fabric, (out,))
        else:
            raise ValueError(system)
        return bench_take(out)[0]
