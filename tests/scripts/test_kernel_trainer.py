"""A transformers ``Trainer`` run by ``nbaccel.notebook_launcher`` on 2 processes and on 1, in a real kernel.

The most common notebook use that never touches nbaccel's ``Accelerator``: ``Trainer`` builds
Hugging Face Accelerate's own (Accelerate is then a dependency of transformers, not of
nbaccel). The launcher forks the workers from the kernel, sets up the process group's
environment, and Trainer's Accelerate state joins it as a 2-process CPU run -- also without
``use_cpu=True`` (the launcher tells Accelerate that the workers compute on the CPU; without
that, each worker would train alone on the whole data set, silently).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from kernel_harness import KernelSession, isolated_env

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

CELL = """
import json, torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from nbaccel import notebook_launcher

class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(3, 40, (n, 8), generator=g)
        self.y = (self.x[:, 0] > 20).long()
    def __len__(self):
        return len(self.y)
    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}

def train(output_dir):
    config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, num_train_epochs=2, report_to=[],
                             save_strategy="no", seed=0, disable_tqdm=True)
    trainer = Trainer(model=BertForSequenceClassification(config), args=args,
                      train_dataset=Tokens(40, 0), eval_dataset=Tokens(18, 1))
    trainer.train()
    metrics = trainer.evaluate()
    return {"rank": trainer.args.process_index, "world_size": trainer.args.world_size,
            "global_step": trainer.state.global_step,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "accelerator": type(trainer.accelerator).__module__,
            "eval_loss": metrics["eval_loss"]}

results = notebook_launcher(train, args=("trainer-out",), num_processes=2, return_all_ranks=True)
print("RESULTS " + json.dumps(results))
# one worker (block=False: a worker, not the kernel): Accelerate's state forms a 1-process
# group because LOCAL_RANK is set, and needs MASTER_ADDR/MASTER_PORT as torchrun sets them
single = notebook_launcher(train, args=("trainer-one",), num_processes=1, block=False).result()
print("SINGLE " + json.dumps(single))
"""


@pytest.fixture
def kernel(tmp_path) -> Iterator[KernelSession]:
    env = isolated_env(tmp_path)
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"), TRANSFORMERS_OFFLINE="1")
    with KernelSession(cwd=tmp_path, env=env) as session:
        yield session


def test_transformers_trainer_in_notebook_launcher_trains_on_two_processes(kernel):
    cell = kernel.execute(CELL, timeout=240)
    cell.raise_for_error()
    line = next(x for x in cell.stdout.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    assert [r["rank"] for r in results] == [0, 1]
    assert {r["world_size"] for r in results} == {2}
    assert {r["distributed_type"] for r in results} == {"DistributedType.MULTI_CPU"}
    assert {r["accelerator"] for r in results} == {"accelerate.accelerator"}
    # 40 samples / (4 per device * 2 processes) = 5 steps per epoch, 2 epochs: one real group
    assert {r["global_step"] for r in results} == {10}
    # evaluation is gathered over both processes: the same loss on each
    assert results[0]["eval_loss"] == results[1]["eval_loss"]
    line = next(x for x in cell.stdout.splitlines() if x.startswith("SINGLE "))
    single = json.loads(line.removeprefix("SINGLE "))
    assert single["world_size"] == 1 and single["global_step"] == 20, single
    kernel.assert_no_descendants(timeout=10)
