"""The distributed self-check that ``nbaccel test`` runs on every process.

Checks, with the settings ``nbaccel test`` resolved (NBACCEL_* variables):
1. data sharding: every sample is seen by exactly one process;
2. gather: each process contributes its rank and every rank gets all of them;
3. training: a few optimizer steps lower the loss and leave identical weights
   on every process.
Exit code 0 when every check passes on this rank, 1 otherwise.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel.runtime.facade.accelerator import Accelerator

    started = time.monotonic()
    acc = Accelerator()
    rank, world = acc.process_index, acc.num_processes
    failures: list[str] = []

    def check(name: str, ok: bool, detail: str) -> None:
        if not ok:
            failures.append(f"{name}: {detail}")
        if acc.is_main_process:
            print(f"  [{'ok' if ok else 'FAILED'}] {name}: {detail}", flush=True)

    if acc.is_main_process:
        print(
            f"self-check on {world} process(es), device {acc.device}, "
            f"precision {getattr(acc, 'mixed_precision', 'no')}",
            flush=True,
        )

    # 1. sharding
    total = 4 * 2 * world
    loader = acc.prepare(DataLoader(TensorDataset(torch.arange(total)), batch_size=2))
    mine = torch.cat([batch[0] for batch in loader]).to(acc.device)
    everyone = acc.gather(mine).cpu().sort().values
    check(
        "sharding",
        torch.equal(everyone, torch.arange(total)),
        f"{total} samples split over {world} processes, {mine.numel()} each, none twice",
    )

    # 2. gather
    ranks = acc.gather(torch.tensor([rank], device=acc.device)).cpu()
    check("gather", ranks.tolist() == list(range(world)), f"gathered ranks {ranks.tolist()}")

    # 3. a few training steps of y = 2x + 1
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    data = DataLoader(TensorDataset(x, 2 * x + 1), batch_size=8, shuffle=False)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    model, optimizer, data = acc.prepare(model, optimizer, data)
    losses = []
    for _ in range(3):
        for inputs, targets in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs).float(), targets.float())
            acc.backward(loss)
            optimizer.step()
            losses.append(float(loss.detach()))
    weights = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    all_weights = acc.gather(weights.unsqueeze(0)).cpu()
    same = bool(torch.allclose(all_weights, all_weights[0].expand_as(all_weights)))
    check(
        "training",
        losses[-1] < losses[0],
        f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}",
    )
    check("in sync", same, "identical weights on every process" if same else str(all_weights))

    acc.wait_for_everyone()
    if acc.is_main_process:
        print(f"self-check finished in {time.monotonic() - started:.1f}s", flush=True)
    if failures:
        print(f"[rank {rank}] FAILED: {'; '.join(failures)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
