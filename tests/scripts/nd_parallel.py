"""ND-parallel training of a causal LM with ``ParallelismConfig``: FSDP, HSDP, TP x FSDP.

Accelerate's ``examples/torch_native_parallelism/nd_parallel.py``, ported by the import only,
with the changes a machine without the hub needs: a tiny Llama built from a config and saved
locally (``--model-name`` is its folder), token data made here instead of the download and its
tokenizer, no wandb tracker, float32 instead of bf16 (the test compares losses with a
hand-written torch run), and two additions for the test: ``--resume-from`` (load a checkpoint
and continue) and ``--out`` (rank 0 writes each step's loss as JSON).
"""

import argparse
import json
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM

from nbaccel import Accelerator
from nbaccel.parallelism_config import ParallelismConfig
from nbaccel.utils import FullyShardedDataParallelPlugin, set_seed

MODEL_ID = "NousResearch/Hermes-3-Llama-3.1-8B"


class TokenDataset(Dataset):
    """Made here instead of the download: each sample is one sequence of token ids."""

    def __init__(self, num_samples, sequence_length, vocab_size):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab_size, (num_samples, sequence_length + 1), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i]


def create_collate_fn():
    def collate(rows):
        ids = torch.stack(rows)
        return {"input_ids": ids[:, :-1], "labels": ids[:, :-1].clone(), "shift_labels": ids[:, 1:]}

    return collate


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-replicate-size", type=int, default=1)
    parser.add_argument("--dp-shard-size", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--cp-size", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, default=32)
    parser.add_argument("--num-steps", type=int, default=1000)
    parser.add_argument("--save-dir", type=str, default="./outputs")
    parser.add_argument("--checkpoint-frequency", type=int, default=100)
    parser.add_argument("--model-name", type=str, default=MODEL_ID)
    parser.add_argument("--resume-from", type=str, default=None)
    parser.add_argument("--out", type=str, default=None)
    return parser.parse_args()


def forward(model, batch, optimizer, accelerator: Accelerator):
    batch["position_ids"] = torch.arange(
        0, batch["input_ids"].size(1), device=batch["input_ids"].device
    ).unsqueeze(0)
    # We need both labels and shift_labels, as the loss computation in the model is hidden behind `if labels is not None`, but the loss computation
    # itself prioritzes shift_labels (if provided) which are the correct ones (due to labels being wrong if cp enabled)
    buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
    ):
        # To get the proper loss value, we need to average across devices that are participating in data parallel/context parallel training
        loss_reduce_grp = (
            accelerator.torch_device_mesh["dp_cp"].get_group()
            if accelerator.parallelism_config.dp_cp_dim_names
            else None
        )
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=loss_reduce_grp)

    return loss


def train(args):
    parallelism_config = ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
    )

    # FSDP needs extra configuration, so we properly shard the model
    fsdp2_plugin = None
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            state_dict_type="SHARDED_STATE_DICT",
        )

    accelerator = Accelerator(
        mixed_precision="no", parallelism_config=parallelism_config, fsdp_plugin=fsdp2_plugin
    )

    # If TP was enabled, we need to tell transformers to prepare the model for us
    model_kwargs = (
        {"tp_size": args.tp_size, "tp_plan": "auto", "device_mesh": accelerator.torch_device_mesh}
        if args.tp_size > 1
        else {}
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name,
        torch_dtype=torch.float32,
        use_cache=False,
        **model_kwargs,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
    dataset = TokenDataset(64, args.sequence_length, model.config.vocab_size)
    dataloader = DataLoader(dataset, batch_size=1, collate_fn=create_collate_fn())

    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    total_num_steps = min(args.num_steps, len(dataloader))
    first_step, losses = 0, {}
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        first_step = accelerator.step
        dataloader = accelerator.skip_first_batches(dataloader, first_step)

    accelerator.print("Starting training...")
    for step, batch in enumerate(dataloader, start=first_step):
        if step >= total_num_steps:
            break

        loss = forward(model, batch, optimizer, accelerator)
        losses[step] = loss.item()
        accelerator.print(f"Step {step}/{total_num_steps}, Loss: {loss.item():.4f}")

        if (
            step % args.checkpoint_frequency == 0
            and step > 0
            and parallelism_config.dp_shard_enabled
        ):
            accelerator.print(f"Saving checkpoint at step {step}...")
            accelerator.save_state(args.save_dir + f"/checkpoint-{step}")

    accelerator.print("Training completed!")
    if args.out and accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "step": accelerator.step}, f)

    model.save_pretrained(args.save_dir + "/model")
    accelerator.print(f"Model saved to {args.save_dir}/model")
    accelerator.end_training()


if __name__ == "__main__":
    set_seed(42)
    args = parse_args()
    if args.dp_shard_size == 1 and args.tp_size > 1:
        # We currently don't support saving with `save_state` when using only
        # tensor parallelism, fsdp must be enabled
        warnings.warn(
            "Accelerator.save_state() is not yet supported with pure tensor parallel training. Training will work, but intermediate checkpoints will not be saved.",
            stacklevel=2,
        )
    train(args)
