"""Sentence-pair classification with a tiny BERT: bf16, accumulation, a scheduler, a tracker.

Written like Accelerate's ``examples/nlp_example.py`` and ``complete_nlp_example.py`` and
transformers' ``run_glue_no_trainer.py``, with a BERT built from a small ``BertConfig`` and token
data made here (nothing is downloaded), and ported by the import only. A custom tracker (the
``GeneralTracker`` recipe of Accelerate's tracking guide) writes what ``accelerator.log`` sends to
a JSON-lines file; rank 0 writes the run's facts to ``--out/result.json``.
"""

import argparse
import json
import math
import os

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from nbaccel import Accelerator
from nbaccel.logging import get_logger
from nbaccel.tracking import GeneralTracker, on_main_process
from nbaccel.utils import set_seed

logger = get_logger(__name__)


class JSONLinesTracker(GeneralTracker):
    name = "jsonlines"
    requires_logging_directory = True

    @on_main_process
    def __init__(self, run_name, logging_dir):
        super().__init__()
        self.path = os.path.join(logging_dir, f"{run_name}.jsonl")
        os.makedirs(logging_dir, exist_ok=True)
        self.file = open(self.path, "w")  # noqa: SIM115 - closed by finish()

    @property
    def tracker(self):
        return self.file

    @on_main_process
    def store_init_configuration(self, values):
        self.file.write(json.dumps({"config": values}) + "\n")

    @on_main_process
    def log(self, values, step=None, **kwargs):
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()

    @on_main_process
    def finish(self):
        self.file.close()


class PairDataset(Dataset):
    """Two 'sentences' of token ids; the label says whether they share their first token."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.a = torch.randint(5, 60, (n, 6), generator=g)
        self.b = torch.randint(5, 60, (n, 6), generator=g)
        same = torch.rand(n, generator=g) < 0.5
        self.b[same, 0] = self.a[same, 0]
        self.labels = same.long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        ids = torch.cat(
            [torch.tensor([1]), self.a[i], torch.tensor([2]), self.b[i], torch.tensor([2])]
        )
        types = torch.tensor([0] * 8 + [1] * 7)
        return {"input_ids": ids, "token_type_ids": types, "labels": self.labels[i]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mixed_precision", default="bf16")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    tracker = JSONLinesTracker("nlp_example", os.path.join(args.out, "logs"))
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=tracker,
    )
    logger.info(accelerator.state, main_process_only=False)
    set_seed(42)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    # what autocast does inside the model (the logits come back in fp32 either way)
    inner_dtypes = set()
    model.bert.pooler.dense.register_forward_hook(lambda m, i, o: inner_dtypes.add(str(o.dtype)))
    with accelerator.main_process_first():
        train_dataset, eval_dataset = PairDataset(96, 0), PairDataset(29, 1)
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=8)
    eval_dataloader = DataLoader(eval_dataset, batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer,
        num_warmup_steps=2,
        num_training_steps=args.num_epochs * num_update_steps_per_epoch,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    accelerator.init_trackers("nlp_example", {"lr": 2e-3, "epochs": args.num_epochs})

    # the loader is shorter once sharded: count the updates after prepare, as run_glue_no_trainer does
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    completed_steps = 0
    dtypes = set()
    for epoch in range(args.num_epochs):
        model.train()
        total_loss = 0.0
        for batch in train_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                dtypes.add(str(outputs.logits.dtype))
                loss = outputs.loss
                total_loss += loss.detach().float().item()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1

        model.eval()
        correct, samples_seen = 0, 0
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions, references = accelerator.gather_for_metrics(
                (outputs.logits.argmax(dim=-1), batch["labels"])
            )
            correct += (predictions == references).sum().item()
            samples_seen += len(references)
        accuracy = correct / samples_seen
        accelerator.print(f"epoch {epoch}: accuracy {accuracy:.3f}")
        accelerator.log(
            {
                "accuracy": accuracy,
                "train_loss": total_loss / len(train_dataloader),
                "epoch": epoch,
            },
            step=completed_steps,
        )

    accelerator.end_training()
    if accelerator.is_main_process:
        result = {
            "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
            "logit_dtypes": sorted(dtypes),
            "inner_dtypes": sorted(inner_dtypes),
            "completed_steps": completed_steps,
            "expected_steps": args.num_epochs * num_update_steps_per_epoch,
            "eval_samples_seen": samples_seen,
            "last_lr": lr_scheduler.get_last_lr()[0],
            "tracker_file": tracker.path,
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
