"""Accelerate's ``nd_parallel.py`` (ported by the import) on 4 CPU processes over gloo.

The script runs in ``notebook_launcher``'s engine (forked workers: transformers is imported
once, here, not by four fresh interpreters on a loaded 2-core machine). FSDP
(``--dp-shard-size 4``) and HSDP (``--dp-replicate-size 2 --dp-shard-size 2``) train to the
script's last line, ``model.save_pretrained`` on the sharded model, which writes full
weights equal to one plain process that trained on the same global batches; each step's
loss equals that process's; HSDP resumed from its sharded checkpoint continues exactly.
TP x FSDP (``--dp-shard-size 2 --tp-size 2``): this transformers builds its own mesh and
would stop inside ``from_pretrained``; nbaccel refuses in ``Accelerator(...)``, before the
model is loaded, saying why and what runs instead.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from nbaccel.errors import ConfigError, WorkerError
from nbaccel.launch.testing import run_on_workers
from nbaccel.platform import torchcompat

transformers = pytest.importorskip("transformers", reason="the script trains a transformers Llama")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torchcompat.fsdp_supported(), reason="FSDP2 needs a newer torch"),
]

SCRIPT = Path(__file__).resolve().parent / "nd_parallel.py"
STEPS, SEQ = 4, 16


def _run_script(argv):
    sys.argv = [str(SCRIPT), *argv]
    runpy.run_path(str(SCRIPT), run_name="__main__")


def _launch(tmp, name, *args):
    out = tmp / f"{name}.json"
    argv = [*args, "--num-steps", str(STEPS), "--checkpoint-frequency", "2"]
    argv += ["--sequence-length", str(SEQ), "--model-name", str(tmp / "tiny-llama")]
    argv += ["--save-dir", str(tmp / name), "--out", str(out)]
    run_on_workers(_run_script, 4, args=(argv,), env={"HF_HUB_OFFLINE": "1"})
    result = json.loads(out.read_text())
    return {int(k): v for k, v in result["losses"].items()}, result["step"]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    path = tmp_path_factory.mktemp("nd")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path / "tiny-llama")
    return path


@pytest.fixture(scope="module")
def reference(tmp):
    """One plain process: the same model, data and SGD on each global batch of 4 sequences."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from nd_parallel import TokenDataset, create_collate_fn
    finally:
        sys.path.remove(str(SCRIPT.parent))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp / "tiny-llama", dtype=torch.float32
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
    data = TokenDataset(64, SEQ, model.config.vocab_size)
    collate = create_collate_fn()
    losses = {}
    for step in range(STEPS):
        rows = collate([data[i] for i in range(4 * step, 4 * step + 4)])
        batch = {k: v.contiguous() for k, v in rows.items()}
        batch["position_ids"] = torch.arange(SEQ).unsqueeze(0)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = float(loss.detach())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _saved(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def hsdp(tmp):
    return _launch(tmp, "hsdp", "--dp-replicate-size", "2", "--dp-shard-size", "2")


def test_fsdp_trains_to_save_pretrained_with_one_process_numbers(tmp, reference):
    losses, step = _launch(tmp, "fsdp", "--dp-shard-size", "4")
    assert step == STEPS
    assert losses == pytest.approx(reference[0], rel=1e-5)
    saved = _saved(tmp / "fsdp")
    assert sorted(saved) == sorted(reference[1])
    for key, value in reference[1].items():  # full tensors, the trained values
        torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=1e-5)
    assert (tmp / "fsdp" / "checkpoint-2").is_dir()


def test_hsdp_trains_to_save_pretrained_with_one_process_numbers(tmp, reference, hsdp):
    losses, step = hsdp
    assert step == STEPS
    assert losses == pytest.approx(reference[0], rel=1e-5)
    saved = _saved(tmp / "hsdp")
    for key, value in reference[1].items():
        torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=1e-5)


def test_hsdp_resumed_from_its_sharded_checkpoint_continues_exactly(tmp, hsdp):
    checkpoint = tmp / "hsdp" / "checkpoint-2"
    assert any(checkpoint.glob("*.dcp"))  # sharded: torch.distributed.checkpoint
    full = _saved(tmp / "hsdp")
    losses, step = _launch(
        tmp,
        "resumed",
        "--dp-replicate-size",
        "2",
        "--dp-shard-size",
        "2",
        "--resume-from",
        str(checkpoint),
    )
    assert step == STEPS
    assert losses == {3: hsdp[0][3]}  # the step after the checkpoint, bit for bit
    resumed = _saved(tmp / "resumed")
    for key, value in full.items():
        assert torch.equal(resumed[key], value), key


def test_tensor_parallel_through_transformers_own_mesh_is_refused_by_nbaccel_before_loading(
    tmp,
):
    """transformers 5.x ignores device_mesh= and would stop inside from_pretrained; nbaccel
    refuses in Accelerator(...), before the model is loaded, naming the version and plan=."""
    with pytest.raises(WorkerError) as caught:
        _launch(tmp, "tp", "--dp-shard-size", "2", "--tp-size", "2")
    assert isinstance(caught.value, ConfigError)  # nbaccel's error, not transformers'
    text = str(caught.value)
    assert f"transformers {transformers.__version__} ignores device_mesh=" in text
    assert "TorchTensorParallelConfig(plan='auto')" in text
    assert "The parallel mesh requires" in text  # what transformers would have said
    assert "modeling_utils.py" not in caught.value.remote_traceback  # loading never began
    assert not (tmp / "tp.json").exists() and not (tmp / "tp").exists()


def _llama_with_its_own_plan(model_dir):
    """TP x FSDP2 of the tiny Llama through its own tp_plan, applied by nbaccel on the tp mesh."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from nbaccel import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
    from nbaccel.utils import TorchTensorParallelConfig

    sys.path.insert(0, str(SCRIPT.parent))
    from nd_parallel import TokenDataset, create_collate_fn

    config = ParallelismConfig(
        dp_shard_size=2, tp_size=2, tp_handler=TorchTensorParallelConfig(plan="auto")
    )
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    acc = Accelerator(parallelism_config=config, fsdp_plugin=plugin)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
    data = TokenDataset(64, SEQ, model.config.vocab_size)
    loader = DataLoader(data, batch_size=2, collate_fn=create_collate_fn())
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    group = acc.torch_device_mesh["dp"].get_group()
    losses = {}
    for step, rows in enumerate(loader):
        if step == STEPS:
            break
        batch = {k: v.contiguous() for k, v in rows.items()}
        loss = model(**batch).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
        losses[step] = loss.item()
    weights = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    tp_params = sum(
        type(p).__name__ == "DTensor" and len(p.placements) == 2 for p in model.parameters()
    )
    return losses, weights, tp_params


def test_tensor_parallel_through_the_models_own_plan_on_nbaccels_tp_mesh(tmp, reference):
    results = run_on_workers(
        _llama_with_its_own_plan,
        4,
        args=(str(tmp / "tiny-llama"),),
        env={"HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    losses, weights, tp_params = results[0]
    assert tp_params > 0  # (dp_shard, tp) placements: sharded by FSDP2 and by TP
    assert losses == pytest.approx(reference[0], rel=1e-5)
    for key, value in reference[1].items():
        torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5)


def _hsdp_by_hand(model_dir):
    """The script's HSDP run written with torch alone: the mesh, fully_shard per decoder
    layer then the root, SGD, rank r reading sample 4*step + r, the loss averaged."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(SCRIPT.parent))
    from nd_parallel import TokenDataset, create_collate_fn

    torch.manual_seed(42)  # the script's set_seed(42)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, use_cache=False
    )
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
    data, collate = TokenDataset(64, SEQ, model.config.vocab_size), create_collate_fn()
    losses = {}
    for step in range(STEPS):
        batch = collate([data[4 * step + dist.get_rank()]])
        batch["position_ids"] = torch.arange(SEQ).unsqueeze(0)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses[step] = loss.item()
    return losses


def test_hsdp_losses_equal_the_same_parallelisation_written_by_hand(tmp, hsdp):
    by_hand = run_on_workers(
        _hsdp_by_hand, 4, args=(str(tmp / "tiny-llama"),), env={"HF_HUB_OFFLINE": "1"}
    )[0]
    assert hsdp[0] == pytest.approx(by_hand, rel=1e-6)


def _fsdp_plugin_save_pretrained(model_dir, out):
    """nbaccel's FSDP strategy alone (no ParallelismConfig): the sharded model's own
    save_pretrained, called on every rank as scripts do."""
    from nbaccel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = acc.prepare(model)
    sharded = type(next(model.parameters())).__name__
    model.save_pretrained(out)
    return sharded


def test_save_pretrained_on_a_model_sharded_by_the_fsdp_strategy_writes_full_weights(tmp):
    out = tmp / "fsdp-strategy"
    kinds = run_on_workers(
        _fsdp_plugin_save_pretrained,
        2,
        args=(str(tmp / "tiny-llama"), str(out)),
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert kinds == ["DTensor", "DTensor"]
    from safetensors.torch import load_file

    saved, original = load_file(str(out / "model.safetensors")), _saved_original(tmp)
    assert sorted(saved) == sorted(original)
    for key, value in original.items():
        assert torch.equal(saved[key], value), key


def _saved_original(tmp):
    from safetensors.torch import load_file

    return load_file(str(tmp / "tiny-llama" / "model.safetensors"))
