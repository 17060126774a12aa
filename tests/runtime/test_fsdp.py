"""FSDP2 training on real 2-process gloo groups: parity with one unsharded process,
shard sizes, accumulation, bf16, clipping, the rest of the API, and bad input.

The reference is the same model, data and seed trained by one process without
sharding; FSDP runs with 2 processes and half the per-process batch, so both see the
same global batches.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~3 s): once here, not in every worker
from torch.utils.data import DataLoader, TensorDataset

from nbaccel.errors import ConfigError, WorkerError
from nbaccel.launch.testing import run_on_workers

pytestmark = pytest.mark.integration


def _plugin(**kwargs):
    from nbaccel import FullyShardedDataParallelPlugin

    kwargs.setdefault("auto_wrap_policy", "size_based_wrap")
    kwargs.setdefault("min_num_params", 20)
    return FullyShardedDataParallelPlugin(**kwargs)


def _train(fsdp, accumulation=1, precision="no", model_first=True, plugin_kwargs=None):
    """Train 2 epochs; return (full weights on rank 0, steps, type, local numel, norms)."""
    from nbaccel import Accelerator, set_seed
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(
        gradient_accumulation_steps=accumulation,
        mixed_precision=precision,
        fsdp_plugin=_plugin(**(plugin_kwargs or {})) if fsdp else None,
    )
    set_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, generator=g)
    y = x @ torch.tensor([[1.0], [2.0], [-1.0]]) + 0.5 + 0.1 * torch.randn(64, 1, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    batch = 8 // acc.num_processes // accumulation
    # the loader's own generator: 2 processes then read the 1-process order (a generator-less
    # sampler is seeded from the global stream, per run on 1 process and once on 2: Accelerate's)
    order = torch.Generator().manual_seed(2)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=order)
    if model_first:
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
    else:  # the optimizer first: it must still follow the sharded parameters
        optimizer, loader, model = acc.prepare(optimizer, loader, model)
    norms = []
    for _epoch in range(2):
        for xb, yb in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
                optimizer.step()
                optimizer.zero_grad()
    state = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters())
    return state, acc.step, acc.distributed_type.value, local, norms


@pytest.fixture(scope="module")
def references():
    """One unsharded process per variant: (accumulation, precision) -> result."""
    cache = {}

    def get(accumulation, precision):
        if (accumulation, precision) not in cache:
            cache[accumulation, precision] = run_on_workers(
                _train, 1, args=(False, accumulation, precision)
            )[0]
        return cache[accumulation, precision]

    return get


@pytest.mark.parametrize(
    ("accumulation", "precision", "model_first", "plugin_kwargs", "tolerance"),
    [
        (1, "no", True, None, 1e-5),
        (2, "no", False, None, 1e-5),
        (1, "no", True, {"reshard_after_forward": False, "activation_checkpointing": True}, 1e-5),
        (1, "bf16", True, None, 2e-2),
    ],
    ids=["fp32", "accumulation-optimizer-first", "no-reshard-activation-ckpt", "bf16"],
)
def test_two_process_fsdp_matches_one_unsharded_process(
    references, accumulation, precision, model_first, plugin_kwargs, tolerance
):
    reference, ref_steps, ref_type, _, ref_norms = references(accumulation, precision)
    results = run_on_workers(
        _train, 2, args=(True, accumulation, precision, model_first, plugin_kwargs)
    )
    (state0, steps0, type0, _, norms0), (state1, steps1, type1, _, norms1) = results
    assert (ref_type, type0, type1) == ("NO", "FSDP", "FSDP")
    assert steps0 == steps1 == ref_steps == 2 * 64 // 8
    assert state1 == {}  # the full state is gathered on rank 0 only
    assert sorted(state0) == sorted(reference)
    for name, expected in reference.items():
        assert state0[name].dtype == torch.float32  # bf16 only in compute, not in the master copy
        torch.testing.assert_close(state0[name], expected, atol=tolerance, rtol=tolerance)
    # clip_grad_norm_ returns the norm of the whole (unsharded) gradient, on every rank
    assert norms0 == norms1
    torch.testing.assert_close(
        torch.tensor(norms0), torch.tensor(ref_norms), atol=tolerance, rtol=tolerance
    )


def _shard_sizes():
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(fsdp_plugin=_plugin(min_num_params=1000))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    total = sum(p.numel() for p in model.parameters())
    model = acc.prepare(model)
    local = sum(p.to_local().numel() for p in model.parameters())
    units = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
    return total, local, units


def test_each_rank_holds_half_of_the_parameters():
    (total, local0, units), (_, local1, _) = run_on_workers(_shard_sizes, 2)
    assert units == 5  # four Linear layers of 4160 parameters each, then the root
    assert local0 + local1 == total
    assert local0 == local1 == total // 2


def _api_under_fsdp():
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(fsdp_plugin=_plugin())
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.arange(11.0).unsqueeze(1)), batch_size=2)
    prepared, optimizer, loader = acc.prepare(model, optimizer, loader)
    gathered = []
    for (xb,) in loader:
        gathered.append(acc.gather_for_metrics(xb))
    out = {
        "gathered": sorted(torch.cat(gathered).flatten().tolist()),
        "unwrapped_is_model": acc.unwrap_model(prepared) is model,
        "optimizer_follows": {id(p) for g in optimizer.param_groups for p in g["params"]}
        == {id(p) for p in prepared.parameters()},
        "repr": repr(acc.strategy).split("(")[0],
    }
    acc.free_memory()
    out["freed"] = (acc._models, acc._optimizers, acc._dataloaders) == ([], [], [])
    return out


def test_gather_unwrap_and_free_memory_work_under_fsdp():
    for result in run_on_workers(_api_under_fsdp, 2):
        assert result["gathered"] == [float(i) for i in range(11)]
        assert result["unwrapped_is_model"] and result["optimizer_follows"]
        assert result["repr"] == "FSDP" and result["freed"]


def _fp16_overflow_on_one_rank():
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator(mixed_precision="fp16", fsdp_plugin=_plugin())
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    acc.backward(model(torch.ones(4, 3)).square().mean())
    if acc.process_index == 1:  # an overflow in rank 1's gradient shard only
        next(iter(model.parameters())).grad.to_local()[0] = float("inf")
    before = next(iter(model.parameters())).detach().full_tensor()
    optimizer.step()
    after = next(iter(model.parameters())).detach().full_tensor()
    return acc.optimizer_step_was_skipped, torch.equal(before, after)


def test_fp16_overflow_in_one_shard_skips_the_step_on_every_rank():
    # the scaler's overflow check runs on DTensor gradients, so its verdict is global
    assert run_on_workers(_fp16_overflow_on_one_rank, 2) == [(True, True)] * 2


def _launch_config_picks_fsdp():
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    acc = Accelerator()  # no plugin: NBACCEL_STRATEGY=fsdp (as the launcher sets it) decides
    return acc.distributed_type.value, acc.strategy.plugin.auto_wrap_policy


def test_the_launch_configuration_switches_accelerator_to_fsdp():
    from nbaccel.config import LaunchConfig, strategy_environment

    env = strategy_environment(LaunchConfig(strategy="fsdp", fsdp_auto_wrap_policy="no_wrap"))
    assert run_on_workers(_launch_config_picks_fsdp, 2, env=env) == [("FSDP", "no_wrap")] * 2


# -- bad input: a clear error before training starts -----------------------------------------


def test_fsdp_with_one_process_is_refused():
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    try:
        with pytest.raises(ConfigError, match=r"single process.*num_processes=2"):
            Accelerator(cpu=True, fsdp_plugin=_plugin())
    finally:
        reset_state()  # no process state left behind: later launches in this process must work


def test_fsdp_with_one_process_is_refused_by_the_launcher_before_starting():
    from nbaccel import LaunchConfig, notebook_launcher

    started = []
    with pytest.raises(ConfigError, match=r"strategy=.fsdp.*num_processes >= 2"):
        notebook_launcher(
            started.append,
            (1,),
            config=LaunchConfig(strategy="fsdp", num_processes=1, compute_device="cpu"),
        )
    assert started == []


def test_deepspeed_plugin_together_with_fsdp_is_refused():
    from nbaccel import Accelerator

    with pytest.raises(ConfigError, match="fsdp_plugin and deepspeed_plugin"):
        Accelerator(cpu=True, fsdp_plugin=_plugin(), deepspeed_plugin=object())


def test_plugin_is_importable_where_accelerate_scripts_look():
    import nbaccel
    import nbaccel.utils

    assert nbaccel.utils.FullyShardedDataParallelPlugin is nbaccel.FullyShardedDataParallelPlugin


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"auto_wrap_policy": "layer_wrap"}, "auto_wrap_policy='layer_wrap' is unknown"),
        ({"sharding_strategy": "FULL_SHARD"}, "reshard_after_forward=True"),
        ({"sync_module_states": True}, "cpu_ram_efficient_loading=True"),
        ({"state_dict_type": "LOCAL_STATE_DICT"}, "LOCAL_STATE_DICT is legacy"),
        ({"fsdp_version": 1}, "FSDP2"),
        ({"auto_wrap_policy": "size_based_wrap", "min_num_params": None}, "needs min_num_params"),
    ],
)
def test_bad_plugin_fields_name_the_fsdp2_way(kwargs, message):
    from nbaccel import FullyShardedDataParallelPlugin

    with pytest.raises(ConfigError, match=message):
        FullyShardedDataParallelPlugin(**kwargs)


def test_unknown_wrap_policy_in_the_launch_configuration_is_refused():
    from nbaccel import LaunchConfig

    with pytest.raises(ConfigError, match="fsdp_auto_wrap_policy='layer_wrap' is unknown"):
        LaunchConfig(strategy="fsdp", fsdp_auto_wrap_policy="layer_wrap")


def _prepare_bad(kind):
    from torch.nn.parallel import DistributedDataParallel

    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    if kind == "ddp":
        acc = Accelerator(fsdp_plugin=_plugin())
        acc.prepare(DistributedDataParallel(torch.nn.Linear(2, 2)))
    else:
        plugin = _plugin(
            auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap="GPT2Block"
        )
        acc = Accelerator(fsdp_plugin=plugin)
        acc.prepare(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("ddp", "already wrapped in DistributedDataParallel"),
        ("names", r"names \['GPT2Block'\], which this model does not contain"),
    ],
)
def test_prepare_refuses_a_ddp_model_and_unknown_block_names(kind, message):
    with pytest.raises(WorkerError, match=message):
        run_on_workers(_prepare_bad, 2, args=(kind,))
