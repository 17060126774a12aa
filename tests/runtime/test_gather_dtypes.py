"""gather / gather_for_metrics of mixed dtypes over a real 2-process gloo group.

Packing leaves of different element sizes into one byte buffer used to put a leaf at an
offset its dtype cannot be viewed at (``storage_offset() must be divisible by 8``).
"""

from __future__ import annotations

import itertools

import torch

from nbaccel.launch.testing import run_on_workers

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)


def _leaf(dtype: torch.dtype, n: int, rank: int, salt: int = 0) -> torch.Tensor:
    values = torch.arange(n) + 10 * rank + salt
    return (values % 2).bool() if dtype is torch.bool else values.to(dtype)


def _both(dtype: torch.dtype, sizes: tuple[int, int], salt: int = 0) -> torch.Tensor:
    return torch.cat([_leaf(dtype, n, r, salt) for r, n in enumerate(sizes)])


def _mixed_dtypes() -> list[str]:
    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    failures = []
    for (a, b), n in itertools.product(itertools.product(DTYPES, repeat=2), (3, 4)):
        data = {
            "pair": (_leaf(a, n, rank), _leaf(b, n + 1, rank, 1)),
            "x": {"y": _leaf(a, 1, rank)},
        }
        want = {
            "pair": (_both(a, (n, n)), _both(b, (n + 1, n + 1), 1)),
            "x": {"y": _both(a, (1, 1))},
        }
        for name, got in (
            ("gather", accelerator.gather(data)),
            ("gather_for_metrics", accelerator.gather_for_metrics(data)),
        ):
            pairs = [(got["pair"][0], want["pair"][0]), (got["pair"][1], want["pair"][1])]
            pairs.append((got["x"]["y"], want["x"]["y"]))
            if not all(g.dtype == w.dtype and torch.equal(g, w) for g, w in pairs):
                failures.append(f"{name} {a} {b} n={n}: {got} != {want}")
        # uneven along dim 0 (gather_for_metrics accepts it): rank 0 has n, rank 1 has n - 1
        sizes = (n, n - 1)
        uneven = (_leaf(a, sizes[rank], rank), _leaf(b, sizes[rank], rank, 1))
        got = accelerator.gather_for_metrics(uneven)
        if not (torch.equal(got[0], _both(a, sizes)) and torch.equal(got[1], _both(b, sizes, 1))):
            failures.append(f"uneven {a} {b} n={n}: {got}")
    return failures


def test_gather_every_dtype_combination_on_two_processes():
    for failures in run_on_workers(_mixed_dtypes, num_processes=2):
        assert failures == []


def _evaluation_loop() -> tuple[list[float], list[int]]:
    from torch.utils.data import DataLoader, TensorDataset

    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    features = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    dataset = TensorDataset(features, torch.arange(7))
    model = torch.nn.Linear(3, 1)
    torch.nn.init.ones_(model.weight)
    torch.nn.init.zeros_(model.bias)
    model, loader = accelerator.prepare(model, DataLoader(dataset, batch_size=2))
    logits_all, labels_all = [], []
    with torch.no_grad():
        for x, labels in loader:
            logits = model(x).squeeze(1)  # float32 with 2 elements per rank, labels int64
            logits, labels = accelerator.gather_for_metrics((logits, labels))
            logits_all += logits.tolist()
            labels_all += labels.tolist()
    return logits_all, labels_all


def test_gather_for_metrics_float_logits_int_labels_uneven_last_batch():
    expected_logits = [float(3 * i * 3 + 3) for i in range(7)]  # row sums of the features
    for logits, labels in run_on_workers(_evaluation_loop, num_processes=2):
        assert sorted(labels) == list(range(7))  # every sample once, the duplicates dropped
        assert sorted(logits) == expected_logits
