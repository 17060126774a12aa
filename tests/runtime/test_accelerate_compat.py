"""What scripts written for Accelerate read, write and call beyond the core API (issue 25).

Version gates (``accelerate.__version__``), attribute assignments (``native_amp``,
``gradient_accumulation_steps``, the policy for the rest), Accelerate's extra
attributes, ``DistributedType`` members, state resets, ``join_uneven_inputs``'
warnings, ``accelerate.utils`` helpers and the names of what nbaccel does not do.
Distributed behaviour runs on real 2-process gloo groups (``run_on_workers``).
"""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from nbaccel.errors import ConfigError, WorkerError
from nbaccel.launch.testing import run_on_workers

# ------------------------------------------------------------------ version gates


def _diffusers_style(root):
    """The shape of 34 diffusers training scripts, ported by the README's rule."""
    import os

    from packaging import version

    from nbaccel import Accelerator, accelerate
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    registered = False
    if version.parse(accelerate.__version__) >= version.parse("0.16.0"):

        def save_model_hook(models, weights, output_dir):
            if accelerator.is_main_process:
                for m in models:
                    path = os.path.join(output_dir, "unet.pt")
                    torch.save(accelerator.unwrap_model(m).state_dict(), path)
                    weights.pop()

        accelerator.register_save_state_pre_hook(save_model_hook)
        registered = True
    path = os.path.join(root, "checkpoint-1")
    if accelerator.is_main_process:
        accelerator.save_state(path)
    accelerator.wait_for_everyone()
    del model
    return registered, sorted(os.listdir(path))


def test_a_version_gate_on_accelerate_version_takes_accelerates_path(tmp_path):
    import nbaccel
    from nbaccel import accelerate

    assert nbaccel.__version__ == accelerate.nbaccel_version  # nbaccel's own stays
    for registered, files in run_on_workers(_diffusers_style, 2, args=(str(tmp_path),)):
        assert registered
        assert "unet.pt" in files and "model.safetensors" not in files


def test_the_porting_namespace_reaches_every_submodule():
    from nbaccel import accelerate

    assert accelerate.utils.set_seed is accelerate.set_seed
    assert accelerate.state.PartialState is accelerate.PartialState
    assert accelerate.local_sgd.LocalSGD.__name__ == "LocalSGD"
    assert accelerate.launchers.notebook_launcher is accelerate.notebook_launcher
    assert accelerate.logging.get_logger("x").logger.name == "x"


# ------------------------------------------------------------------ attributes


def _activation_dtype(accelerator):
    seen = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    prepared = accelerator.prepare(model)
    prepared(torch.ones(2, 4))
    return seen[0]


def test_native_amp_false_turns_autocast_off_as_in_accelerate():
    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    assert accelerator.native_amp is True
    assert _activation_dtype(accelerator) == torch.bfloat16
    accelerator.native_amp = False  # diffusers' MPS branch
    assert accelerator.native_amp is False
    assert _activation_dtype(accelerator) == torch.float32
    with accelerator.autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32
    with pytest.raises(ConfigError, match="native_amp=True needs a mixed precision"):
        Accelerator(cpu=True).native_amp = True


def test_gradient_accumulation_steps_can_be_set_as_in_accelerate():
    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.gradient_accumulation_steps = 2  # Accelerate's automatic-accumulation example
    assert accelerator.gradient_accumulation_steps == 2
    syncs = []
    for _ in range(4):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(1, 2)).sum())
            optimizer.step()
            optimizer.zero_grad()
            syncs.append(accelerator.sync_gradients)
    assert syncs == [False, True, False, True] and accelerator.step == 2
    with pytest.raises(ConfigError, match="int >= 1"):
        accelerator.gradient_accumulation_steps = 0


def test_assignments_take_effect_raise_or_are_the_scripts_own():
    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    with pytest.raises(AttributeError, match="read-only"):
        accelerator.mixed_precision = "bf16"  # a read-only property in Accelerate too
    with pytest.raises(AttributeError, match="no setter"):
        accelerator.num_processes = 4
    with pytest.raises(AttributeError, match="did you mean 'gradient_accumulation_steps'"):
        accelerator.gradient_acumulation_steps = 4
    with pytest.raises(AttributeError, match="GradScalerKwargs"):
        accelerator.scaler = None
    accelerator.best_metric = 0.9  # the script's own bookkeeping, as on any object
    assert accelerator.best_metric == 0.9
    accelerator.even_batches = False  # Accelerate's setter: loaders prepared afterwards
    loader = accelerator.prepare(DataLoader(list(range(3)), batch_size=2))
    assert accelerator.dataloader_config.even_batches is False
    assert loader._shard.even_batches is False
    accelerator.step_scheduler_with_optimizer = False  # a plain setting, read at prepare
    assert accelerator.step_scheduler_with_optimizer is False


def test_accelerates_other_attributes_exist():
    from nbaccel import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    assert accelerator.use_stateful_dataloader is True
    assert (accelerator.is_fsdp2, accelerator.multi_device) == (False, False)
    assert (accelerator.save_iteration, accelerator.torch_device_mesh) == (0, None)  # no config
    assert (accelerator.non_blocking, accelerator.use_seedable_sampler) == (False, False)
    assert accelerator.fp8_backend is None and accelerator.profile_handler is None
    with pytest.warns(FutureWarning, match="use_fp16 is deprecated"):
        assert accelerator.use_fp16 is False
    assert accelerator.distributed_type.value == "NO"


def test_every_distributed_type_of_accelerate_exists():
    from nbaccel.utils import DistributedType

    for name in [
        "NO",
        "MULTI_CPU",
        "MULTI_GPU",
        "MULTI_NPU",
        "MULTI_MLU",
        "MULTI_SDAA",
        "MULTI_MUSA",
        "MULTI_XPU",
        "MULTI_HPU",
        "MULTI_NEURON",
        "DEEPSPEED",
        "FSDP",
        "TP",
        "XLA",
        "MEGATRON_LM",
    ]:
        assert DistributedType[name].value == name
    assert DistributedType.TPU is DistributedType.XLA


def test_every_distributed_type_of_the_installed_accelerate_exists():
    # a test-only dependency, absent in the torch matrix: a skip that says so, not a return
    theirs = pytest.importorskip("accelerate.utils", reason="Accelerate is not installed here")
    from nbaccel.utils import DistributedType

    assert {m.name for m in theirs.DistributedType} <= set(DistributedType.__members__)


# ------------------------------------------------------------------ state objects


def test_state_resets_and_is_initialized():
    from nbaccel import Accelerator, AcceleratorState, PartialState
    from nbaccel.state import is_initialized

    AcceleratorState._reset_state(True)
    assert not is_initialized()
    Accelerator(cpu=True, mixed_precision="bf16")
    assert is_initialized() and AcceleratorState().mixed_precision == "bf16"
    AcceleratorState._reset_state()
    assert not is_initialized() and AcceleratorState(cpu=True).mixed_precision == "no"
    PartialState._reset_state()
    assert PartialState(cpu=True).num_processes == 1


def _destroy_worker():
    import torch.distributed as dist

    from nbaccel import PartialState

    PartialState._reset_state()
    state = PartialState(cpu=True)
    state.wait_for_everyone()
    state.destroy_process_group()
    return dist.is_initialized()


def test_destroy_process_group():
    assert run_on_workers(_destroy_worker, 2) == [False, False]


# ------------------------------------------------------------------ join_uneven_inputs


class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


def _join_worker():
    from unittest.mock import Mock

    from nbaccel import Accelerator, DistributedType
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    accelerator.prepare(DataLoader(_Stream(), batch_size=1))
    messages = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=False):
            pass
        messages.append(str(caught[-1].message))
    # Accelerate's own test: pretend to be FSDP, then join a non-DDP object
    original = accelerator.state.distributed_type
    accelerator.state.distributed_type = DistributedType.FSDP
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([Mock()]):
            pass
        messages.append(str(caught[-1].message))
    accelerator.state.distributed_type = original
    messages.append(accelerator.distributed_type.value)
    return messages


def test_join_uneven_inputs_warns_where_it_cannot_apply():
    for messages in run_on_workers(_join_worker, 2):
        assert "only supported for map-style datasets" in messages[0]
        assert "only supported for multi-GPU" in messages[1]
        assert messages[2] == "MULTI_CPU"


# ------------------------------------------------------------------ accelerate.utils


def test_availability_helpers_answer_for_nbaccel():
    import nbaccel.utils as utils

    assert utils.is_wandb_available() in (True, False)
    for never in ("is_xpu_available", "is_npu_available", "is_megatron_lm_available"):
        assert getattr(utils, never)() is False  # nbaccel never drives them
    import importlib.util

    # the DeepSpeed strategy runs whenever the optional package is there
    assert utils.is_deepspeed_available() is (importlib.util.find_spec("deepspeed") is not None)
    assert utils.is_schedulefree_available(check_device=False) in (True, False)
    assert utils.is_peft_model(torch.nn.Linear(1, 1)) is False
    assert utils.is_torch_version(">=", "2.4") and utils.compare_versions("2.0", "<", "10")
    assert utils.is_cuda_available() is torch.cuda.is_available()
    from nbaccel.utils.constants import SAFE_WEIGHTS_NAME, SCALER_NAME
    from nbaccel.utils.dataclasses import DistributedType, ProfileKwargs
    from nbaccel.utils.imports import is_rich_available
    from nbaccel.utils.memory import find_executable_batch_size

    assert (SAFE_WEIGHTS_NAME, SCALER_NAME) == ("model.safetensors", "scaler.pt")
    assert DistributedType.NO and ProfileKwargs and is_rich_available and find_executable_batch_size


def test_what_nbaccel_does_not_do_fails_at_the_call_naming_the_way():
    import nbaccel
    import nbaccel.utils as utils

    for call, way in (
        (lambda: utils.MegatronLMPlugin(), "FSDP2"),
        (
            lambda: nbaccel.dispatch_model(torch.nn.Linear(1, 1), {"": 0}),
            "load_checkpoint_in_model",
        ),
        (lambda: nbaccel.infer_auto_device_map(torch.nn.Linear(1, 1)), r"model\.to\(device\)"),
        (lambda: utils.FP8RecipeKwargs(backend="te"), "torchao"),
    ):
        with pytest.raises(ConfigError, match=way):
            call()
    with nbaccel.init_empty_weights():
        layer = torch.nn.Linear(1000, 1000)
    assert layer.weight.is_meta


def test_dynamo_plugin_compiles_prepared_models():
    from nbaccel import Accelerator
    from nbaccel.utils import TorchDynamoPlugin

    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    assert hasattr(model, "_orig_mod") and accelerator.dynamo_backend == "eager"
    with pytest.raises(ConfigError, match="in one place only"):
        Accelerator(cpu=True, dynamo_backend="inductor", dynamo_plugin=TorchDynamoPlugin())


def test_logger_warning_once():
    import logging

    from nbaccel.logging import get_logger

    records = []
    logger = get_logger("once")
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger.logger.addHandler(handler)
    for _ in range(3):
        logger.warning_once("deprecated thing")
    logger.warning_once("another")
    assert records == ["deprecated thing", "another"]


# ------------------------------------------------------------------ prepare_model, timeouts


def _evaluation_mode_worker():
    from torch.nn.parallel import DistributedDataParallel

    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    accelerator = Accelerator(cpu=True)
    trained = accelerator.prepare_model(torch.nn.Linear(2, 2))
    evaluated = accelerator.prepare_model(torch.nn.Linear(2, 2), evaluation_mode=True)
    return (
        isinstance(trained, DistributedDataParallel),
        isinstance(evaluated, DistributedDataParallel),
        len(accelerator._models),
    )


def test_prepare_model_in_evaluation_mode_is_not_wrapped():
    assert run_on_workers(_evaluation_mode_worker, 2) == [(True, False, 2)] * 2


def _init_kwargs_timeout_worker(root):
    import os
    import time
    from pathlib import Path

    from nbaccel import Accelerator, InitProcessGroupKwargs
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    handler = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=3))
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    if accelerator.is_main_process:
        try:
            accelerator.wait_for_everyone()
        finally:
            Path(root, "done").touch()
    else:
        deadline = time.monotonic() + 600  # a hang guard: rank 0's word is the event
        while not os.path.exists(os.path.join(root, "done")) and time.monotonic() < deadline:
            time.sleep(0.05)  # something else, until rank 0 is done
    return "passed"


def test_init_process_group_kwargs_timeout_bounds_the_entry_check(tmp_path):
    with pytest.raises(WorkerError, match=r"did not call it within 3 s"):
        run_on_workers(_init_kwargs_timeout_worker, 2, args=(str(tmp_path),))


def _prepare_for_launch_target(path):
    import os

    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0]))
    with open(os.path.join(path, f"rank{accelerator.process_index}"), "w") as fh:
        fh.write(f"{accelerator.num_processes} {total.item():g}")
    accelerator.wait_for_everyone()


def test_prepare_for_launch_with_torch_start_processes(tmp_path, monkeypatch):
    import torch.multiprocessing as tmp

    from nbaccel.launch.testing import find_free_port
    from nbaccel.utils import PrepareForLaunch

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    launcher = PrepareForLaunch(_prepare_for_launch_target, distributed_type="MULTI_CPU")
    tmp.start_processes(launcher, args=(str(tmp_path),), nprocs=2, start_method="fork")
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["2 3", "2 3"]


# ------------------------------------------------------------------ Accelerate's parameter names


def test_utils_take_accelerates_parameter_names():
    import nbaccel.utils as utils
    from nbaccel import Accelerator, AutocastKwargs

    t = torch.ones(2, 3)
    assert utils.gather(tensor=t).shape == (2, 3) and utils.reduce(tensor=t).sum() == 6
    assert utils.broadcast(tensor=t, from_process=0) is t
    assert utils.broadcast_object_list(object_list=[1, 2]) == [1, 2]
    assert utils.gather_object(object=[5]) == [5]
    assert utils.pad_across_processes(tensor=t, dim=1).shape == (2, 3)
    assert utils.concatenate(data=[t, t], dim=1).shape == (2, 6)
    assert utils.convert_to_fp32(tensor=t.half()).dtype == torch.float32
    moved = utils.send_to_device(tensor={"a": t, "b": "keep", "c": t}, device="cpu", skip_keys="c")
    assert moved["c"] is t and moved["b"] == "keep"
    scaled = utils.recursively_apply(lambda x, k: x * k, {"a": t}, 2.0, test_type=torch.is_tensor)
    assert scaled["a"].sum() == 12
    with pytest.raises(TypeError, match="neither a container"):
        utils.recursively_apply(lambda x: x, [t, 3], error_on_other_type=True)
    inner = torch.nn.Linear(2, 2)
    outer = torch.nn.Sequential(torch.nn.DataParallel(inner))
    assert utils.extract_model_from_parallel(outer, recursive=True)[0] is inner
    g = torch.Generator().manual_seed(3)
    utils.synchronize_rng_states(["generator"], generator=g)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    loader = accelerator.prepare_data_loader(data_loader=DataLoader(list(range(4))))
    assert len(loader) == 4
    with accelerator.autocast(autocast_handler=AutocastKwargs(enabled=False)):
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32
    with accelerator.autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16


def test_load_checkpoint_in_model_takes_accelerates_arguments(tmp_path):
    from nbaccel.utils import load_checkpoint_in_model

    source = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    torch.save(source.state_dict(), tmp_path / "w.bin")
    target = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)).to(torch.float16)
    target[1].float()
    load_checkpoint_in_model(
        target, str(tmp_path / "w.bin"), dtype="float16", keep_in_fp32_modules=["1"]
    )
    assert target[0].weight.dtype == torch.float16 and target[1].weight.dtype == torch.float32
    torch.testing.assert_close(target[0].weight.float(), source[0].weight, atol=1e-3, rtol=0)
    with pytest.raises(ConfigError, match="offloads a dispatched model"):
        load_checkpoint_in_model(target, str(tmp_path / "w.bin"), offload_folder="off")


def test_small_helpers_of_accelerate_utils(tmp_path, monkeypatch):
    import os

    import nbaccel.utils as utils

    assert utils.listify({"a": torch.tensor([1, 2])}) == {"a": [1, 2]}
    assert utils.slice_tensors({"a": torch.arange(5)}, slice(1, 3))["a"].tolist() == [1, 2]
    utils.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert utils.load(tmp_path / "w.pt")["w"].sum() == 2
    monkeypatch.setenv("SOMETHING", "1")
    with utils.clear_environment():
        assert "SOMETHING" not in os.environ
    assert os.environ["SOMETHING"] == "1"
    assert utils.get_max_memory()["cpu"] > 0
    forward = utils.convert_outputs_to_fp32(lambda x: x.half())
    assert forward(torch.ones(1)).dtype == torch.float32


def test_state_and_data_loader_names_of_accelerate():
    from nbaccel import Accelerator, AcceleratorState, PartialState
    from nbaccel.data_loader import (
        BatchSamplerShard,
        DataLoaderDispatcher,
        DataLoaderShard,
        IterableDatasetShard,
        SeedableRandomSampler,
    )

    state = PartialState(cpu=True)
    state.set_device()
    assert state.default_device.type == "cpu" and state.fork_launched is False
    accelerator = Accelerator(cpu=True)
    assert AcceleratorState().is_fsdp2 is False and accelerator.scaler is None
    assert accelerator.should_save_model
    loader = accelerator.prepare(DataLoader(list(range(4)), batch_size=2))
    assert isinstance(loader, DataLoaderShard) and DataLoaderDispatcher is DataLoaderShard
    assert BatchSamplerShard and IterableDatasetShard
    inside = []
    for _ in loader:
        inside.append(accelerator.gradient_state.in_dataloader)
    assert inside == [True, True] and not accelerator.gradient_state.in_dataloader
    sampler = SeedableRandomSampler(range(6), data_seed=4)
    assert list(sampler) != list(sampler)  # the epoch advances: another order
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(0)
    assert list(sampler) == first
