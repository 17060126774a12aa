"""DeepSpeed's engine behind ``Accelerator(deepspeed_plugin=...)`` on a real 2-process gloo group.

One launch (DeepSpeed imports slowly: one group checks every variant) trains the same
model, data and seed under DDP and under ZeRO 1, 2, 3, ZeRO-2 with the optimizer
offloaded to the CPU and ZeRO-3 with parameters and optimizer offloaded, with gradient
accumulation and clipping; each must end with DDP's weights. It also resumes ZeRO-2
and ZeRO-3 exactly from ``save_state``, exports consolidated weights with
``save_model``, trains in bf16, and gathers predictions with ``gather_for_metrics``.
Offload uses a torch optimizer (``zero_force_ds_cpu_optimizer: false``) so no C++
build is needed. The rest are pure checks of the plugin and of the ``"auto"`` values.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~3 s): once here, not in every worker

from nbaccel.errors import ConfigError

deepspeed_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install --no-build-isolation deepspeed; scripts/setup.sh does)",
)

VARIANTS = {
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "zero2-offload": {"zero_stage": 2, "offload_optimizer_device": "cpu"},
    "zero3-offload": {
        "zero_stage": 3,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "cpu",
    },
}


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(self.net[0].weight.dtype))  # bf16 engines cast the weights


def _data():
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [2.0], [-1.0]]) + 0.5)


def _plugin(kwargs, precision="no"):
    from nbaccel import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(gradient_clipping=1.0, **kwargs)
    # ZeRO-Offload with a torch optimizer: DeepSpeedCPUAdam would need a C++ build
    plugin.deepspeed_config["zero_force_ds_cpu_optimizer"] = False
    return plugin


def _setup(plugin, precision="no"):
    from torch.utils.data import DataLoader

    from nbaccel import Accelerator

    acc = Accelerator(
        deepspeed_plugin=plugin, gradient_accumulation_steps=2, mixed_precision=precision
    )
    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = DataLoader(_data(), batch_size=4, shuffle=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.97)
    return acc, *acc.prepare(model, optimizer, loader, scheduler)


def _epoch(acc, model, optimizer, loader, scheduler):
    norms = []
    for xb, yb in loader:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(round(float(acc.clip_grad_norm_(model.parameters(), 1.0)), 5))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return norms, float(loss)


def _weights(acc, model):
    return {k: v.detach().float().clone() for k, v in acc.get_state_dict(model).items()}


def _local(model):
    """This rank's own part of the weights (ZeRO-3: its partition, ``ds_tensor``), which
    every rank holds: ``get_state_dict`` gathers to the main process only."""
    return [getattr(p, "ds_tensor", p).detach().float().clone() for p in model.parameters()]


def _scenarios(directory):
    """Every variant in one process group; returns what rank 0 (and rank 1) saw."""
    from safetensors.torch import load_file

    from nbaccel import Accelerator

    out = {}
    # DDP reference: same seed, data, accumulation and clipping
    acc = Accelerator(gradient_accumulation_steps=2)
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.97)
    model, optimizer, loader, scheduler = acc.prepare(
        model, optimizer, DataLoader(_data(), batch_size=4, shuffle=True), scheduler
    )
    norms = _epoch(acc, model, optimizer, loader, scheduler)[0]
    norms += _epoch(acc, model, optimizer, loader, scheduler)[0]
    out["ddp"] = {"weights": _weights(acc, model), "norms": norms, "step": acc.step}
    ddp_checkpoint = acc.save_state(f"{directory}/ddp")
    for name, kwargs in VARIANTS.items():
        acc, model, optimizer, loader, scheduler = _setup(_plugin(kwargs))
        norms = _epoch(acc, model, optimizer, loader, scheduler)[0]
        if name == "zero2":  # a checkpoint saved under DDP: refused, naming why
            try:
                acc.load_state(ddp_checkpoint)
            except Exception as err:
                out["ddp-checkpoint"] = f"{type(err).__name__}: {err}"
        if name in ("zero2", "zero3"):  # resume: save, go on, load, redo the same epoch
            path = acc.save_state(f"{directory}/{name}")
            _epoch(acc, model, optimizer, loader, scheduler)
            first, first_local = _weights(acc, model), _local(model)
            acc.load_state(path)
            loader.set_epoch(1)
            second_norms = _epoch(acc, model, optimizer, loader, scheduler)[0]
            resumed, resumed_local = _weights(acc, model), _local(model)
            norms += second_norms
            out[f"{name}-resume"] = {  # every rank: its own part; the main one: the whole
                "exact": len(first_local) > 0
                and all(a.numel() > 0 for a in first_local)
                and all(torch.equal(a, b) for a, b in zip(first_local, resumed_local, strict=True))
                and first.keys() == resumed.keys()
                and all(torch.equal(first[k], resumed[k]) for k in first),
                "whole": sorted(first),
                "files": sorted(p.name for p in __import__("pathlib").Path(path).iterdir()),
            }
        else:
            norms += _epoch(acc, model, optimizer, loader, scheduler)[0]
        files = acc.save_model(model, f"{directory}/{name}-export")
        weights = _weights(acc, model)
        exported = load_file(str(files[0])) if files else {}
        out[name] = {
            "weights": weights,
            "exported": {k: v.float() for k, v in exported.items()},
            "norms": norms,
            "step": acc.step,
            "type": acc.distributed_type.value,
            "engine": type(model).__name__,
            "unwrapped": type(acc.unwrap_model(model)).__name__,
            "plugin": acc.state.deepspeed_plugin.zero_stage_value,
            "lr": scheduler.get_last_lr()[0],
        }
    # bf16: the engine holds bf16 weights and fp32 master copies
    acc, model, optimizer, loader, scheduler = _setup(_plugin({"zero_stage": 2}), "bf16")
    _, loss = _epoch(acc, model, optimizer, loader, scheduler)
    predictions = []
    for xb, _yb in loader:
        with torch.no_grad():
            predictions.append(acc.gather_for_metrics(model(xb)))
    acc.gradient_accumulation_steps = 4  # after prepare: the engine's count is fixed
    try:
        acc.backward(model(torch.ones(1, 3)).sum())
    except ConfigError as err:
        out["late_accumulation_change"] = str(err)
    acc.free_memory()  # as cross-validation does: a fresh engine for the next fold
    fold = _Net()
    again = acc.prepare(fold, torch.optim.SGD(fold.parameters(), lr=0.1))
    out["after_free_memory"] = type(again[0]).__name__
    out["bf16"] = {
        "mixed_precision": acc.mixed_precision,
        "dtype": str(next(acc.unwrap_model(model).parameters()).dtype),
        "loss": loss,
        "gathered": sum(len(p) for p in predictions),
    }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from nbaccel.launch.testing import run_on_workers

    directory = tmp_path_factory.mktemp("deepspeed")
    return run_on_workers(_scenarios, 2, args=(str(directory),))


@deepspeed_missing
@pytest.mark.integration
@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_zero_stage_and_offload_ends_with_the_weights_of_ddp(results, name):
    rank0, rank1 = results
    ddp, got = rank0["ddp"], rank0[name]
    assert (got["type"], got["engine"], got["unwrapped"]) == (
        "DEEPSPEED",
        "DeepSpeedEngine",
        "_Net",
    )
    assert got["plugin"] == VARIANTS[name]["zero_stage"]  # accelerator.state.deepspeed_plugin
    # 2 epochs x 64 samples / (2 processes x batch 4 x accumulation 2) = 8 updates
    assert got["step"] == ddp["step"] == 8
    assert got["lr"] == pytest.approx(0.05 * 0.97 ** (2 * 8))  # torch scheduler, 2 processes
    assert sorted(got["weights"]) == sorted(ddp["weights"])
    for key, expected in ddp["weights"].items():
        torch.testing.assert_close(got["weights"][key], expected, atol=1e-5, rtol=1e-5)
    # clip_grad_norm_ returns the global norm the engine measured (before clipping)
    torch.testing.assert_close(
        torch.tensor(got["norms"]), torch.tensor(ddp["norms"]), atol=1e-4, rtol=1e-4
    )
    # save_model writes the consolidated weights (ZeRO-3: gathered) from the main process
    assert got["exported"].keys() == got["weights"].keys()
    assert all(torch.equal(got["exported"][k], v) for k, v in got["weights"].items())
    assert rank1[name]["weights"] == {} and rank1[name]["exported"] == {}


@deepspeed_missing
@pytest.mark.integration
@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_save_state_resumes_exactly_through_the_durable_checkpoint(results, name):
    for rank in results:
        assert rank[f"{name}-resume"]["exact"]
    assert results[0][f"{name}-resume"]["whole"]  # the main process compared every weight
    refused = results[0]["ddp-checkpoint"]
    assert refused.startswith("CheckpointError") and "saved without DeepSpeed" in refused
    files = results[0][f"{name}-resume"]["files"]
    # DeepSpeed's own files inside nbaccel's manifest-checked directory
    assert {"nbaccel_checkpoint.json", "pytorch_model", "scheduler.bin", "rank_0.pt"} <= set(files)


@deepspeed_missing
@pytest.mark.integration
def test_bf16_trains_with_bf16_weights_and_gather_for_metrics_counts_every_sample(results):
    got = results[0]["bf16"]
    assert got["mixed_precision"] == "bf16" and got["dtype"] == "torch.bfloat16"
    assert got["loss"] < 5.0 and got["gathered"] == 64
    assert results[0]["after_free_memory"] == "DeepSpeedEngine"
    assert "engine was built with 2" in results[0]["late_accumulation_change"]


# ------------------------------------------------------------------ plugin and "auto" values


def test_plugin_fields_build_the_config_accelerate_documents():
    from nbaccel import DeepSpeedPlugin

    config = DeepSpeedPlugin(
        zero_stage=3,
        offload_optimizer_device="cpu",
        offload_param_device="cpu",
        gradient_clipping=1.0,
    ).deepspeed_config
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert config["gradient_clipping"] == 1.0
    assert config["train_micro_batch_size_per_gpu"] == "auto"


def test_hf_ds_config_file_fills_its_auto_values(tmp_path, monkeypatch):
    from nbaccel.runtime.strategy.deepspeed import _deepspeed_config as fill
    from nbaccel.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    path = tmp_path / "ds_config.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "bf16": {"enabled": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
                "scheduler": {
                    "type": "WarmupDecayLR",
                    "params": {
                        "warmup_min_lr": "auto",
                        "warmup_max_lr": "auto",
                        "warmup_num_steps": "auto",
                        "total_num_steps": "auto",
                    },
                },
                "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"},
            }
        )
    )
    monkeypatch.chdir(tmp_path)
    plugin = DeepSpeedPlugin(hf_ds_config="ds_config.json", zero_stage=3)
    config = plugin.deepspeed_config
    assert plugin.is_auto("train_batch_size") and config["zero_optimization"]["stage"] == 3
    assert fill.precision_from_config(config, "bf16") == "bf16" and config["bf16"]["enabled"]
    config["gradient_accumulation_steps"] = 2
    fill.fill_batch_sizes(
        config, batch_sizes=[8], num_processes=2, split_batches=False, train_batch_min=True
    )
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"]) == (8, 32)
    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"hidden_size": 10})()
    fill.fill_model_sizes(config, model)
    assert config["zero_optimization"]["reduce_bucket_size"] == 100
    optimizer = DummyOptim(model.parameters(), lr=3e-4, weight_decay=0.01)
    scheduler = DummyScheduler(optimizer, total_num_steps=101, warmup_num_steps=10)
    fill.fill_optimizer_and_scheduler(
        config,
        dummy_optimizer=optimizer,
        dummy_scheduler=scheduler,
        num_processes=2,
        split_batches=False,
    )
    assert config["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.01}
    assert config["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 10,
        "total_num_steps": 51,  # each of 2 processes sees half of the batches
    }
    fill.fill_remaining(config)
    assert config["gradient_clipping"] == 1.0
    assert list(fill.auto_keys(config)) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_stage": 4}, "zero_stage=4"),
        ({"offload_optimizer_device": "gpu"}, "offload_optimizer_device='gpu'"),
        ({"zero_stage": 2, "offload_param_device": "cpu"}, "needs ZeRO-3"),
        ({"hf_ds_config": "missing.json"}, "no such file"),
        ({"hf_ds_config": 3}, "must be a path"),
    ],
)
def test_bad_plugin_values_name_the_fix(kwargs, message):
    from nbaccel import DeepSpeedPlugin

    with pytest.raises(ConfigError, match=message):
        DeepSpeedPlugin(**kwargs)


def test_auto_values_that_cannot_be_derived_are_named():
    from nbaccel.runtime.strategy.deepspeed import _deepspeed_config as fill

    with pytest.raises(ConfigError, match="pass the training DataLoader"):
        fill.fill_batch_sizes(
            {"train_micro_batch_size_per_gpu": "auto"},
            batch_sizes=[],
            num_processes=2,
            split_batches=False,
            train_batch_min=True,
        )
    with pytest.raises(ConfigError, match=r"model\.config\.hidden_size"):
        fill.fill_model_sizes(
            {"zero_optimization": {"reduce_bucket_size": "auto"}}, torch.nn.Linear(1, 1)
        )
    with pytest.raises(ConfigError, match=r"still has \"auto\" at optimizer.params.betas"):
        fill.fill_remaining({"optimizer": {"params": {"betas": "auto"}}})


def test_without_deepspeed_one_error_names_the_install_before_any_process_starts(monkeypatch):
    from nbaccel import Accelerator, DeepSpeedPlugin, LaunchConfig, notebook_launcher

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install --no-build-isolation deepspeed"):
        Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    config = LaunchConfig(strategy="deepspeed", num_processes=2, compute_device="cpu")
    with pytest.raises(ConfigError, match=r"pip install --no-build-isolation deepspeed"):
        notebook_launcher(print, config=config)  # the autouse fixture: no child was started
    with pytest.raises(ConfigError, match=r"pip install --no-build-isolation deepspeed"):
        notebook_launcher(print, args=(DeepSpeedPlugin(),), config=config.replace(strategy="ddp"))


def _stall_in_rank_1():
    import time

    from torch.utils.data import DataLoader

    from nbaccel import Accelerator, DeepSpeedPlugin

    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(_data(), batch_size=4))
    for step, (xb, yb) in enumerate(loader):
        if acc.process_index == 1 and step == 1:
            time.sleep(600)  # rank 1 stops taking part; rank 0 waits in the engine's all-reduce
        acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
        optimizer.step()


@deepspeed_missing
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_hang_watchdog_sees_a_rank_stuck_inside_the_engine():
    from nbaccel.errors import WorkerTimeoutError
    from nbaccel.launch.testing import run_on_workers

    # 12 s: far above any gap between the ranks while they start (both import DeepSpeed)
    env = {"NBACCEL_HANG_AFTER": "12", "NBACCEL_ON_HANG": "raise"}
    with pytest.raises(WorkerTimeoutError) as caught:
        run_on_workers(_stall_in_rank_1, 2, env=env)
    message = str(caught.value)
    assert "rank 0: waiting in torch.distributed.all_reduce" in message
    # where rank 0 was: the user's line first, then nbaccel's strategy, then DeepSpeed's engine
    where = message[message.index("where rank 0 was") :]
    assert where.index("acc.backward") < where.index("strategy/deepspeed/deepspeed.py")
    assert "deepspeed/runtime/engine.py" in where


@deepspeed_missing
@pytest.mark.integration  # required under NBACCEL_REQUIRE_ALL: a missing deepspeed fails
def test_prepare_model_alone_cannot_build_the_engine_and_says_how():
    from nbaccel import Accelerator, DeepSpeedPlugin
    from nbaccel.runtime.process.state import reset_state

    try:  # one process, this one: no engine is built (deepspeed is not even imported)
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2), cpu=True)
        with pytest.raises(ConfigError, match=r"accelerator\.prepare\(model, optimizer, \.\.\.\)"):
            acc.prepare_model(torch.nn.Linear(2, 2))
        model = acc.prepare_model(torch.nn.Linear(2, 2), evaluation_mode=True)
        assert model.weight.device.type == "cpu"
    finally:
        reset_state()  # the next tests launch workers from this process


def test_deepspeed_on_tpu_is_refused_before_starting():
    from nbaccel import LaunchConfig
    from nbaccel.launch.testing import plan_for as plan_launch

    config = LaunchConfig(compute_device="tpu", num_processes=1, strategy="deepspeed")
    with pytest.raises(ConfigError, match=r"strategy='deepspeed' is not available on TPU"):
        plan_launch(print, config=config)
