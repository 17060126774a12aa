"""Accelerate's ``ParallelismConfig`` trained on 4 real CPU processes over gloo.

One launch per layout (HSDP; tensor parallel x FSDP2), each proving several things at
once: the ``DeviceMesh`` and its flattened dimensions, which batches each rank reads,
the parameters' sharding, losses and clipped norms equal to one plain-torch process on
the global batch, ``gather_for_metrics`` keeping one copy per data-parallel share,
consolidated weights (``get_state_dict``, ``save_model``) and an exact resume through
``save_state``/``load_state`` (sharded, torch.distributed.checkpoint).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~3 s): once here, not in every worker

from nbaccel.launch.testing import run_on_workers
from nbaccel.platform import torchcompat

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not torchcompat.fsdp_supported(), reason="FSDP2 / DeviceMesh need a newer torch"
    ),
]

STEPS, GLOBAL_BATCH, MAX_NORM = 4, 8, 0.5


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * GLOBAL_BATCH, 4, generator=g)
    return x, torch.sin(x) @ torch.randn(4, 4, generator=g)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _reference():
    """One process, no parallelism: losses per data shard (2 shards), norms, weights."""
    x, y = _data()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, norms, half = [], [], GLOBAL_BATCH // 2
    for step in range(STEPS):
        xb, yb = x[step * GLOBAL_BATCH :][:GLOBAL_BATCH], y[step * GLOBAL_BATCH :][:GLOBAL_BATCH]
        with torch.no_grad():
            out = model(xb)
            losses.append(
                [
                    float(torch.nn.functional.mse_loss(out[i : i + half], yb[i : i + half]))
                    for i in (0, half)
                ]
            )
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}


def _train(sizes, directory):
    """Run on every rank: train STEPS steps with a save at step 2, then resume from it."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
    from nbaccel.utils import TorchTensorParallelConfig

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    config = ParallelismConfig(**sizes, tp_handler=TorchTensorParallelConfig(plan=plan))
    acc = Accelerator(
        parallelism_config=config, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)
    )
    mesh = acc.torch_device_mesh
    dims = {n: mesh[n].size() for n in [*config.active_mesh_dims, "dp", "dp_shard_cp", "dp_cp"]}
    x, y = _data()
    dp = config.data_parallel_size
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // dp)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    placements = sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)})
    local = sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
    )

    def run(skip):
        losses, norms, firsts, gathered = [], [], [], []
        for step, (xb, yb) in enumerate(loader):
            if step < skip:
                continue
            firsts.append(float(xb[0, 0]))
            out = model(xb)
            gathered.append(acc.gather_for_metrics(out.detach().clone()).shape[0])
            loss = torch.nn.functional.mse_loss(out, yb)
            acc.backward(loss)
            norms.append(float(acc.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
            if step == 1 and skip == 0:
                acc.save_state(directory)
        return losses, norms, firsts, gathered

    from nbaccel.data_loader import prepare_data_loader

    by_mesh = prepare_data_loader(DataLoader(range(16), batch_size=2), torch_device_mesh=mesh)
    mesh_first = next(iter(by_mesh)).tolist()
    first = run(0)
    full = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    acc.save_model(model, f"{directory}-model")
    acc.load_state(directory)
    resumed_step = acc.step
    second = run(2)
    again = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    dist.barrier()
    return {
        "rank": acc.process_index,
        "dims": dims,
        "distributed_type": acc.distributed_type.value,
        "kinds": kinds,
        "placements": placements,
        "local": local,
        "first": first,
        "second": second,
        "resumed_step": resumed_step,
        "full": full,
        "again": again,
        "mesh_first": mesh_first,
    }


LAYOUTS = {
    "hsdp": {"dp_replicate_size": 2, "dp_shard_size": 2},
    "tp_fsdp": {"dp_shard_size": 2, "tp_size": 2},
}


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / "ckpt"
    results = run_on_workers(_train, 4, args=(LAYOUTS[request.param], str(directory)))
    return request.param, results, directory


def test_the_mesh_has_accelerates_dimension_names_flattened_ones_included(layout):
    name, results, _ = layout
    dims = results[0]["dims"]
    if name == "hsdp":
        assert dims == {"dp_replicate": 2, "dp_shard": 2, "dp": 4, "dp_shard_cp": 2, "dp_cp": 4}
        assert results[0]["distributed_type"] == "FSDP"
    else:
        assert dims == {"dp_shard": 2, "tp": 2, "dp": 2, "dp_shard_cp": 2, "dp_cp": 2}
        assert results[0]["distributed_type"] == "FSDP"


def test_ranks_of_one_tensor_parallel_group_read_the_same_batches(layout):
    name, results, _ = layout
    firsts = [r["first"][2] for r in results]
    x, _ = _data()
    if name == "hsdp":  # 4 data shards of 2 samples: each rank its own
        assert len({tuple(f) for f in firsts}) == 4
    else:  # ranks 0,1 (one TP group) read shard 0, ranks 2,3 shard 1
        assert firsts[0] == firsts[1] != firsts[2] == firsts[3]
        assert firsts[0][0] == pytest.approx(float(x[0, 0]))
        assert firsts[2][0] == pytest.approx(float(x[4, 0]))
    # prepare_data_loader(torch_device_mesh=...): Accelerate's function, the same sharding
    expected = [[0, 1], [2, 3], [4, 5], [6, 7]] if name == "hsdp" else [[0, 1]] * 2 + [[2, 3]] * 2
    assert [r["mesh_first"] for r in results] == expected
    # gather_for_metrics: one copy per data-parallel share, the global batch
    assert all(r["first"][3] == [GLOBAL_BATCH] * STEPS for r in results)


def test_parameters_are_dtensors_sharded_over_every_process(layout):
    name, results, _ = layout
    total = sum(p.numel() for p in _model().parameters())
    assert all(r["kinds"] == ["DTensor"] for r in results)
    if name == "tp_fsdp":  # a quarter each: split by TP, then by FSDP
        assert any("Shard" in p and "," in p for p in results[0]["placements"])
        # ... but the row-wise layer's bias (4 values) is whole on both TP ranks
        assert sum(r["local"] for r in results) == total + 4
    else:  # HSDP: replicated twice, sharded in two
        assert sum(r["local"] for r in results) == 2 * total
        assert all("Replicate(), Shard(dim=0)" in p for p in results[0]["placements"])


def test_losses_norms_and_weights_equal_one_plain_process(layout, reference):
    name, results, _ = layout
    ref_losses, ref_norms, ref_weights = reference
    for r in results:
        losses, norms, _, _ = r["first"]
        if name == "hsdp":  # 4 shards of 2 samples: rank's loss is over its quarter
            assert len(losses) == STEPS
        else:
            half = r["rank"] // 2  # tp innermost: ranks 0,1 read the first half
            assert losses == pytest.approx([row[half] for row in ref_losses], rel=1e-5, abs=1e-6)
        assert norms == pytest.approx(ref_norms, rel=1e-5)
    # HSDP losses: the mean over the four ranks is the global loss
    if name == "hsdp":
        means = [sum(r["first"][0][s] for r in results) / 4 for s in range(STEPS)]
        assert means == pytest.approx([sum(row) / 2 for row in ref_losses], rel=1e-5)
    full = results[0]["full"]
    assert sorted(full) == sorted(ref_weights)
    for key, value in ref_weights.items():
        assert type(full[key]) is torch.Tensor and full[key].shape == value.shape
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6)


def test_save_model_writes_full_weights(layout, reference):
    _, _, directory = layout
    from safetensors.torch import load_file

    saved = load_file(f"{directory}-model/model.safetensors")
    for key, value in reference[2].items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-6)


def test_resume_from_a_sharded_checkpoint_continues_exactly(layout):
    _, results, directory = layout
    assert (directory / "model.dcp").is_dir() or any(directory.glob("model*.dcp"))
    for r in results:
        assert r["resumed_step"] == 2
        assert r["second"][0] == r["first"][0][2:]  # bit for bit
        assert r["second"][1] == r["first"][1][2:]
    for key, value in results[0]["full"].items():
        assert torch.equal(results[0]["again"][key], value)


def _tensor_parallel_from_the_launch_configuration(directory):
    """2 ranks, sizes from NBACCEL_PARALLELISM_CONFIG_TP_SIZE; the user parallelises on the
    ``tp`` mesh before prepare (Accelerate's way), nbaccel checks it is that mesh."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from nbaccel import Accelerator

    acc = Accelerator()
    config, mesh = acc.parallelism_config, acc.torch_device_mesh
    model = parallelize_module(
        _model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer = acc.prepare(model, optimizer)
    x, y = _data()
    losses = []
    for step in range(STEPS):
        xb, yb = x[step * GLOBAL_BATCH :][:GLOBAL_BATCH], y[step * GLOBAL_BATCH :][:GLOBAL_BATCH]
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        if step == 1:
            acc.save_state(directory)
    full = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    acc.load_state(directory)
    after = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    return {
        "sizes": (config.tp_size, config.dp_shard_size, acc.distributed_type.value),
        "dims": mesh.mesh_dim_names,
        "losses": losses,
        "full": full,
        "restored_step": acc.step,
        "restored_differs": any(not torch.equal(after[k], full[k]) for k in full),
    }


def test_tensor_parallel_alone_from_the_launch_configuration(tmp_path):
    env = {"NBACCEL_PARALLELISM_CONFIG_TP_SIZE": "2"}
    results = run_on_workers(
        _tensor_parallel_from_the_launch_configuration, 2, args=(str(tmp_path / "c"),), env=env
    )
    first = results[0]
    assert first["sizes"] == (2, 1, "MULTI_CPU") and first["dims"] == ("tp",)
    # the whole global batch on both ranks (no data parallel): one process's numbers
    x, y = _data()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    expected = []
    for step in range(STEPS):
        xb, yb = x[step * GLOBAL_BATCH :][:GLOBAL_BATCH], y[step * GLOBAL_BATCH :][:GLOBAL_BATCH]
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        expected.append(float(loss.detach()))
    assert all(r["losses"] == pytest.approx(expected, rel=1e-5) for r in results)
    for key, value in model.state_dict().items():  # full tensors gathered from the TP shards
        torch.testing.assert_close(first["full"][key], value, rtol=1e-5, atol=1e-6)
    assert first["restored_step"] == 2 and first["restored_differs"]  # back at step 2


class _SavesLikeTransformers(torch.nn.Module):
    """A module with transformers' ``save_pretrained(dir, state_dict=...)`` whose write fails
    on the main process (a full disk, a bad path)."""

    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x):
        return self.net(x)

    def save_pretrained(self, save_directory, state_dict=None):
        import torch.distributed as dist

        if dist.get_rank() == 0:
            raise OSError(f"[Errno 28] No space left on device: {save_directory!r}")


def _save_pretrained_fails_on_the_main_process(directory):
    import time

    from nbaccel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    model = acc.prepare(_SavesLikeTransformers())
    start = time.monotonic()
    try:
        model.save_pretrained(directory)
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return None, None, time.monotonic() - start


def test_a_failed_save_pretrained_on_the_main_process_is_raised_on_every_rank(tmp_path):
    """The other ranks used to wait in a barrier until the process group timed out."""
    results = run_on_workers(
        _save_pretrained_fails_on_the_main_process, 2, args=(str(tmp_path / "m"),)
    )
    (kind0, text0, _), (kind1, text1, seconds1) = results
    assert kind0 == "OSError" and "No space left on device" in text0  # its own error
    assert kind1 == "SavePretrainedError"
    assert "failed on the main process (rank 0)" in text1 and "No space left" in text1
    assert seconds1 < 30  # told at once, not at a timeout


def _one_config_object_for_several_accelerators(shared, tp_sized):
    """Several Accelerators in one worker from the same two config objects: each gets its
    own completed copy and mesh; the caller's objects stay as they were made."""
    import warnings

    from nbaccel import Accelerator

    first = Accelerator(parallelism_config=shared)
    seen = {
        "completed": first.parallelism_config.dp_replicate_size,
        "shared_after": (shared.dp_replicate_size, shared.device_mesh is None),
        "distinct": first.parallelism_config is not shared,
    }
    meshes = []
    for _ in range(2):
        acc = Accelerator(parallelism_config=tp_sized)
        meshes.append(acc.torch_device_mesh)
    seen["tp_sized_after"] = tp_sized.device_mesh is None
    seen["new_mesh_each_time"] = meshes[0] is not meshes[1]
    # a frozen model is not split by tensor parallel: said, not silent
    frozen = _model().requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = acc.prepare(frozen)
    seen["frozen_kinds"] = sorted({type(p).__name__ for p in prepared.parameters()})
    seen["warnings"] = [str(w.message) for w in caught if "no trainable" in str(w.message)]
    return seen


def test_one_config_object_serves_two_launches_of_other_sizes_untouched():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from nbaccel import ParallelismConfig
    from nbaccel.utils import TorchTensorParallelConfig

    shared = ParallelismConfig()  # all 1: replicate over however many processes there are
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    for processes, tp_sized in (
        (2, ParallelismConfig(tp_size=2, tp_handler=TorchTensorParallelConfig(plan=plan))),
        (
            4,
            ParallelismConfig(
                dp_shard_size=2, tp_size=2, tp_handler=TorchTensorParallelConfig(plan=plan)
            ),
        ),
    ):
        results = run_on_workers(
            _one_config_object_for_several_accelerators, processes, args=(shared, tp_sized)
        )
        for rank, seen in enumerate(results):
            assert seen["completed"] == processes  # this launch's size, not the last one's
            assert seen["shared_after"] == (1, True) and seen["distinct"]
            assert seen["tp_sized_after"] and seen["new_mesh_each_time"]
            assert seen["frozen_kinds"] == ["Parameter"]  # whole: neither split nor sharded
            if rank == 0:
                (message,) = seen["warnings"]
                assert "tensor parallel (tp_size=2) is not applied" in message
                assert "every rank holds the whole model" in message
                assert "parallelize_module" in message
            else:
                assert seen["warnings"] == []  # said once, by the main process
    assert (shared.dp_replicate_size, shared.device_mesh) == (1, None)


def _gathered_after_forward():
    """After forward, before backward: are the root's parameters still gathered, for
    nbaccel's FSDP2 and for the same model with torch's fully_shard by hand?"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from nbaccel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    ours = acc.prepare(_model())
    by_hand = fully_shard(_model(), mesh=init_device_mesh("cpu", (2,)))
    seen = {}
    for name, model in (("nbaccel", ours), ("by hand", by_hand)):
        loss = model(torch.ones(2, 4)).sum()
        seen[name] = not any(isinstance(p, DTensor) for p in model.parameters())
        loss.backward()
    return seen


def test_the_root_keeps_its_parameters_gathered_until_backward_as_torch_by_hand():
    """An explicit reshard_after_forward=True on the root freed them after forward and
    all-gathered them again for backward: one all-gather per step more than torch's default
    (the TP x FSDP2 bench's 1.21x, bench/RESULTS_MESH.md)."""
    for seen in run_on_workers(_gathered_after_forward, 2):
        assert seen == {"nbaccel": True, "by hand": True}
