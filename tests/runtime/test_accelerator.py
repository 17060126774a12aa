"""The Accelerator facade: arguments, prepare, accumulation, and 2-process behaviour."""

from __future__ import annotations

import contextlib
import io
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from nbaccel import (
    Accelerator,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradScalerKwargs,
    InitProcessGroupKwargs,
)
from nbaccel.errors import ConfigError
from nbaccel.launch.testing import run_on_workers
from nbaccel.runtime.process.state import reset_state


@pytest.fixture(autouse=True)
def _hermetic(tmp_path, monkeypatch):
    """No user config file, no inherited launch variables, a fresh state cache."""
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "absent.yaml"))
    for name in (
        "NBACCEL_MIXED_PRECISION",
        "NBACCEL_GRADIENT_ACCUMULATION_STEPS",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    reset_state()
    yield
    reset_state()


class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.linear(x)


# ---------------------------------------------------------------- arguments


def test_unknown_keyword_is_a_type_error_listing_valid_keywords():
    with pytest.raises(TypeError) as info:
        Accelerator(mixed_precison="bf16")
    message = str(info.value)
    assert "unexpected keyword argument 'mixed_precison'" in message
    for valid in ("mixed_precision", "gradient_accumulation_steps", "dataloader_config", "cpu"):
        assert valid in message


def test_peer_plugins_are_accepted_only_as_none():
    Accelerator(fsdp_plugin=None, dynamo_backend=None, deepspeed_plugin=None)
    with pytest.raises(ConfigError, match="fsdp_plugin"):
        Accelerator(fsdp_plugin=object())
    # the error names what to use instead
    with pytest.raises(ConfigError, match=r"must be a nbaccel\.DeepSpeedPlugin"):
        Accelerator(deepspeed_plugin=object())
    with pytest.raises(ConfigError, match=r"megatron_lm_plugin.*FSDP2.*DDP"):
        Accelerator(megatron_lm_plugin=object())


@pytest.mark.parametrize("steps", [0, -1, True, "2", 1.5])
def test_gradient_accumulation_steps_must_be_a_positive_int(steps):
    with pytest.raises(ConfigError, match=f"gradient_accumulation_steps={steps!r}"):
        Accelerator(gradient_accumulation_steps=steps)


def test_mixed_precision_is_validated():
    with pytest.raises(ConfigError, match="mixed_precision='fp64'"):
        Accelerator(mixed_precision="fp64")
    assert Accelerator(mixed_precision="BF16").mixed_precision == "bf16"
    assert Accelerator(mixed_precision="fp32").mixed_precision == "no"


def test_dataloader_config_and_plain_keywords():
    config = DataLoaderConfiguration(split_batches=True, even_batches=False)
    acc = Accelerator(dataloader_config=config)
    assert acc.split_batches and not acc.even_batches
    assert Accelerator(dataloader_config=config, split_batches=True).split_batches
    with pytest.raises(ConfigError, match="even_batches=True conflicts with dataloader_config"):
        Accelerator(dataloader_config=config, even_batches=True)
    assert Accelerator(split_batches=True).split_batches and Accelerator().even_batches


def test_kwargs_handlers_and_rng_types_are_checked():
    acc = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    assert acc.ddp_kwargs == {"find_unused_parameters": True}
    with pytest.raises(TypeError, match="kwargs_handlers got"):
        Accelerator(kwargs_handlers=[{"find_unused_parameters": True}])
    with pytest.raises(ConfigError, match="two GradScalerKwargs"):
        Accelerator(kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs()])
    with pytest.raises(ValueError, match="rng_types has unknown entries"):
        Accelerator(rng_types=["torch", "jax"])


def test_precision_and_accumulation_defaults_come_from_env_then_config_file(tmp_path, monkeypatch):
    from nbaccel.config import LaunchConfig, save_config

    path = save_config(
        LaunchConfig(mixed_precision="bf16", gradient_accumulation_steps=4), tmp_path / "c.yaml"
    )
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(path))
    acc = Accelerator()
    assert (acc.mixed_precision, acc.gradient_accumulation_steps) == ("bf16", 4)
    monkeypatch.setenv("NBACCEL_MIXED_PRECISION", "fp16")
    monkeypatch.setenv("NBACCEL_GRADIENT_ACCUMULATION_STEPS", "3")
    acc = Accelerator()
    assert (acc.mixed_precision, acc.gradient_accumulation_steps) == ("fp16", 3)
    acc = Accelerator(mixed_precision="no", gradient_accumulation_steps=1)  # explicit wins
    assert (acc.mixed_precision, acc.gradient_accumulation_steps) == ("no", 1)


def test_prepare_passes_other_objects_through_and_keeps_order():
    acc = Accelerator()
    custom = {"not": "preparable"}
    out = acc.prepare(custom, None, 3, "text")
    assert out[0] is custom and out[1:] == (None, 3, "text")
    model = MyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=2)
    prepared = acc.prepare(loader, scheduler, optimizer, model)
    assert [type(p).__name__ for p in prepared] == [
        "PreparedDataLoader",
        "PreparedScheduler",
        "PreparedOptimizer",
        "MyModel",
    ]
    assert prepared[1].optimizers == [prepared[2]]
    assert acc.prepare(model) is prepared[3] and acc.prepare(prepared[2]) is prepared[2]
    assert acc._models == [model] and len(acc._dataloaders) == 1
    acc.free_memory()
    assert acc._models == [] and acc._optimizers == [] and acc._dataloaders == []


def test_register_for_checkpointing_needs_state_dict_methods():
    acc = Accelerator()

    class Counter:
        def state_dict(self):
            return {}

    with pytest.raises(TypeError, match="argument 0 \\(Counter\\) lacks load_state_dict"):
        acc.register_for_checkpointing(Counter())
    good = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), lambda _: 1.0
    )
    acc.register_for_checkpointing(good)
    assert acc._custom_objects == [good]


def test_single_process_facts_and_helpers(capsys):
    acc = Accelerator(cpu=True)
    assert acc.distributed_type is DistributedType.NO and acc.num_processes == 1
    assert acc.device == torch.device("cpu") and not acc.use_distributed
    assert acc.is_main_process and acc.is_local_main_process and acc.is_last_process
    assert (acc.process_index, acc.local_process_index) == (0, 0)
    acc.print("hello")
    assert capsys.readouterr().out == "hello\n"
    assert acc.on_main_process(lambda: 1)() == 1
    assert acc.on_process(process_index=1)(lambda: 1)() is None
    with acc.split_between_processes([1, 2, 3]) as share:
        assert share == [1, 2, 3]
    with acc.main_process_first():
        acc.wait_for_everyone()
    assert "Accelerator(distributed_type=NO" in repr(acc)


def test_second_accelerator_in_one_process_may_change_precision():
    first = Accelerator()
    second = Accelerator(mixed_precision="bf16")
    assert second.state.process_state is first.state.process_state
    assert second.mixed_precision == second.state.mixed_precision == "bf16"
    model = second.prepare(MyModel())
    assert model(torch.ones(2, 3)).dtype == torch.float32  # autocast inside, fp32 out
    assert second.unwrap_model(model, keep_fp32_wrapper=False).forward.__func__ is MyModel.forward


def test_gradient_accumulation_in_one_process():
    torch.manual_seed(0)
    acc = Accelerator(gradient_accumulation_steps=2)
    model = MyModel()
    reference = MyModel()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=2)  # 3 batches: sync at 2 and at 3 (last)
    model, optimizer, scheduler, loader = acc.prepare(model, optimizer, scheduler, loader)
    syncs, lrs = [], []
    for xb, yb in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
            syncs.append(acc.sync_gradients)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
    assert syncs == [False, True, True] and lrs == [0.1, 0.05, 0.025] and acc.step == 2
    # the first update used the mean gradient of batches 0 and 1, as one batch of 4 would
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(reference(x[:4]), y[:4]).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    ref_opt.param_groups[0]["lr"] = 0.05
    (torch.nn.functional.mse_loss(reference(x[4:]), y[4:]) / 2).backward()
    ref_opt.step()
    assert torch.allclose(model.linear.weight, reference.linear.weight, atol=1e-6)


def test_clipping_unscales_and_returns_the_norm():
    acc = Accelerator(
        mixed_precision="fp16", cpu=True, kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)]
    )
    model = MyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    with acc.autocast():
        assert torch.is_autocast_enabled("cpu")
    with acc.no_sync(model):  # one process: nothing to skip, still a context
        acc.backward(model(torch.ones(4, 3)).sum())
    scale = acc.precision.scaler.get_scale()
    raw = torch.cat([p.grad.flatten() for p in model.parameters()]).norm() / scale
    norm = acc.clip_grad_norm_(model.parameters(), max_norm=0.5)
    assert torch.isclose(norm, raw, rtol=1e-3)  # the unscaled norm
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert clipped <= 0.5 + 1e-4
    acc.clip_grad_value_(model.parameters(), 0.01)
    assert all(p.grad.abs().max() <= 0.01 for p in model.parameters())
    optimizer.step()
    scheduler.step()
    assert not acc.optimizer_step_was_skipped and acc.step == 1
    assert scheduler.get_last_lr() == [0.05]
    acc.backward(model(torch.ones(4, 3)).sum())
    model.linear.weight.grad[0, 0] = float("inf")
    optimizer.step()
    scheduler.step()  # not after a skipped step
    assert acc.optimizer_step_was_skipped and acc.step == 1
    assert scheduler.get_last_lr() == [0.05]


# ---------------------------------------------------------------- 2 real processes


def _runtime_checks(log_path):
    acc = Accelerator()
    rank = acc.process_index
    out: dict = {
        "facts": (
            acc.distributed_type.value,
            acc.num_processes,
            acc.is_main_process,
            acc.is_last_process,
            acc.use_distributed,
            str(acc.device),
        )
    }
    # the seed tutorial's unwrap_model example
    model = acc.prepare(MyModel())
    out["names"] = (type(model).__name__, type(acc.unwrap_model(model)).__name__)

    # main_process_first: rank 0 finishes its block before rank 1 enters
    with acc.main_process_first():
        with open(log_path, "a") as log:
            log.write(f"enter {rank}\n")
        if rank == 0:
            time.sleep(0.3)
        with open(log_path, "a") as log:
            log.write(f"exit {rank}\n")
    acc.wait_for_everyone()

    # print once: capture this process's stdout
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        acc.print("only once")
    out["printed"] = buffer.getvalue()

    # split_between_processes with uneven sizes
    shares = {}
    with acc.split_between_processes(list("abcde")) as part:
        shares["list"] = part
    with acc.split_between_processes({"a": [1, 2, 3], "b": torch.arange(3)}) as part:
        shares["dict"] = (part["a"], part["b"].tolist())
    with acc.split_between_processes(torch.arange(5)) as part:
        shares["tensor"] = part.tolist()
    with acc.split_between_processes(torch.arange(5), apply_padding=True) as part:
        shares["padded"] = acc.gather(part).tolist()
    out["shares"] = shares

    # decorators
    out["decorated"] = (
        acc.on_main_process(lambda: "main")(),
        acc.on_last_process(lambda: "last")(),
        acc.on_process(process_index=1)(lambda: "one")(),
        acc.on_local_main_process(lambda: "local")(),
    )

    # a second Accelerator shares the group; a conflicting backend is refused
    second = Accelerator(mixed_precision="bf16")
    out["shared"] = second.state.process_state is acc.state.process_state
    try:
        Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="nccl")])
    except ConfigError as err:
        out["conflict"] = str(err)

    # accumulation: no all-reduce on the non-sync micro-step, averaged grads on the sync one
    torch.manual_seed(0)
    acc2 = Accelerator(gradient_accumulation_steps=2)
    net = MyModel()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    net, opt, sched = acc2.prepare(net, opt, sched)
    grads = []
    for micro in range(2):
        with acc2.accumulate(net):
            x = torch.full((2, 3), float(rank + 1 + micro))
            acc2.backward(net(x).sum())
            grads.append(acc2.gather(net.module.linear.weight.grad.clone()).tolist())
            opt.step()
            sched.step()
            opt.zero_grad()
    out["grads"] = grads
    out["lr"] = sched.get_last_lr()[0]  # stepped twice for 2 processes: 0.1 * 0.5**2
    out["step"] = acc2.step
    out["reduce"] = acc.reduce(torch.tensor([float(rank)]), reduction="mean").tolist()
    out["broadcast"] = acc.broadcast(torch.tensor([float(rank)]), from_process=1).tolist()
    return out


def test_accelerator_on_two_processes(tmp_path):
    log_path = tmp_path / "order.log"
    results = run_on_workers(_runtime_checks, num_processes=2, args=(str(log_path),))
    r0, r1 = results
    assert r0["facts"] == ("MULTI_CPU", 2, True, False, True, "cpu")
    assert r1["facts"] == ("MULTI_CPU", 2, False, True, True, "cpu")
    for out in results:
        assert out["names"] == ("DistributedDataParallel", "MyModel")
        assert out["shared"] and "conflicts with the running process group" in out["conflict"]
        assert out["shares"]["padded"] == [0, 1, 2, 3, 4, 4]
        assert out["reduce"] == [0.5] and out["broadcast"] == [1.0]
        assert out["lr"] == pytest.approx(0.025) and out["step"] == 1
    lines = log_path.read_text().split()
    assert log_path.read_text().splitlines()[:2] == ["enter 0", "exit 0"] and len(lines) == 8
    assert (r0["printed"], r1["printed"]) == ("only once\n", "")
    assert r0["shares"]["list"] == list("abc") and r0["shares"]["tensor"] == [0, 1, 2]
    assert r0["shares"]["dict"] == ([1, 2], [0, 1])
    assert r1["shares"]["list"] == list("de") and r1["shares"]["tensor"] == [3, 4]
    assert r1["shares"]["dict"] == ([3], [2])
    assert r0["decorated"] == ("main", None, None, "local")
    assert r1["decorated"] == (None, "last", "one", None)
    # micro-step 0: local gradients differ across ranks; micro-step 1: synchronised
    first, second = r0["grads"]
    assert first[0] != first[1]
    assert second[0] == second[1]
    assert r0["grads"] == r1["grads"]
