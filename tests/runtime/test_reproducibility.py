"""The same training script on 1 and on 2 processes ends with the same weights.

Every rank must read exactly the samples the 1-process run reads, in the same order, so
shuffling has to follow the unprepared loader's ``generator`` (synchronised from rank 0)
and every sampler nbaccel shards must be synchronised, also when the ranks' global RNGs
differ (a rank-dependent seed, augmentation).
"""

from __future__ import annotations

import pytest
import torch

from nbaccel.launch.testing import run_on_workers

GLOBAL_BATCH = 8


def _train(options: dict) -> dict:
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

    from nbaccel import Accelerator, set_seed

    style = options.pop("style", "shuffle")
    size = options.pop("size", 24)
    accelerator = Accelerator(cpu=True, **options)
    p = accelerator.num_processes
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(size, 4)
    dataset = TensorDataset(data, data.sum(1, keepdim=True).sin())
    torch.manual_seed(1000 + accelerator.process_index)  # the ranks' global RNGs now differ
    local_batch = GLOBAL_BATCH if accelerator.split_batches else GLOBAL_BATCH // p
    generator = torch.Generator().manual_seed(7)
    if style == "shuffle":
        loader = DataLoader(dataset, batch_size=local_batch, shuffle=True, generator=generator)
    else:  # the Hugging Face datasets style: a batch sampler passed as sampler=
        # (with a generator: a generator-less one is seeded from the global stream, as
        # Accelerate does, which is not the 1-process run's draw)
        shuffle = RandomSampler(dataset, generator=generator)
        sampler = BatchSampler(shuffle, batch_size=local_batch, drop_last=False)
        loader = DataLoader(dataset, sampler=sampler, batch_size=None)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = []
    for _epoch in range(3):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            seen += accelerator.gather_for_metrics(x[:, 0]).tolist()
    weights = accelerator.unwrap_model(model).state_dict()
    return {"weights": {k: v.clone() for k, v in weights.items()}, "seen": seen}


CASES = {
    "shuffle": {},
    "split_batches": {"split_batches": True},
    "dispatch_batches": {"dispatch_batches": True},
    "dispatch_split": {"dispatch_batches": True, "split_batches": True},
    "uneven_split": {"even_batches": False, "split_batches": True, "size": 20},
    "batch_sampler_as_sampler": {"style": "batch_sampler"},
}


@pytest.mark.integration
@pytest.mark.parametrize("case", list(CASES))
def test_one_and_two_processes_train_identically(case):
    (single,) = run_on_workers(_train, num_processes=1, args=(dict(CASES[case]),))
    double = run_on_workers(_train, num_processes=2, args=(dict(CASES[case]),))
    for rank, result in enumerate(double):
        # the same samples in the same global order (so each was read exactly once)
        assert sorted(result["seen"]) == sorted(single["seen"]), rank
        assert result["seen"] == single["seen"], rank
        for name, value in single["weights"].items():
            torch.testing.assert_close(result["weights"][name], value, msg=f"{case} {name}")


def _unprepared_order() -> list:
    from torch.utils.data import DataLoader

    from nbaccel import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(accelerator.process_index)

    def make():
        generator = torch.Generator().manual_seed(3)
        return DataLoader(list(range(12)), batch_size=2, shuffle=True, generator=generator)

    plain_loader = make()
    plain = [b.tolist() for _ in range(2) for b in plain_loader]
    prepared = accelerator.prepare(make())
    got = [accelerator.gather(b).tolist() for _ in range(2) for b in prepared]
    return plain, got


def test_prepared_loader_keeps_the_unprepared_global_order():
    for plain, got in run_on_workers(_unprepared_order, num_processes=2):
        flat_plain = [i for b in plain for i in b]
        # rank-major gather of batch pairs = the plain loader's order
        assert [i for b in got for i in b] == flat_plain


def test_user_generator_order_resumes_from_a_state_dict():
    from torch.utils.data import DataLoader

    from nbaccel.runtime.loading.data import prepare_data_loader

    def make(seed):
        data = list(range(12))
        gen = torch.Generator().manual_seed(seed)
        return prepare_data_loader(DataLoader(data, batch_size=3, shuffle=True, generator=gen))

    full = make(5)
    epochs = [[b.tolist() for b in full] for _ in range(2)]
    plain_gen = torch.Generator().manual_seed(5)
    plain = DataLoader(list(range(12)), batch_size=3, shuffle=True, generator=plain_gen)
    assert epochs == [[b.tolist() for b in plain] for _ in range(2)]  # the unprepared order
    loader = make(5)
    list(loader)
    iterator = iter(loader)
    assert next(iterator).tolist() == epochs[1][0]
    state = loader.state_dict()
    resumed = make(99)  # another generator state: the checkpoint's wins
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == epochs[1][1:]
