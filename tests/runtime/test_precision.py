"""Precision modes: unit tests of nbaccel.runtime.compute.precision, then Accelerator-level training.

The Accelerator-level tests run real 1- and 2-process gloo groups on CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~3 s): once here, not in every forked worker

from nbaccel.errors import ConfigError
from nbaccel.runtime.compute.precision import FullPrecision, make_precision

CPU = torch.device("cpu")


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("mode", "expected"), [(None, "no"), ("no", "no"), ("fp32", "no"), ("BF16", "bf16")]
)
def test_mode_names(mode, expected):
    assert make_precision(mode, CPU).mode == expected


def test_full_precision_is_plain():
    p = make_precision("no", CPU)
    assert isinstance(p, FullPrecision) and p.scaler is None and p.state_dict() == {}
    model, _ = _tiny()
    assert p.prepare_model(model) is model
    with p.autocast():
        assert model(torch.ones(1, 4)).dtype == torch.float32


def test_bf16_autocast_on_cpu():
    p = make_precision("bf16", CPU)
    model, _ = _tiny()
    with p.autocast():
        assert model(torch.ones(1, 4)).dtype == torch.bfloat16
    assert model(torch.ones(1, 4)).dtype == torch.float32  # only inside the context
    assert p.scaler is None and p.prepare_model(model) is model


def test_autocast_can_be_disabled_by_kwargs():
    p = make_precision("bf16", CPU, autocast_kwargs={"enabled": False, "cache_enabled": None})
    model, _ = _tiny()
    with p.autocast():
        assert model(torch.ones(1, 4)).dtype == torch.float32


@pytest.mark.parametrize("mode", ["int8", "fp64", 16])
def test_unknown_mode_is_a_config_error(mode):
    with pytest.raises(ConfigError, match="mixed_precision"):
        make_precision(mode, CPU)


def test_bad_autocast_kwargs_are_a_config_error():
    with pytest.raises(ConfigError, match="autocast_kwargs"):
        make_precision("bf16", CPU, autocast_kwargs={"colour": "blue"})


def test_fp8_without_cuda_explains_why_and_what_to_do():
    with pytest.raises(ConfigError) as info:
        make_precision("fp8", CPU)
    message = str(info.value)
    assert "CUDA GPU" in message and "bf16" in message


def test_fp16_backward_scales_and_step_unscales():
    p = make_precision("fp16", CPU, scaler_kwargs={"init_scale": 1024.0})
    model, opt = _tiny()
    reference = torch.nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 4)
    with p.autocast():
        out = model(x)
    assert out.dtype == torch.float16
    p.backward(out.float().pow(2).mean())
    reference(x).pow(2).mean().backward()
    # the stored gradient is scaled by init_scale until unscale_
    torch.testing.assert_close(
        model.weight.grad / 1024.0, reference.weight.grad, rtol=2e-2, atol=1e-3
    )
    p.unscale_(opt)
    p.unscale_(opt)  # idempotent within one step (clip then step both ask for it)
    torch.testing.assert_close(model.weight.grad, reference.weight.grad, rtol=2e-2, atol=1e-3)
    before = model.weight.detach().clone()
    assert p.step(opt) is True
    assert not torch.equal(before, model.weight)


def test_fp16_inf_gradient_skips_the_step_and_backs_off():
    p = make_precision("fp16", CPU, scaler_kwargs={"init_scale": 256.0})
    model, opt = _tiny()
    p.backward(model(torch.ones(2, 4)).sum())
    model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    assert p.step(opt) is False
    assert torch.equal(before, model.weight)
    assert p.scaler.get_scale() == 128.0
    # the next clean step goes through (unscale state was reset by the skipped step)
    opt.zero_grad()
    p.backward(model(torch.ones(2, 4)).sum())
    p.unscale_(opt)
    assert p.step(opt) is True
    assert not torch.equal(before, model.weight)


def test_fp16_nan_gradient_skips_the_step():
    p = make_precision("fp16", CPU)
    model, opt = _tiny()
    p.backward(model(torch.ones(2, 4)).sum())
    model.bias.grad[0] = float("nan")
    assert p.step(opt) is False


def test_fp16_scaler_state_roundtrip():
    p = make_precision("fp16", CPU, scaler_kwargs={"init_scale": 64.0, "growth_interval": 7})
    model, opt = _tiny()
    p.backward(model(torch.ones(2, 4)).sum())
    model.weight.grad.fill_(float("inf"))
    p.step(opt)
    state = p.state_dict()
    assert state["scale"] == 32.0 and state["growth_interval"] == 7
    q = make_precision("fp16", CPU)
    q.load_state_dict(state)
    assert q.scaler.get_scale() == 32.0
    q.load_state_dict({})  # a checkpoint from a run without fp16 leaves the scaler alone
    assert q.scaler.get_scale() == 32.0


def test_fp16_disabled_scaler_steps_plainly():
    p = make_precision("fp16", CPU, scaler_kwargs={"enabled": False})
    model, opt = _tiny()
    p.backward(model(torch.ones(2, 4)).sum())
    before = model.weight.detach().clone()
    assert p.step(opt) is True
    assert not torch.equal(before, model.weight)


# -- through the Accelerator, on 1 and 2 real processes -------------------------------------


def _accelerator(**kwargs):
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    return Accelerator(cpu=True, **kwargs)


def _regression_loader(batch_size):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    dataset = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)


def _bf16_worker():
    acc = _accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    model, optimizer, loader = acc.prepare(model, optimizer, _regression_loader(8))
    losses, dtypes = [], set()
    for _ in range(4):
        for x, y in loader:
            out = model(x)
            dtypes.add(out.dtype)
            loss = torch.nn.functional.mse_loss(out, y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(acc.reduce(loss.detach(), "mean").item())
    with acc.autocast():
        inner = torch.nn.functional.linear(x, torch.ones(1, 8)).dtype
    return losses, dtypes, inner


@pytest.mark.integration
@pytest.mark.parametrize("num_processes", [1, 2])
def test_bf16_training_step_on_cpu_and_the_loss_decreases(num_processes):
    from nbaccel.launch.testing import run_on_workers

    for losses, dtypes, inner in run_on_workers(_bf16_worker, num_processes):
        assert dtypes == {torch.float32}  # outputs come back in float32
        assert inner == torch.bfloat16  # accelerator.autocast() really is bf16
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        assert last < 0.5 * first, losses


def _fp16_overflow_worker():
    from nbaccel.runtime.facade.options import GradScalerKwargs

    acc = _accelerator(
        mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)]
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler, loader = acc.prepare(
        model, optimizer, scheduler, _regression_loader(8)
    )
    batches = iter(loader)
    record = []
    for poison in (False, True, False):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if poison:
            loss = loss * float("inf")  # every gradient becomes inf/nan, on every rank
        before = [p.detach().clone() for p in model.parameters()]
        acc.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        changed = any(
            not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)
        )
        record.append(
            {
                "skipped": acc.optimizer_step_was_skipped,
                "changed": changed,
                "lr": scheduler.get_last_lr()[0],
                "scale": acc.precision.scaler.get_scale(),
                "step": acc.step,
            }
        )
    return record


@pytest.mark.integration
def test_fp16_overflow_skips_the_step_and_keeps_the_scheduler_still():
    from nbaccel.launch.testing import run_on_workers

    for clean, poisoned, after in run_on_workers(_fp16_overflow_worker, 2):
        assert not clean["skipped"] and clean["changed"] and clean["step"] == 1
        assert poisoned["skipped"] and not poisoned["changed"]
        assert poisoned["lr"] == clean["lr"]  # the scheduler did not step
        assert poisoned["scale"] == clean["scale"] / 2
        assert poisoned["step"] == 1
        assert not after["skipped"] and after["changed"] and after["step"] == 2
        assert after["lr"] < clean["lr"]


def test_fp8_names_the_compute_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"compute capability >= 8\.9.*A100 has 8\.0"):
        make_precision("fp8", torch.device("cuda", 0))


def test_fp8_names_the_missing_library(monkeypatch):
    import sys

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # makes the import fail
    with pytest.raises(ConfigError, match="pip install torchao"):
        make_precision("fp8", torch.device("cuda", 0))


def _accelerator_precision_errors():
    errors = {}
    for mode in ("int8", "fp8"):
        try:
            _accelerator(mixed_precision=mode)
            errors[mode] = None
        except ConfigError as err:
            errors[mode] = str(err)
    return errors


@pytest.mark.integration
def test_accelerator_rejects_unknown_and_unavailable_precisions():
    from nbaccel.launch.testing import run_on_workers

    (errors,) = run_on_workers(_accelerator_precision_errors, 1)
    assert "mixed_precision='int8' is unknown" in errors["int8"]
    assert "fp8" in errors["fp8"] and "CUDA GPU" in errors["fp8"]


def _two_optimizer_updates(mixed_precision):
    """One GAN-style iteration: one loss, two models with their own optimizers, clipping."""
    from nbaccel.runtime.facade.options import GradScalerKwargs

    scaler = [GradScalerKwargs(init_scale=1024.0)] if mixed_precision == "fp16" else None
    acc = _accelerator(mixed_precision=mixed_precision, kwargs_handlers=scaler)
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt1 = torch.optim.SGD(first.parameters(), lr=0.1)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.1)
    first, second, opt1, opt2 = acc.prepare(first, second, opt1, opt2)
    before = [p.detach().clone() for p in (*first.parameters(), *second.parameters())]
    x = torch.randn(8, 4)
    loss = (second(first(x)).float() - 1.0).pow(2).mean()
    acc.backward(loss)
    acc.clip_grad_norm_([*first.parameters(), *second.parameters()], max_norm=1e6)
    opt1.step()
    opt2.step()
    after = [p.detach() for p in (*first.parameters(), *second.parameters())]
    deltas = [(a - b).flatten() for a, b in zip(after, before, strict=True)]
    return torch.cat(deltas[:2]), torch.cat(deltas[2:])  # per optimizer


def test_fp16_two_optimizers_with_clipping_match_fp32():
    reference = _two_optimizer_updates("no")
    updates = _two_optimizer_updates("fp16")
    for got, want in zip(updates, reference, strict=True):
        # the second optimizer used to step with gradients still scaled by 65536
        ratio = got.norm() / want.norm()
        assert 0.9 < ratio < 1.1, (got, want)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.99


def test_fp16_updates_the_scale_once_after_all_optimizers_stepped():
    p = make_precision("fp16", CPU, scaler_kwargs={"init_scale": 256.0, "growth_interval": 1})
    m1, m2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    p.add_optimizer(o1)
    p.add_optimizer(o2)
    p.backward(m2(m1(torch.ones(1, 2))).sum())
    assert p.step(o1) is True
    assert p.scaler.get_scale() == 256.0  # not yet: o2 has not stepped
    assert p.step(o2) is True
    assert p.scaler.get_scale() == 512.0  # one update (growth_interval=1): once, not twice


def test_fp8_keeps_the_first_and_last_linear_in_bf16_as_accelerate_does():
    from nbaccel.runtime.compute.fp8 import fp8_layers

    with torch.device("meta"):  # shapes only
        big, mlp = _fp8_shapes()
    assert fp8_layers(big) == ["1", "2"]
    # a two-layer MLP has only a first and a last layer: nothing converts (as in Accelerate)
    assert fp8_layers(mlp) == []
    assert fp8_layers(torch.nn.Sequential(torch.nn.ReLU())) == []


def _fp8_shapes():
    big = torch.nn.Sequential(
        torch.nn.Linear(256, 4096),  # first: kept (Accelerate's stability rule)
        torch.nn.Linear(4096, 16384),
        torch.nn.Linear(16384, 4096),
        torch.nn.Linear(4096, 1000),  # 1000 is no multiple of 16: fp8 cannot run it
        torch.nn.Linear(4096, 4096),  # last: kept
    )
    return big, torch.nn.Sequential(torch.nn.Linear(4096, 16384), torch.nn.Linear(16384, 4096))


def test_fp8_conversion_takes_ao_recipe_kwargs_filter_and_config(monkeypatch):
    """torchao's converter is replaced by a recorder: this checks which filter and config
    nbaccel hands it (tests/gpu converts for real on an H100/H200)."""
    import sys
    import types

    from nbaccel.runtime.compute import fp8
    from nbaccel.utils import AORecipeKwargs

    seen = {}

    def record(model, *, module_filter_fn, config):
        seen["chosen"] = [n for n, m in model.named_modules() if module_filter_fn(m, n)]
        seen["config"] = config
        return model

    fake = types.ModuleType("torchao.float8")
    fake.convert_to_float8_training = record  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchao.float8", fake)
    with torch.device("meta"):  # shapes only
        model = torch.nn.Sequential(*(torch.nn.Linear(8192, 8192) for _ in range(4)))
        small = torch.nn.Sequential(torch.nn.Linear(8192, 8192), torch.nn.Linear(8192, 16))
    fp8.convert(model)
    assert seen == {"chosen": ["1", "2"], "config": None}
    config = object()
    recipe = AORecipeKwargs(config=config, module_filter_func=lambda m, name: name == "0")
    fp8.convert(model, recipe)
    assert seen == {"chosen": ["0"], "config": config}
    with pytest.warns(RuntimeWarning, match=r"first and last stay in bf16.*AORecipeKwargs"):
        fp8.convert(small)


def test_ao_recipe_kwargs_is_accepted_like_accelerate():
    from nbaccel import Accelerator
    from nbaccel.utils import AORecipeKwargs, FP8RecipeKwargs

    recipe = AORecipeKwargs()
    accelerator = Accelerator(cpu=True, kwargs_handlers=[recipe])
    assert accelerator.ao_recipe_handler is recipe
    assert accelerator.fp8_recipe_handler is None  # TransformerEngine / MS-AMP: never here
    with pytest.raises(ConfigError, match=r"AORecipeKwargs\(config=\.\.\., module_filter_func"):
        FP8RecipeKwargs(backend="te")
