# ruff: noqa: F821  (a notebook cell: names come from earlier cells)
# Scenario 5: start_method="spawn". nbaccel ships a notebook-defined function and
# a notebook-defined model class to fresh interpreters with dill. Measured:
#   launch_s      the launch scenario's function (group + all-reduce + barrier)
#   first_step_s  from the launch call to the end of the first optimizer step
#                 on rank 0 (model class defined in this cell), whole launch in total_s
# References: the same with nbaccel's fork; a hand-written
# torch.multiprocessing spawn of an *importable* function (a notebook function
# cannot be spawned by hand); Fabric's "ddp_spawn" with the notebook function.
import sys as _sys


class SpawnNet(nn.Module):
    """A model class defined in the notebook (shipped by value under spawn)."""

    def __init__(self):
        super().__init__()
        self.body = train_make_model()

    def forward(self, x):
        return self.body(x)


def spawn_first_step(out_dir, t_launch):
    from nbaccel import Accelerator

    acc = Accelerator()
    model = SpawnNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=TRAIN_LR)
    model, optimizer = acc.prepare(model, optimizer)
    x = torch.randn(TRAIN_BATCH, TRAIN_FEATURES, device=acc.device)
    y = torch.randint(0, TRAIN_CLASSES, (TRAIN_BATCH,), device=acc.device)
    t0 = time.time()
    loss = F.cross_entropy(model(x), y)
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    bench_sync()
    t1 = time.time()
    bench_put(out_dir, first_step_s=t1 - t_launch, step_only_s=t1 - t0)


def bench_spawn_once(system):
    """One measurement: {"launch_s", "first_step_s", "step_only_s", "total_s"} or {"error"}."""
    if system in ("nbaccel-spawn", "nbaccel-fork"):
        method = system.split("-")[1]
        launch_s = bench_launch_once("nbaccel", start_method=method)
        with bench_outdir() as out:
            t_launch = time.time()
            nbaccel_launch(spawn_first_step, (out, t_launch), start_method=method)
            total = time.time() - t_launch
            first = bench_take(out)[0]
        return {"launch_s": launch_s, "total_s": total, **first}
    if system == "raw-spawn":
        scenarios = os.path.join(os.getcwd(), "bench", "scenarios")
        if scenarios not in _sys.path:
            _sys.path.insert(0, scenarios)
        from spawn_reference import raw_spawn_entry

        t0 = time.perf_counter()
        torch.multiprocessing.start_processes(
            raw_spawn_entry, args=(NPROCS, bench_free_port()), nprocs=NPROCS, start_method="spawn"
        )
        return {"launch_s": time.perf_counter() - t0}
    if system == "fabric-spawn":
        t0 = time.perf_counter()
        try:
            fabric_launch(launch_fn_fabric, strategy="ddp_spawn")
        except Exception as err:
            last = (str(err).strip().splitlines() or [""])[-1]
            return {"error": f"{type(err).__name__}: {last[:160]}"}
        return {"launch_s": time.perf_counter() - t0}
    raise ValueError(system)
