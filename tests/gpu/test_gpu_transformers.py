"""A real transformers model on the GPU from a real kernel (issue 32, item 5).

GPT-2 (124M parameters) built locally from its config (no download), fine-tuned in bf16 in
a worker that ``notebook_launcher`` forks from a kernel that never touches CUDA: once with
nbaccel's ``Accelerator`` (with a ``save_state``/``load_state`` round trip on CUDA), once
through transformers' ``Trainer`` (which builds Accelerate's own accelerator). The cells
are written so that ``CELLS.format(on_gpu=False)`` runs the same code on a CPU with a tiny
config (how they were checked before a GPU run).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from kernel_harness import KernelSession, isolated_env

pytestmark = pytest.mark.gpu

CELLS = """
import json, os, tempfile, torch
from nbaccel import Accelerator, notebook_launcher

ON_GPU = {on_gpu}
if ON_GPU:  # GPT-2 small: 124M parameters
    SIZE = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024)
    SEQ = 512
else:
    SIZE = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=1000, n_positions=128)
    SEQ = 64


def tokens(batch=8, seed=0):
    # a short random phrase repeated: a language model learns it within a few dozen steps
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, SIZE["vocab_size"], (batch, 16), generator=g)
    return phrase.repeat(1, SEQ // 16)


def finetune(folder):
    from transformers import GPT2Config, GPT2LMHeadModel

    acc = Accelerator(mixed_precision="bf16", cpu=not ON_GPU)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**SIZE))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, opt = acc.prepare(model, opt)
    x = tokens().to(acc.device)
    losses = []
    for _ in range(30):
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    acc.save_state(folder)
    saved = {{k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}}
    loss = model(input_ids=x, labels=x).loss  # one more step moves the weights...
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    moved = any(not torch.equal(v, saved[k])
                for k, v in acc.unwrap_model(model).state_dict().items())
    acc.load_state(folder)  # ...and load_state brings them back, on the GPU
    state = acc.unwrap_model(model).state_dict()
    restored = all(torch.equal(v, saved[k]) for k, v in state.items())
    return {{"params": params, "losses": losses, "device": str(acc.device),
             "param_device": str(next(model.parameters()).device), "moved": moved,
             "restored": restored, "peak_gib": torch.cuda.max_memory_allocated() / 2**30
             if ON_GPU else 0.0}}


def trainer_run(folder):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Phrases(torch.utils.data.Dataset):
        def __init__(self):
            self.x = tokens(batch=64)
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            return {{"input_ids": self.x[i], "labels": self.x[i]}}

    args = TrainingArguments(output_dir=folder, per_device_train_batch_size=8, max_steps=24,
                             learning_rate=3e-4, bf16=ON_GPU, use_cpu=not ON_GPU,
                             logging_steps=4, report_to=[], save_strategy="no",
                             disable_tqdm=True, seed=0)
    torch.manual_seed(0)
    trainer = Trainer(model=GPT2LMHeadModel(GPT2Config(**SIZE)), args=args,
                      train_dataset=Phrases())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {{"global_step": trainer.state.global_step, "device": str(trainer.args.device),
             "world_size": trainer.args.world_size, "losses": losses,
             "param_dtype": str(next(trainer.model.parameters()).dtype)}}


def in_a_worker(fn):
    # one real worker forked from this CUDA-free kernel (block=False: a worker, not the kernel)
    folder = tempfile.mkdtemp(prefix="nbaccel-gpt2-")
    return notebook_launcher(fn, args=(folder,), num_processes=1, block=False,
                             start_method="fork").result(timeout=500)
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    workdir = tmp_path_factory.mktemp("gpu-gpt2")
    env = isolated_env(workdir)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(workdir / "hf-home"))
    session = KernelSession(cwd=workdir, env=env, startup_timeout=120)
    session.start()
    session.run(CELLS.format(on_gpu=True), timeout=180)
    yield session
    session.stop()


@pytest.mark.timeout(600)
def test_gpt2_bf16_finetune_with_save_and_load_state_on_the_gpu(kernel):
    kernel.run("gpt2 = in_a_worker(finetune)", timeout=560)
    got = kernel.evaluate_json("gpt2")
    assert got["params"] > 100_000_000, got  # GPT-2 size
    assert got["device"] == "cuda:0" and got["param_device"] == "cuda:0", got
    losses = got["losses"]
    assert all(v == v for v in losses) and losses[-1] < losses[0] - 1, losses  # it learns
    assert got["moved"] is True and got["restored"] is True, got  # load_state round trip
    assert got["peak_gib"] > 0.5, got
    assert kernel.evaluate_json("torch.cuda.is_initialized()") is False  # the kernel: no CUDA
    kernel.assert_no_descendants(timeout=10)


@pytest.mark.timeout(600)
def test_gpt2_through_the_transformers_trainer_in_a_worker(kernel):
    kernel.run("trained = in_a_worker(trainer_run)", timeout=560)
    got = kernel.evaluate_json("trained")
    assert got["global_step"] == 24 and got["world_size"] == 1, got
    assert got["device"] == "cuda:0", got
    losses = got["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    kernel.assert_no_descendants(timeout=10)
