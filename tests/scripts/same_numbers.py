"""Same seed, same numbers: a tiny training loop in several data-loading modes, traced bit by bit.

Written for Accelerate and ported by the import only. Each mode seeds with ``set_seed``,
prepares a model with dropout (the global random stream), an SGD optimizer and a loader whose
collate function adds noise from the global stream (from the worker's stream when
``num_workers > 0``, seeded by the loader's base seed, as in a masking data collator) and trains
3 epochs. Every step and every epoch's end record the batch's sample ids, the loss
(``float.hex``) and a digest of torch's global RNG state; the final weights are digested too. Each rank writes ``--out/<mode>-rank<r>.json``.

``--resume``: for some modes, also interrupt the run (``save_state`` mid-epoch, at an epoch's last
step, or after an epoch), resume it in a new Accelerator with other weights and RNG streams
(``load_state``, then ``skip_first_batches``, the ``continue`` pattern or a stateful loader) and
write the resumed trace to ``--out/resume-<case>-rank<r>.json``: it must equal the uninterrupted
trace from the checkpoint on.
"""

import argparse
import hashlib
import json
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset

from nbaccel import Accelerator
from nbaccel.utils import DataLoaderConfiguration, set_seed

N = 40
EPOCHS = 3


class Numbers(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


class Stream(IterableDataset):
    def __len__(self):
        return N

    def __iter__(self):  # split between the loader's workers, PyTorch's idiom
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        yield from range(start, N, step)


def collate(ids):
    x = torch.stack([torch.linspace(-1.0, 1.0, 4) * (i + 1) / N for i in ids])
    x = x + 0.01 * torch.randn(x.shape)  # the global stream of whichever process collates
    return {"ids": torch.tensor(ids), "x": x, "y": x.sum(1, keepdim=True).sin()}


MODES = {
    "default": {},
    "workers": {"num_workers": 2},
    "seedable": {"config": {"use_seedable_sampler": True}},
    "seedable_break": {"config": {"use_seedable_sampler": True}, "break_at": 2},
    "split_batches": {"config": {"split_batches": True}},
    "generator": {"generator": 7},
    "iterable": {"iterable": True},
    "iterable_workers": {"iterable": True, "num_workers": 2},
    "dispatch_batches": {"config": {"dispatch_batches": True}},
}

# case: (mode, save after this global step or "epoch0" for after epoch 0, pattern)
RESUMES = {
    "mid_epoch_skip": ("default", 7, "skip"),
    "mid_epoch_continue": ("default", 7, "continue"),
    "mid_epoch_continue_workers": ("workers", 7, "continue"),
    "mid_epoch_iterable_skip": ("iterable", 7, "skip"),
    "mid_epoch_stateful": ("default", 7, "stateful"),
    "mid_epoch_stateful_seedable": ("seedable", 7, "stateful"),
    "last_step_of_epoch_skip": ("default", "last", "skip"),
    "after_epoch": ("default", "epoch0", "skip"),
}


def digest(tensor):
    return hashlib.sha1(tensor.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def build(options, seed, stateful=False):
    config = dict(options.get("config", {}), use_stateful_dataloader=stateful)
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(**config))
    set_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Dropout(0.25), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch_size = 4 * (accelerator.num_processes if config.get("split_batches") else 1)
    iterable = options.get("iterable", False)
    generator = None
    if "generator" in options:
        generator = torch.Generator().manual_seed(options["generator"])
    loader = DataLoader(
        Stream() if iterable else Numbers(),
        batch_size=batch_size,
        shuffle=not iterable,
        collate_fn=collate,
        num_workers=options.get("num_workers", 0),
        generator=generator,
    )
    return (accelerator, *accelerator.prepare(model, optimizer, loader))


def train(options, seed=42, save=None, load=None, pattern="skip", out=None):
    accelerator, model, optimizer, loader = build(options, seed, stateful=pattern == "stateful")
    trace, overall, start_epoch, resume_step = [], 0, 0, 0
    if load is not None:
        accelerator.load_state(load[1])
        if load[0] == "epoch0":
            start_epoch, overall = 1, len(loader)
        else:  # the checkpointing guide's arithmetic
            overall = load[0]
            start_epoch, resume_step = divmod(overall, len(loader))
    for epoch in range(start_epoch, EPOCHS):
        active = loader
        if load is not None and epoch == start_epoch and pattern == "skip" and resume_step:
            active = accelerator.skip_first_batches(loader, resume_step)
        for step, batch in enumerate(active):
            resuming = load is not None and epoch == start_epoch
            if resuming and pattern == "continue" and step < resume_step:
                continue  # seen before the checkpoint
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            overall += 1
            trace.append(
                [
                    overall,
                    epoch,
                    batch["ids"].tolist(),
                    loss.item().hex(),
                    digest(torch.get_rng_state()),
                ]
            )
            if save == "last" and overall == len(loader):
                save = overall
            if save == overall:
                accelerator.save_state(os.path.join(out, f"step_{overall}"))
            if options.get("break_at") and epoch == 1 and step + 1 == options["break_at"]:
                break
        trace.append(["end", epoch, digest(torch.get_rng_state())])
        if save == "epoch0" and epoch == 0:
            accelerator.save_state(os.path.join(out, "epoch0"))
    weights = [digest(p) for p in accelerator.unwrap_model(model).parameters()]
    accelerator.free_memory()
    return {"trace": trace, "weights": weights, "len": len(loader)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    for name, options in MODES.items():
        with open(os.path.join(args.out, f"{name}-rank{rank}.json"), "w") as f:
            json.dump(train(options), f)
    if not args.resume:
        return
    for case, (mode, save, pattern) in RESUMES.items():
        folder = os.path.join(args.out, case)
        os.makedirs(folder, exist_ok=True)
        full = train(MODES[mode], save=save, pattern=pattern, out=folder)
        saved = sorted(os.listdir(folder))[0]
        at = "epoch0" if saved == "epoch0" else int(saved.split("_")[1])
        resumed = train(
            MODES[mode], seed=1234, load=(at, os.path.join(folder, saved)), pattern=pattern
        )
        with open(os.path.join(args.out, f"resume-{case}-rank{rank}.json"), "w") as f:
            json.dump({"full": full, "resumed": resumed, "at": at}, f)


if __name__ == "__main__":
    main()
