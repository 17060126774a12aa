# ruff: noqa: F821  (a notebook cell: names come from earlier cells)
# Scenario 7 (issue 14): warm workers. One pool of NPROCS workers lives across the
# scenario, as in a notebook; each measurement is interleaved with the same work done
# by a warm notebook_launcher call in the same kernel.
#   * call latency: pool.run of launch_fn_nbaccel (Accelerator, one all-reduce, a
#     barrier) vs bench_launch_once("nbaccel") (the same function, fresh workers);
#   * a small training function run three times: on the pool vs three launches;
#   * worker memory: USS of every worker (read by the kernel with psutil) after 5
#     warm-up calls and after 50 more; the growth is the max over the workers.
import psutil

POOL_STATE = {}


def bench_pool_start():
    from nbaccel import start_workers

    POOL_STATE["pool"] = start_workers(num_processes=NPROCS, start_method="fork")
    POOL_STATE["pool"].run(launch_fn_nbaccel)  # the process group forms here, once


def bench_pool_close():
    pool = POOL_STATE.pop("pool", None)
    if pool is not None:
        pool.close()


def bench_pool_call_once():
    pool = POOL_STATE["pool"]
    t0 = time.perf_counter()
    pool.run(launch_fn_nbaccel)
    return time.perf_counter() - t0


def pool_train_fn(epochs):
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(2048, 64, generator=gen), torch.randint(0, 10, (2048,)))
    loader = DataLoader(data, batch_size=64, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
    return float(loss.detach())


def bench_pool_train3(system):
    """Seconds for three runs of the training function: on the pool, or three launches."""
    t0 = time.perf_counter()
    for _ in range(3):
        if system == "pool":
            POOL_STATE["pool"].run(pool_train_fn, 1)
        else:
            nbaccel_launch(pool_train_fn, (1,))
    return time.perf_counter() - t0


def _pool_uss_mb():
    return [
        psutil.Process(pid).memory_full_info().uss / 2**20
        for pid in POOL_STATE["pool"].pids.values()
    ]


def bench_pool_memory(calls=50):
    pool = POOL_STATE["pool"]
    for _ in range(5):
        pool.run(launch_fn_nbaccel)
    before = _pool_uss_mb()
    for _ in range(calls):
        pool.run(launch_fn_nbaccel)
    after = _pool_uss_mb()
    growth = [b - a for a, b in zip(before, after, strict=True)]
    return {"max_growth_mb": max(growth), "uss_before_mb": max(before), "uss_after_mb": max(after)}
