"""What the kernel pre-imports before forking: torch._dynamo only when the launch needs it."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import pytest
import torch

from nbaccel.launch import _preload
from nbaccel.launch._preload import needs_dynamo, remember_worker_imports


def collectives_only():
    import torch.distributed as dist

    from nbaccel import Accelerator

    acc = Accelerator()
    t = torch.ones(1, device=acc.device)
    dist.all_reduce(t)
    acc.wait_for_everyone()


def builds_optimizer():
    model = torch.nn.Linear(2, 2)
    return torch.optim.SGD(model.parameters(), lr=0.1)


def prepares(acc, model):
    return acc.prepare(model)


def calls_a_helper():
    return builds_optimizer()


def compiles(model):
    return torch.compile(model)


class NotebookTrainer:
    def fit(self):
        return builds_optimizer()


def uses_trainer():
    return NotebookTrainer().fit()


class CallableJob:
    def __call__(self):
        return builds_optimizer()


def make_closure(optimizer_class):
    def train():
        return optimizer_class([torch.zeros(1, requires_grad=True)], lr=0.1)

    return train


@pytest.fixture(autouse=True)
def _forget_learned():
    saved = set(_preload._learned)
    _preload._learned.clear()
    yield
    _preload._learned.clear()
    _preload._learned.update(saved)


@pytest.mark.parametrize(
    "function",
    [
        builds_optimizer,
        prepares,
        calls_a_helper,
        compiles,
        uses_trainer,
        CallableJob(),
        make_closure(torch.optim.AdamW),  # the class only reachable through a closure cell
        functools.partial(calls_a_helper),
        print,  # not Python code: cannot tell, so assume it does
    ],
)
def test_training_code_needs_dynamo(function):
    assert needs_dynamo(function, ())


@pytest.mark.parametrize(
    "function", [collectives_only, lambda: 1, functools.partial(collectives_only)]
)
def test_collective_only_code_does_not(function):
    assert not needs_dynamo(function, ())


def test_an_optimizer_class_passed_as_argument_counts():
    assert needs_dynamo(lambda cls: cls, (torch.optim.SGD,))
    assert not needs_dynamo(lambda n: n, (3,))


def test_a_warm_pool_worker_loop_needs_it():
    from nbaccel.launch._pool_worker import serve

    assert needs_dynamo(serve, ("address", b"token"))


def test_a_walk_over_budget_assumes_it_is_needed(monkeypatch):
    monkeypatch.setattr(_preload, "SCAN_BUDGET", 0)
    assert needs_dynamo(collectives_only, ())


def test_a_worker_report_is_remembered():
    assert not needs_dynamo(collectives_only, ())
    remember_worker_imports(["torch._dynamo", "something.else"])
    assert needs_dynamo(collectives_only, ())
    assert _preload._learned == {"torch._dynamo"}


SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from nbaccel import notebook_launcher
    from nbaccel.launch import _preload

    def ping():
        import torch.distributed as dist
        from nbaccel import Accelerator
        Accelerator()
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)

    def train():
        m = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(torch.ones(1, 2)).sum().backward()
        opt.step()
        return "torch._dynamo" in sys.modules

    assert notebook_launcher(ping, num_processes=2) == 2.0
    print("after collectives:", "torch._dynamo" in sys.modules)
    if sys.argv[1] == "miss":  # the static look misses the optimizer: workers report it
        _preload.TRIGGER_NAMES = frozenset()
    notebook_launcher(train, num_processes=2)
    print("after training:", "torch._dynamo" in sys.modules, sorted(_preload._learned))
    notebook_launcher(ping, num_processes=2)
    print("after the next launch:", "torch._dynamo" in sys.modules)
    """
)


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["predicted", "miss"])
def test_fork_launch_imports_dynamo_only_when_needed(mode, tmp_path):
    """In a fresh interpreter (this one may have torch._dynamo already)."""
    cuda_build = torch.cuda._is_compiled()  # CUDA builds never pre-import torch._dynamo
    script = tmp_path / "launch_script.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), mode], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("after")]
    assert lines[0] == "after collectives: False"
    if cuda_build:  # the workers import it themselves, every launch; the kernel never does
        assert lines[1] == "after training: False ['torch._dynamo']"
        assert lines[2] == "after the next launch: False"
        return
    if mode == "miss":  # paid in the workers once, then in the kernel before the next fork
        assert lines[1] == "after training: False ['torch._dynamo']"
    else:  # imported in the kernel before forking: the workers had nothing to import
        assert lines[1] == "after training: True []"
    assert lines[2] == "after the next launch: True"
