"""nbaccel.runtime.loading.data: sharding any (batch) sampler, even batches, shuffles, resume; real 2-process runs."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
)

from nbaccel.errors import ConfigError
from nbaccel.launch.testing import run_on_workers
from nbaccel.runtime.loading.data import (
    BatchSamplerShard,
    IterableDatasetShard,
    prepare_data_loader,
    skip_first_batches,
)


def _ranks(batch_sampler, p, **kw):
    shards = [BatchSamplerShard(batch_sampler, p, r, **kw) for r in range(p)]
    return [list(s) for s in shards], [len(s) for s in shards], shards


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("even", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_shard_grid(split, even, drop_last):
    for n, bs, p in itertools.product((1, 5, 8, 13, 16), (2, 4), (2, 3)):
        if split and bs % p:
            continue
        inner = BatchSampler(SequentialSampler(range(n)), bs, drop_last)
        per_rank, lengths, shards = _ranks(inner, p, split_batches=split, even_batches=even)
        case = (n, bs, p)
        if even:  # same number of batches everywhere, equal batch sizes per round
            assert len({len(b) for b in per_rank}) == 1, case
        assert lengths == [len(b) for b in per_rank], case
        seen = Counter(i for batches in per_rank for b in batches for i in b)
        if drop_last:
            assert all(v == 1 for v in seen.values()), case
            continue
        assert set(seen) == set(range(n)), case
        if not even:
            assert all(v == 1 for v in seen.values()), case
        duplicated = sum(seen.values()) - n
        remainder = shards[0].remainder
        if duplicated:  # the real samples of the last round come first, in rank order
            body = [i for batches in per_rank for b in batches[:-1] for i in b]
            last_round = [i for batches in per_rank for i in batches[-1]]
            assert sorted(body + last_round[:remainder]) == list(range(n)), case
        else:
            assert remainder == -1, case


def test_even_batches_wrap_around_with_the_first_samples():
    inner = BatchSampler(SequentialSampler(range(10)), 4, False)
    per_rank, lengths, shards = _ranks(inner, 2)
    assert per_rank == [[[0, 1, 2, 3], [8, 9, 0, 1]], [[4, 5, 6, 7], [2, 3, 4, 5]]]
    assert shards[0].remainder == 2 and lengths == [2, 2]
    split, _, shards = _ranks(inner, 2, split_batches=True)
    assert split == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    assert shards[1].remainder == 2
    with pytest.raises(ConfigError, match="multiple of the process count"):
        BatchSamplerShard(BatchSampler(range(9), 3, False), 2, 0, split_batches=True)


class VariableBatches(Sampler):
    """A custom batch sampler without batch_size: bucketed sizes 3, 1, 2, 3, 1, ..."""

    def __init__(self, n, shuffle=False):
        self.n = n
        self.sampler = RandomSampler(range(n)) if shuffle else SequentialSampler(range(n))

    def __iter__(self):
        order = list(self.sampler)
        sizes = itertools.cycle([3, 1, 2])
        while order:
            size = next(sizes)
            yield order[:size]
            order = order[size:]

    def __len__(self):
        full, rest = divmod(self.n, 6)
        return full * 3 + (0 if rest == 0 else 1 if rest <= 3 else 2 if rest <= 4 else 3)


def test_custom_batch_sampler_without_batch_size():
    per_rank, lengths, shards = _ranks(VariableBatches(10), 2)
    assert per_rank[0] == [[0, 1, 2], [4, 5], [9]] and per_rank[1] == [[3], [6, 7, 8], [0, 1, 2]]
    assert lengths == [3, 3] and shards[0].remainder == 1


class Numbers(IterableDataset):
    def __init__(self, n, sized=True):
        self.n, self.sized = n, sized
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        if not self.sized:
            raise TypeError("unsized")
        return self.n


def test_iterable_dataset_shards():
    for split in (False, True):
        outs = []
        for r in range(2):
            loader = prepare_data_loader(
                DataLoader(Numbers(11), batch_size=4 if split else 2),
                num_processes=2,
                process_index=r,
                split_batches=split,
            )
            outs.append(([b.tolist() for b in loader], len(loader), loader.remainder))
        assert outs[0][0] == [[0, 1], [4, 5], [8, 9]]
        assert outs[1][0] == [[2, 3], [6, 7], [10, 0]]
        assert outs[0][1] == outs[1][1] == 3 and outs[0][2] == 3
    shard = IterableDatasetShard(Numbers(11), 2, drop_last=True, num_processes=2, process_index=1)
    assert list(shard) == [2, 3, 6, 7] and len(shard) == 4
    uneven = IterableDatasetShard(
        Numbers(11), 2, num_processes=2, process_index=1, even_batches=False
    )
    assert list(uneven) == [2, 3, 6, 7, 10] and len(uneven) == 5
    dataset = Numbers(4)
    loader = prepare_data_loader(DataLoader(dataset, batch_size=2))
    list(loader), list(loader)
    assert dataset.epochs == [0, 1]  # set_epoch forwarded, advancing by itself


class ByWorker(torch.utils.data.IterableDataset):
    """PyTorch's idiom: the dataset splits itself between the loader's workers."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(start, self.n, step))


def test_iterable_dataset_with_workers_reads_as_a_plain_loader():
    # each worker reads its own copy, as with a plain DataLoader and Accelerate: a dataset
    # that splits itself by get_worker_info() is read once, not split a second time
    def loader(dataset, **kw):
        return DataLoader(dataset, batch_size=2, num_workers=2, **kw)

    plain = [b.tolist() for b in loader(ByWorker(16))]
    assert [b.tolist() for b in prepare_data_loader(loader(ByWorker(16)))] == plain
    shards = [
        [
            b.tolist()
            for b in prepare_data_loader(loader(ByWorker(16)), num_processes=2, process_index=r)
        ]
        for r in range(2)
    ]
    assert sorted(i for shard in shards for b in shard for i in b) == list(range(16))
    # one process: a short last batch stays short, as in a plain loader
    tail = [b.tolist() for b in prepare_data_loader(DataLoader(Numbers(5), batch_size=2))]
    assert tail == [[0, 1], [2, 3], [4]]


def _prepared(shuffle=True, **kw):
    torch.manual_seed(1234)  # the seed each rank agrees on
    return prepare_data_loader(DataLoader(list(range(12)), batch_size=3, shuffle=shuffle), **kw)


def test_shuffle_is_identical_on_every_rank_and_changes_per_epoch():
    ranks = [_prepared(num_processes=2, process_index=r) for r in range(2)]
    epochs = [[[b.tolist() for b in loader] for loader in ranks] for _ in range(2)]
    for epoch in epochs:
        flat = [i for rank in epoch for b in rank for i in b]
        assert sorted(flat) == list(range(12))  # a true partition: same permutation on both
    assert epochs[0] != epochs[1]
    # Accelerate's default: the generator runs on, set_epoch does not replay an epoch...
    ranks[0].set_epoch(0)
    assert [b.tolist() for b in ranks[0]] != epochs[0][0]
    # ... the seedable sampler's order is (seed + epoch): set_epoch replays it
    seedable = _prepared(num_processes=2, process_index=0, use_seedable_sampler=True)
    orders = [[b.tolist() for b in seedable] for _ in range(2)]
    seedable.set_epoch(0)
    assert orders[0] != orders[1] and [b.tolist() for b in seedable] == orders[0]


def test_state_dict_resumes_after_the_seen_batches():
    # one process: the sampler draws its seed from the global stream every epoch, as plain
    # PyTorch; the state replays epoch 1's start, the next epoch draws on from the RNG state
    full = _prepared()
    epochs = [[b.tolist() for b in full] for _ in range(3)]
    after = torch.rand(3)
    loader = _prepared()
    list(loader)
    iterator = iter(loader)
    seen = [next(iterator).tolist(), next(iterator).tolist()]
    assert seen == epochs[1][:2]
    state, rng = loader.state_dict(), torch.get_rng_state()  # what save_state keeps
    assert state["epoch"] == 1 and state["batches_yielded"] == 2
    resumed = _prepared(shuffle=True)
    torch.manual_seed(99)  # another run: the checkpoint's states win
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert [b.tolist() for b in resumed] == epochs[1][2:]
    assert resumed.state_dict()["epoch"] == 2 and resumed.state_dict()["batches_yielded"] == 0
    assert [b.tolist() for b in resumed] == epochs[2]  # and it goes on as the full run
    assert torch.equal(torch.rand(3), after)


def test_skip_first_batches_prepared_and_plain():
    loader = _prepared(shuffle=False)
    view = skip_first_batches(loader, 3)
    assert len(view) == 1 and [b.tolist() for b in view] == [[9, 10, 11]]
    assert loader.state_dict() == {"epoch": 1, "batches_yielded": 0, "seed": loader.progress.seed}
    loader.load_state_dict({"epoch": 1, "batches_yielded": 1})
    assert [b.tolist() for b in skip_first_batches(loader, 2)] == [[6, 7, 8], [9, 10, 11]]
    plain = skip_first_batches(DataLoader(range(6), batch_size=2), 1)
    assert [b.tolist() for b in plain] == [[2, 3], [4, 5]] and len(plain) == 2
    with pytest.raises(ValueError, match="num_batches=-1"):
        skip_first_batches(loader, -1)


def test_batch_size_none_and_device_placement_of_structures():
    single = prepare_data_loader(
        DataLoader(list(range(5)), batch_size=None), num_processes=2, process_index=1
    )
    assert list(single) == [1, 3, 0]
    pairs = TensorDataset(torch.arange(4.0), torch.arange(4))
    loader = prepare_data_loader(
        DataLoader(
            pairs,
            batch_size=2,
            collate_fn=lambda rows: {"x": torch.stack([r[0] for r in rows]), "n": [len(rows)]},
        ),
        device=torch.device("cpu"),
    )
    batch = next(iter(loader))
    assert set(batch) == {"x", "n"} and batch["n"] == [2] and batch["x"].device.type == "cpu"


def test_distributed_sampler_is_not_sharded_twice_and_iterable_resume():
    data = list(range(8))
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
    loader = prepare_data_loader(
        DataLoader(data, batch_size=2, sampler=sampler), num_processes=2, process_index=1
    )
    assert [b.tolist() for b in loader] == [[1, 3], [5, 7]] and len(loader) == 2
    stream = prepare_data_loader(DataLoader(Numbers(8), batch_size=2))
    stream.load_state_dict({"epoch": 0, "batches_yielded": 3})
    assert [b.tolist() for b in stream] == [[6, 7]]
    assert [b.tolist() for b in skip_first_batches(stream, 2)] == [[4, 5], [6, 7]]


def test_prepared_loader_with_workers_and_a_custom_sampler():
    class Reverse(Sampler):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(self.n - 1, -1, -1))

        def __len__(self):
            return self.n

    loader = prepare_data_loader(
        DataLoader(list(range(7)), batch_size=2, sampler=Reverse(7), num_workers=2),
        num_processes=2,
        process_index=1,
    )
    assert [b.tolist() for b in loader] == [[4, 3], [0, 6]]  # [2, 1, 0] + wrap [6]
    assert loader.remainder == 3 and len(loader) == 2


# ---------------------------------------------------------------- real 2-process groups

CASES = [
    # (n, batch_size, shuffle, split_batches, even_batches, drop_last, kind)
    (13, 4, False, False, True, False, "plain"),
    (13, 4, True, False, True, False, "plain"),
    (13, 4, True, True, True, False, "plain"),
    (13, 4, True, False, False, False, "plain"),
    (13, 4, True, False, True, True, "plain"),
    (11, None, True, False, True, False, "custom_batch_sampler"),
    (9, 2, False, False, True, False, "custom_sampler"),
    (10, 2, True, False, True, False, "global_rng_sampler"),
]


class GlobalRandomOrder(Sampler):
    """Shuffles with the *global* torch RNG: needs rng_types=["torch"] to agree across ranks."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())

    def __len__(self):
        return self.n


def _loader_for(n, bs, shuffle, drop_last, kind):
    data = torch.arange(n)
    if kind == "custom_batch_sampler":
        return DataLoader(data, batch_sampler=VariableBatches(n, shuffle=shuffle))
    if kind == "custom_sampler":
        return DataLoader(data, batch_size=bs, sampler=[*range(n)][::-1])
    if kind == "global_rng_sampler":
        return DataLoader(data, batch_size=bs, sampler=GlobalRandomOrder(n))
    return DataLoader(data, batch_size=bs, shuffle=shuffle, drop_last=drop_last)


def _shard_everything():
    from nbaccel import Accelerator
    from nbaccel.runtime.process.state import reset_state

    reset_state()
    out = []
    for n, bs, shuffle, split, even, drop_last, kind in CASES:
        rng_types = ["generator", "torch"] if kind == "global_rng_sampler" else None
        acc = Accelerator(split_batches=split, even_batches=even, rng_types=rng_types)
        torch.manual_seed(acc.process_index)  # ranks' global RNGs differ on purpose
        loader = acc.prepare(_loader_for(n, bs, shuffle, drop_last, kind))
        epochs = []
        for _epoch in range(2):
            gathered, metrics, count = [], [], 0
            for batch in loader:
                count += 1
                if even and kind != "custom_batch_sampler":  # equal shapes: plain gather works
                    gathered.extend(acc.gather(batch).tolist())
                metrics.extend(acc.gather_for_metrics(batch).tolist())
            epochs.append((gathered, metrics, count, len(loader)))
        out.append(epochs)
    return out


def test_sharding_over_two_processes_is_exact():
    results = run_on_workers(_shard_everything, num_processes=2)
    assert results[0] == results[1]  # every rank gathered the same thing
    for case, epochs in zip(CASES, results[0], strict=True):
        n, bs, shuffle, _split, even, drop_last, kind = case
        for gathered, metrics, count, length in epochs:
            assert count == length, case
            if drop_last:
                kept = n // (2 * bs) * 2 * bs
                assert len(metrics) == kept and len(set(metrics)) == kept, case
                continue
            assert sorted(metrics) == list(range(n)), case  # exactly N, each once
            if even and kind != "custom_batch_sampler":
                assert set(gathered) == set(range(n)) and len(gathered) > n, case  # wrapped
        if shuffle:
            assert epochs[0][1] != epochs[1][1], case  # a new order each epoch
        else:
            assert epochs[0][1] == epochs[1][1], case
