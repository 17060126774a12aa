"""The peer's documented API, ported: each name used as its documentation shows.

Distributed behaviour runs on a real 2-process gloo group (``run_on_workers``).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from nbaccel.errors import ConfigError
from nbaccel.launch.testing import run_on_workers

# ------------------------------------------------------------------ PartialState & co.


def _partial_state_first():
    from nbaccel import Accelerator, AcceleratorState, PartialState
    from nbaccel.state import PartialState as StatePartialState

    state = PartialState()  # before any Accelerator, as scripts do at the top
    out = {
        "facts": (
            state.process_index,
            state.local_process_index,
            state.num_processes,
            state.is_main_process,
            state.is_local_main_process,
            state.distributed_type.value,
            state.use_distributed,
            state.device.type,
        ),
        "same_class": StatePartialState is PartialState,
    }
    order = []
    with state.main_process_first():
        order.append(state.process_index)
    state.wait_for_everyone()
    with state.split_between_processes(["a", "b", "c"]) as mine:
        out["mine"] = mine
    out["main_only"] = state.on_main_process(lambda: "ran")()
    accelerator = Accelerator(mixed_precision="bf16")
    out["shared"] = accelerator.state.process_state is state.process_state
    out["acc_state"] = (accelerator.state.mixed_precision, accelerator.state.num_processes)
    out["later_state"] = AcceleratorState().mixed_precision  # the last Accelerator's
    out["repr"] = repr(accelerator.state)
    return out


def test_partial_state_before_and_with_an_accelerator():
    for rank, out in enumerate(run_on_workers(_partial_state_first, num_processes=2)):
        assert out["facts"] == (rank, rank, 2, rank == 0, rank == 0, "MULTI_CPU", True, "cpu")
        assert out["same_class"] and out["shared"]
        assert out["mine"] == (["a", "b"] if rank == 0 else ["c"])
        assert out["main_only"] == ("ran" if rank == 0 else None)
        assert out["acc_state"] == ("bf16", 2) and out["later_state"] == "bf16"
        assert "mixed_precision='bf16'" in out["repr"]


def test_partial_state_in_one_process_and_bad_keywords():
    from nbaccel import PartialState

    state = PartialState(cpu=True)
    assert (state.num_processes, state.process_index, state.rank) == (1, 0, 0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        PartialState(mixed_precision="bf16")


# ------------------------------------------------------------------ accumulation plugin


def _plugin_training(plugin_kwargs):
    from nbaccel import Accelerator, GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(**plugin_kwargs)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(12.0).reshape(6, 2), torch.ones(6, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=1))
    grads_equal, syncs = [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            both = accelerator.gather(model.module.weight.grad[None])
            grads_equal.append(bool(torch.equal(both[0], both[1])))
            syncs.append(accelerator.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
    return accelerator.gradient_accumulation_steps, syncs, grads_equal, accelerator.step


def test_gradient_accumulation_plugin():
    default = run_on_workers(_plugin_training, 2, args=({"num_steps": 2},))
    for steps, syncs, grads_equal, updates in default:
        assert steps == 2 and syncs == [False, True, True] and updates == 2
        assert grads_equal == [False, True, True]  # the last batch syncs (end of loader)
    each = run_on_workers(_plugin_training, 2, args=({"num_steps": 2, "sync_each_batch": True},))
    for _, _syncs, grads_equal, _ in each:
        assert grads_equal == [True, True, True]  # all-reduced on every micro-step
    no_end = run_on_workers(
        _plugin_training, 2, args=({"num_steps": 2, "sync_with_dataloader": False},)
    )
    for _, syncs, _, updates in no_end:
        assert syncs == [False, True, False] and updates == 1


def test_gradient_accumulation_plugin_conflicts_and_validation():
    from nbaccel import Accelerator, GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=4)
    assert Accelerator(gradient_accumulation_plugin=plugin).gradient_accumulation_steps == 4
    with pytest.raises(ConfigError, match="conflicts with gradient_accumulation_plugin"):
        Accelerator(gradient_accumulation_plugin=plugin, gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match="num_steps=0"):
        GradientAccumulationPlugin(num_steps=0)


# ------------------------------------------------------------------ dispatch_batches


class OnlyRankZeroCanRead(IterableDataset):
    """A stream that cannot be sharded: reading it anywhere but rank 0 is an error."""

    def __iter__(self):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:
            raise RuntimeError("rank != 0 read the stream")
        for i in range(11):
            yield {"x": torch.tensor([float(i)]), "id": i}


def _dispatch(split):
    from nbaccel import Accelerator, DataLoaderConfiguration

    config = DataLoaderConfiguration(dispatch_batches=True, split_batches=split)
    accelerator = Accelerator(dataloader_config=config)
    loader = accelerator.prepare(DataLoader(OnlyRankZeroCanRead(), batch_size=4 if split else 2))
    sizes, ids = [], []
    for batch in loader:
        sizes.append(len(batch["id"]))
        ids += accelerator.gather_for_metrics(batch["id"]).tolist()
    return sizes, ids, accelerator.dispatch_batches


@pytest.mark.parametrize("split", [False, True])
def test_dispatch_batches_reads_on_rank_zero_only(split):
    for sizes, ids, flag in run_on_workers(_dispatch, 2, args=(split,)):
        assert flag and ids == list(range(11))  # each sample once, in the stream's order
        assert sizes == [2, 2, 2]  # 4 + 4 + 3 samples per step; the last completed


# ------------------------------------------------------------------ join, triggers, sync


def _uneven():
    from nbaccel import Accelerator

    accelerator = Accelerator(even_batches=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(5, 2), torch.randn(5, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=1))
    steps = 0
    with accelerator.join_uneven_inputs([model]):
        for x, y in loader:  # rank 0 has 3 batches, rank 1 has 2
            optimizer.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            steps += 1
    with accelerator.join_uneven_inputs([model], even_batches=True):
        overridden = len(loader)
    return steps, overridden, len(loader)


def test_join_uneven_inputs_finishes():
    results = run_on_workers(_uneven, 2)
    assert [r[0] for r in results] == [3, 2]
    assert [r[1] for r in results] == [3, 3] and [r[2] for r in results] == [3, 2]


def _triggers_and_sync():
    from nbaccel import Accelerator

    accelerator = Accelerator()
    rank = accelerator.process_index
    checks = [accelerator.check_trigger()]
    if rank == 1:
        accelerator.set_trigger()
    checks += [accelerator.check_trigger(), accelerator.check_trigger()]
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    x = torch.full((1, 2), float(rank + 1))
    with accelerator.no_sync(model):
        loss_a = model(x).sum()
    with accelerator.trigger_sync_in_backward(model):
        loss_b = model(x).sum()  # nothing forces a sync here but the trigger context
        (loss_a + loss_b).backward()
    grad = model.module.weight.grad[None]
    both = accelerator.gather(grad)
    return checks, bool(torch.equal(both[0], both[1])), both[0].tolist()


def test_check_trigger_is_true_everywhere_and_sync_in_backward():
    for checks, synced, grad in run_on_workers(_triggers_and_sync, 2):
        assert checks == [False, True, False]
        assert synced and grad == [[3.0, 3.0]]  # mean of 2*(1) and 2*(2)


# ------------------------------------------------------------------ checkpoint hooks


def test_save_and_load_state_pre_hooks(tmp_path):
    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    first, second = accelerator.prepare(first, second)
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", len(models), sorted(weights[1]), type(output_dir).__name__))
        torch.save(accelerator.unwrap_model(models[1]).state_dict(), f"{output_dir}/own.pt")
        weights.pop(1)  # saved by the hook itself

    def load_hook(models, input_dir):
        calls.append(("load", len(models), os.path.isfile(f"{input_dir}/own.pt")))
        models.pop(1).load_state_dict(torch.load(f"{input_dir}/own.pt"))

    save_handle = accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    saved = accelerator.save_state(tmp_path / "ckpt")
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert "own.pt" in files and "model.safetensors" in files and "model_1.safetensors" not in files
    expected = second.weight.detach().clone()
    with torch.no_grad():
        second.weight.zero_()
    accelerator.load_state(saved)
    assert torch.equal(second.weight, expected)
    assert calls == [
        ("save", 2, ["bias", "weight"], "str"),
        ("load", 2, True),
    ]
    save_handle.remove()
    accelerator.register_load_state_pre_hook(lambda models, input_dir: None)
    with pytest.raises(TypeError, match="needs a callable"):
        accelerator.register_save_state_pre_hook("not callable")


# ------------------------------------------------------------------ models, compile, loaders


_DYNAMO_SCRIPT = """
import torch
from nbaccel import Accelerator
from nbaccel.errors import ConfigError

accelerator = Accelerator(cpu=True, dynamo_backend="eager")
model = torch.nn.Linear(2, 1)
prepared = accelerator.prepare(model)
assert type(prepared).__name__ == "OptimizedModule"
assert prepared(torch.ones(1, 2)).shape == (1, 1)
assert accelerator.unwrap_model(prepared, keep_torch_compile=False) is model
kept = accelerator.unwrap_model(prepared)
assert type(kept).__name__ == "OptimizedModule" and kept._orig_mod is model
assert prepared._orig_mod is model  # the prepared model itself is untouched
try:
    Accelerator(dynamo_backend="nope")
except ConfigError as err:
    assert "dynamo_backend='nope'" in str(err), err
else:
    raise AssertionError("dynamo_backend='nope' was accepted")
print("ok")
"""


def test_dynamo_backend_and_unwrap_model_keep_torch_compile():
    # In a fresh interpreter: after torch.compile has run in a process, torch >= 2.14
    # refuses autograd in children forked from it ("Unable to handle autograd's threading
    # in combination with fork-based multiprocessing"), which would break every later
    # fork-based test of this pytest process.
    proc = subprocess.run(
        [sys.executable, "-c", _DYNAMO_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_prepare_data_loader_positional_signature():
    from nbaccel.data_loader import prepare_data_loader as from_data_loader
    from nbaccel.utils import prepare_data_loader

    assert from_data_loader is prepare_data_loader
    loader = DataLoader(list(range(8)), batch_size=2)
    # (dataloader, device, num_processes, process_index, split_batches, put_on_device)
    shard = prepare_data_loader(loader, torch.device("cpu"), 2, 1, False, True)
    assert [b.tolist() for b in shard] == [[2, 3], [6, 7]]
    with pytest.raises(ConfigError, match="slice_fn_for_dispatch"):
        prepare_data_loader(loader, slice_fn_for_dispatch=lambda *a: a)


UTILS_NAMES = [
    "set_seed", "ProjectConfiguration", "DistributedDataParallelKwargs", "GradScalerKwargs",
    "InitProcessGroupKwargs", "DataLoaderConfiguration", "GradientAccumulationPlugin",
    "DistributedType", "LoggerType", "PrecisionType", "gather", "gather_object", "broadcast",
    "pad_across_processes", "reduce", "send_to_device", "release_memory",
    "find_executable_batch_size", "AutocastKwargs", "write_basic_config", "tqdm",
    "extract_model_from_parallel", "skip_first_batches", "patch_environment", "RNGType",
    "wait_for_everyone",
]  # fmt: skip


def test_peer_import_paths_resolve():
    import nbaccel

    utils = importlib.import_module("nbaccel.utils")
    for name in UTILS_NAMES:
        assert getattr(utils, name) is not None, name
    state = importlib.import_module("nbaccel.state")
    assert nbaccel.PartialState is state.PartialState
    assert nbaccel.AcceleratorState is state.AcceleratorState
    assert nbaccel.GradientAccumulationPlugin is utils.GradientAccumulationPlugin
    tracking = importlib.import_module("nbaccel.tracking")
    assert tracking.GeneralTracker and tracking.on_main_process and tracking.LoggerType
    assert utils.PrecisionType.BF16 == "bf16" and utils.reduce(torch.tensor([2.0])).tolist() == [
        2.0
    ]
    with pytest.raises(AttributeError):
        utils.no_such_name  # noqa: B018


def test_find_executable_batch_size_and_release_memory():
    from nbaccel.utils import find_executable_batch_size, release_memory

    tried = []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return batch_size * scale

    # Accelerate's rule: 0.9 times the last size after each out-of-memory error
    assert train(10) == 40 and tried == [16, 14, 12, 10, 9, 8, 7, 6, 5, 4]

    halved = []

    @find_executable_batch_size(
        starting_batch_size=16, reduce_batch_size_fn=lambda: halved[-1] // 2
    )
    def halving(batch_size):
        halved.append(batch_size)
        if batch_size > 4:
            raise RuntimeError("CUDA out of memory.")
        return batch_size

    assert halving() == 4 and halved == [16, 8, 4]  # the custom rule, also as a decorator
    a, b = release_memory(torch.ones(1), torch.ones(1))
    assert a is None and b is None


def test_distributed_type_names_of_the_peer():
    from nbaccel import DistributedType

    assert DistributedType.TPU is DistributedType.XLA  # the older name
    assert DistributedType.DEEPSPEED != DistributedType.MULTI_GPU


def _logging():
    import logging

    from nbaccel import PartialState
    from nbaccel.logging import get_logger

    state = PartialState()
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = get_logger("ported", log_level="INFO")
    logger.logger.addHandler(handler)
    logger.info("main only")
    logger.info("everyone %d", state.process_index, main_process_only=False)
    logger.warning("in order", in_order=True)
    logger.debug("below the level", main_process_only=False)
    return records


def test_get_logger_logs_on_the_main_process_by_default():
    rank0, rank1 = run_on_workers(_logging, 2)
    assert rank0 == ["main only", "everyone 0", "in order"]
    assert rank1 == ["everyone 1", "in order"]
