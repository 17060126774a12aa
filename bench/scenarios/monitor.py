# ruff: noqa: F821  (a notebook cell: names come from earlier cells)
# Scenario 9 (issue 28): what the live monitor costs the training. Scenario 2's fp32 run
# (MLP 256-512-512-10, batch 64 per process, 2 epochs: 128 steps per rank) through
# nbaccel, launched with block=False and waited for with handle.result() in the same
# cell, in three interleaved variants:
#   off        no Accelerator.log (the step clock still runs: it cannot be turned off);
#   log        accelerator.log({"loss": loss.item(), "step": step}, step=step) every step;
#   log+watch  the same, followed by a RunMonitor in the kernel (widget view, charts
#              redrawn every second, system=True charts), as watch(handle) does.
# Rank 0 records the wall time of every step and its CPU time per step, as scenario 2,
# and the mean and median time of its Accelerator.log calls (the mean includes the
# batches it sends, and any preemption that hit the call on a loaded machine); the kernel records its own CPU time over
# the run (launch, supervision, events, the monitor), per training step.
# bench_monitor_render times one chart redraw: nbaccel's SVG vs a matplotlib figure
# rendered to PNG (Agg), the same 3 metrics x 2 ranks x 1000 points.
import io
import math
import statistics


def monitor_train(out_dir, log_every_step):
    from nbaccel import Accelerator

    default_threads = torch.get_num_threads()
    acc = Accelerator()
    model = train_make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=TRAIN_LR)
    loader = DataLoader(train_make_dataset(), batch_size=TRAIN_BATCH, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    acc.wait_for_everyone()
    ticks, steps, cpu0 = [time.perf_counter()], 0, time.process_time()
    log_s = []
    for _epoch in range(TRAIN_EPOCHS):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if log_every_step:
                t0 = time.perf_counter()
                acc.log({"loss": loss.item(), "step": steps}, step=steps)
                log_s.append(time.perf_counter() - t0)
            ticks.append(time.perf_counter())
            steps += 1
    acc.wait_for_everyone()
    train_report(out_dir, default_threads, ticks, steps, loss, time.process_time() - cpu0)
    if log_s:  # what one Accelerator.log call costs the training loop (mean: batches count)
        with open(os.path.join(out_dir, f"log{acc.process_index}.json"), "w") as fh:
            mean, median = sum(log_s) / len(log_s), statistics.median(log_s)
            json.dump({"log_us": mean * 1e6, "log_median_us": median * 1e6}, fh)


def bench_monitor_once(variant):
    """Rank 0's step times for one run: "off", "log" or "log+watch"."""
    import psutil

    from nbaccel import notebook_launcher
    from nbaccel.monitor import RunMonitor

    kernel = psutil.Process()
    with bench_outdir() as out:
        cpu0 = sum(kernel.cpu_times()[:2])
        handle = notebook_launcher(
            monitor_train, args=(out, variant != "off"), num_processes=NPROCS, block=False
        )
        monitor = RunMonitor(handle, widget=True, system=True) if variant == "log+watch" else None
        handle.result()
        kernel_cpu = sum(kernel.cpu_times()[:2]) - cpu0  # the kernel's side of the run
        charts = 0
        if monitor is not None:
            monitor.detach()
            charts = len(monitor.chart_data())
        ranks = bench_take(out)
        log_path = os.path.join(out, "log0.json")
        logged = {}
        if os.path.exists(log_path):
            with open(log_path) as fh:
                logged = json.load(fh)
    result = dict(ranks[0], **logged)
    result.update(charts=charts, kernel_cpu_per_step_s=kernel_cpu / result["steps"])
    return result


def bench_monitor_render():
    """Milliseconds for one redraw of the same charts: SVG string vs matplotlib PNG."""
    from nbaccel.ui._chart import render_svg

    data = {
        name: {r: [(s, math.sin(s / 50 + r) + k) for s in range(1000)] for r in range(2)}
        for k, name in enumerate(("loss", "accuracy", "step time (s)"))
    }
    svg_ms = []
    for _ in range(10):
        t0 = time.perf_counter()
        render_svg(data)
        svg_ms.append((time.perf_counter() - t0) * 1e3)
    out = {"svg_ms": bench_median(svg_ms), "svg_bytes": len(render_svg(data))}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return out
    mpl_ms = []
    for _ in range(5):
        t0 = time.perf_counter()
        fig, axes = plt.subplots(1, 3, figsize=(9.6, 1.8))
        for ax, (name, ranks) in zip(axes, data.items(), strict=True):
            for rank, points in ranks.items():
                ax.plot([p[0] for p in points], [p[1] for p in points], label=f"rank {rank}")
            ax.set_title(name)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)
        mpl_ms.append((time.perf_counter() - t0) * 1e3)
    out["matplotlib_ms"] = bench_median(mpl_ms)
    return out
