"""notebook_launcher driven from cells of a REAL IPython kernel (jupyter_client + ipykernel).

Every test launches 2 CPU workers from a cell, the way a notebook user does, and
then proves the kernel has no live child process left. One kernel is shared by
the module (starting one and importing torch costs seconds on a 2-core runner);
a test that leaves it busy gets a fresh one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import psutil
import pytest
from kernel_harness import KernelSession, describe_processes, module_kernel, wait_gone
from waits import HANG_GUARD_S

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SETUP = """
import os, re, signal, sys, time, traceback
import torch
from torch import nn
from nbaccel import Accelerator, notebook_launcher
from nbaccel.errors import CUDAInitializedError

# Count every os.fork() made in the kernel: "nothing was forked" must be provable.
FORKS = [0]
os.register_at_fork(before=lambda: FORKS.__setitem__(0, FORKS[0] + 1))
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelSession]:
    yield from module_kernel(tmp_path_factory, SETUP)


@pytest.fixture(autouse=True)
def _kernel_left_clean(kernel: KernelSession) -> Iterator[None]:
    yield
    if kernel.busy or not kernel.is_alive():
        # A cell timed out: the kernel is in an unknown state; later tests get a fresh one.
        kernel.restart()
        kernel.run(SETUP, timeout=120)
    kernel.assert_no_descendants(timeout=5)
    zombies = [p for p in psutil.Process(kernel.pid).children() if p.status() == "zombie"]
    assert not zombies, f"the kernel left zombie children:\n{describe_processes(zombies)}"


def assert_all_gone(seen: dict[int, psutil.Process], timeout: float, what: str) -> None:
    alive = wait_gone(list(seen.values()), timeout=max(timeout, 0.0))
    assert not alive, f"{what}: still alive (orphans count too):\n{describe_processes(alive)}"


# ---------------------------------------------------------------------------- 1
EARLIER_CELL = """
SCALE = 3.0                                   # a global from an earlier cell
make_target = lambda n: torch.full((n, 1), SCALE)
"""

TRAIN_CELL = """
def train(steps):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    loss_fn = lambda out, target: ((out - target) ** 2).mean()
    x, y = torch.ones(8, 4), make_target(8)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
    rank = accelerator.process_index
    for i in range(40):
        print(f"payload-{rank}-{i:02d}-" + "x" * 120, flush=(i % 3 == 0))
    print(f"to-stderr-{rank}", file=sys.stderr)
    return accelerator.unwrap_model(model).weight.detach()

result = notebook_launcher(train, args=(5,), num_processes=2)
"""

CHECK_TRAIN_CELL = """
torch.manual_seed(0)
reference = nn.Linear(4, 1)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
for _ in range(5):
    ref_opt.zero_grad()
    ((reference(torch.ones(8, 4)) - make_target(8)) ** 2).mean().backward()
    ref_opt.step()
train_check = {
    "type": type(result).__name__,
    "device": str(getattr(result, "device", None)),
    "shape": list(getattr(result, "shape", [])),
    "matches_reference": isinstance(result, torch.Tensor)
        and torch.allclose(result, reference.weight.detach(), atol=1e-6),
}
torch.manual_seed(0)
train_check["changed_by_training"] = isinstance(result, torch.Tensor) and not torch.allclose(
    result, nn.Linear(4, 1).weight.detach())
"""

_PAYLOAD = re.compile(r"^(?P<prefix>.*?)payload-(?P<rank>\d)-(?P<i>\d\d)-(?P<tail>.*)$")


def _rank_in_prefix(prefix: str, rank: str) -> bool:
    return bool(prefix.strip()) and re.search(rf"(?<!\d){rank}(?!\d)", prefix) is not None


@pytest.mark.timeout(120)
def test_cell_defined_training_returns_rank0_tensor_and_shows_both_ranks_output(kernel):
    kernel.run(EARLIER_CELL)
    with kernel.watch_descendants() as seen:
        cell = kernel.run(TRAIN_CELL, timeout=90)
    assert len(seen) >= 2, (
        f"expected 2 worker processes, saw {describe_processes(list(seen.values()))}"
    )

    kernel.run(CHECK_TRAIN_CELL)
    check = kernel.evaluate_json("train_check")
    assert check["type"] == "Tensor", check
    assert check["device"] == "cpu", check
    assert check["shape"] == [1, 4], check
    assert check["changed_by_training"], check
    assert check["matches_reference"], (
        f"rank 0's weights differ from the same training in one process: {check}"
    )

    # Output of both ranks, each line whole and rank-prefixed.
    lines = [line for line in cell.stdout.splitlines() if "payload-" in line]
    seen_lines: dict[str, set[str]] = {"0": set(), "1": set()}
    for line in lines:
        match = _PAYLOAD.match(line)
        assert match, f"mangled line: {line!r}"
        assert match["tail"] == "x" * 120, f"line not whole (interleaved?): {line!r}"
        assert "payload-" not in match["prefix"], f"two lines merged: {line!r}"
        assert _rank_in_prefix(match["prefix"], match["rank"]), f"line not rank-prefixed: {line!r}"
        seen_lines[match["rank"]].add(match["i"])
    expected = {f"{i:02d}" for i in range(40)}
    assert seen_lines == {"0": expected, "1": expected}, cell.describe()
    for rank in ("0", "1"):
        err_lines = [line for line in cell.stderr.splitlines() if f"to-stderr-{rank}" in line]
        assert len(err_lines) == 1, (
            f"rank {rank}'s stderr missing from the cell:\n{cell.describe()}"
        )
        prefix = err_lines[0].split(f"to-stderr-{rank}")[0]
        assert _rank_in_prefix(prefix, rank), err_lines


# ---------------------------------------------------------------------------- 2
FAIL_CELL = """
def fails_on_rank1():
    accelerator = Accelerator()
    if accelerator.process_index == 1:
        raise ValueError(f"bad batch 17 at {time.time()!r}")
    accelerator.wait_for_everyone()   # rank 0 is left waiting for its dead peer
    time.sleep(600)                   # longer than the cell may take: it is not waited for
    return "unreachable"

caught = None
try:
    notebook_launcher(fails_on_rank1, num_processes=2)
except ValueError as err:             # the same exception type works in the cell
    caught = err
t_caught = time.time()
full = "".join(traceback.format_exception(caught)) if caught is not None else ""
raised_at = re.search(r"bad batch 17 at ([0-9.]+)", full)
failure = {
    "type": type(caught).__name__,
    "message": str(caught),
    "full": full,
    "latency": t_caught - float(raised_at.group(1)) if raised_at else None,
}
"""

RELAUNCH_CELL = """
def world_size():
    accelerator = Accelerator()
    accelerator.wait_for_everyone()
    return accelerator.num_processes

relaunch = notebook_launcher(world_size, num_processes=2)
"""


@pytest.mark.timeout(120)
def test_failure_in_rank1_surfaces_as_same_type_then_relaunch_works(kernel):
    with kernel.watch_descendants() as seen:
        kernel.run(FAIL_CELL, timeout=60)
    failure = kernel.evaluate_json("failure")
    assert failure["type"] != "NoneType", "no ValueError reached the cell"
    message, full = failure["message"], failure["full"]
    # The headline is the FIRST real failure (rank 1's ValueError), not rank 0's secondary
    # "connection closed by peer"; secondary errors may be listed further down.
    headline = message.strip().splitlines()[0]
    assert re.search(r"rank\W{0,3}1\b", headline), f"headline does not name rank 1: {message!r}"
    assert "ValueError" in headline and "bad batch 17" in headline, message
    assert "connection closed" not in headline.lower(), message
    # The remote traceback points into the cell: the function name and its raise line.
    assert "fails_on_rank1" in full, full
    assert 'raise ValueError(f"bad batch 17 at {time.time()!r}")' in full, full
    assert failure["latency"] is not None, f"the remote message is missing: {full}"
    assert len(seen) >= 2
    assert_all_gone(seen, HANG_GUARD_S, "workers after a failure")

    kernel.run(RELAUNCH_CELL, timeout=60)
    assert kernel.evaluate_json("relaunch") == 2


# ---------------------------------------------------------------------------- 3
LONG_TRAINING_CELL = """
def long_training():
    accelerator = Accelerator()
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.ones(8, 4)
    step = 0
    while True:
        optimizer.zero_grad()
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        step += 1
        if step == 3:
            print(f"training-started-{accelerator.process_index}", flush=True)
        time.sleep(0.01)

notebook_launcher(long_training, num_processes=2, start_method="START_METHOD")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["auto", "spawn"])
def test_interrupt_during_training_kills_every_worker(kernel, start_method):
    with kernel.watch_descendants() as seen:
        msg_id = kernel.submit(LONG_TRAINING_CELL.replace("START_METHOD", start_method))
        kernel.wait_for_output(msg_id, r"training-started-\d", count=2, timeout=60)
        workers = dict(seen)
        kernel.interrupt()
        cell = kernel.collect(msg_id, timeout=30)
    assert len(workers) >= 2, describe_processes(list(workers.values()))
    assert cell.error is not None and cell.error.ename == "KeyboardInterrupt", cell.describe()
    # what the user reads: the cell, then the interrupt -- not pages of nbaccel's frames
    assert "every worker is gone" in cell.error.text, cell.error.text
    assert "nbaccel/launch" not in cell.error.text, cell.error.text
    # in this order: every worker gone, then KeyboardInterrupt in the cell
    kernel.assert_no_descendants(timeout=0)
    assert_all_gone(seen, 0, "workers when KeyboardInterrupt reached the cell")

    kernel.run(RELAUNCH_CELL, timeout=60)
    assert kernel.evaluate_json("relaunch") == 2


# ---------------------------------------------------------------------------- 4
SPAWN_CELL = """
FACTOR = 2.0

class TinyNet(nn.Module):                     # a cell-defined nn.Module subclass
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return torch.relu(self.fc(x)) * FACTOR

def spawned(tag):
    import psutil
    accelerator = Accelerator()
    model = accelerator.prepare(TinyNet())
    out = model(torch.ones(3, 4))
    forked = "ipykernel_launcher" in " ".join(psutil.Process().cmdline())
    return [accelerator.process_index, accelerator.num_processes,
            type(accelerator.unwrap_model(model)).__name__, list(out.shape), tag, forked]

spawn_results = notebook_launcher(spawned, args=("t",), num_processes=2, start_method="spawn",
                                  return_all_ranks=True)
"""


@pytest.mark.timeout(180)
def test_spawn_runs_cell_defined_function_and_module(kernel):
    kernel.run(SPAWN_CELL, timeout=150)
    results = kernel.evaluate_json("spawn_results")
    assert results == [
        [0, 2, "TinyNet", [3, 2], "t", False],
        [1, 2, "TinyNet", [3, 2], "t", False],
    ]


# ---------------------------------------------------------------------------- 5
FORK_GUARD_CELL = """
def where_am_i():
    import psutil
    accelerator = Accelerator()
    return ["ipykernel_launcher" in " ".join(psutil.Process().cmdline()), accelerator.num_processes]

saved_flag = torch.cuda._initialized
torch.cuda._initialized = True                # simulate CUDA initialised in the kernel
guard = {}
try:
    assert torch.cuda.is_initialized()
    forks_before = FORKS[0]
    try:
        notebook_launcher(where_am_i, num_processes=2, start_method="fork")
        guard["fork"] = ["no error", ""]
    except CUDAInitializedError as err:
        guard["fork"] = [type(err).__name__, str(err)]
    guard["forks_during_refusal"] = FORKS[0] - forks_before
    guard["auto"] = notebook_launcher(where_am_i, num_processes=2, start_method="auto",
                                      return_all_ranks=True)
finally:
    torch.cuda._initialized = saved_flag
guard["restored"] = torch.cuda.is_initialized() == saved_flag
"""


@pytest.mark.timeout(180)
def test_fork_guard_refuses_fork_and_auto_falls_back_to_spawn(kernel):
    kernel.run(FORK_GUARD_CELL, timeout=150)
    guard = kernel.evaluate_json("guard")
    kind, message = guard["fork"]
    assert kind == "CUDAInitializedError", guard
    assert "spawn" in message and "restart" in message.lower(), message
    assert guard["forks_during_refusal"] == 0, "the launcher forked before refusing"
    # auto: spawned (not forked from the kernel), and it worked on both ranks
    assert guard["auto"] == [[False, 2], [False, 2]], guard
    assert guard["restored"]


# ---------------------------------------------------------------------------- 6
HOLD_CELL = """
def hold_rendezvous():
    accelerator = Accelerator()
    print(f"holding-{accelerator.process_index} port={os.environ.get('MASTER_PORT')}", flush=True)
    time.sleep(3)
    accelerator.wait_for_everyone()
    return True

held = notebook_launcher(hold_rendezvous, num_processes=2)
"""

_LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|::1|::ffff:127\.\d+\.\d+\.\d+)$")


@pytest.mark.timeout(120)
def test_rendezvous_listens_on_loopback_only(kernel):
    before = set(kernel.listening_sockets(include_kernel=True))
    msg_id = kernel.submit(HOLD_CELL)
    partial = kernel.wait_for_output(msg_id, r"holding-\d port=", count=2, timeout=60)
    during = kernel.listening_sockets(include_kernel=True)
    kernel.collect(msg_id, timeout=60).raise_for_error()
    after = set(kernel.listening_sockets(include_kernel=True))

    new = [sock for sock in during if sock not in before]
    assert new, "no listening socket found while the workers were in the rendezvous"
    wildcard = [sock for sock in new if sock[1] in ("0.0.0.0", "::", "")]
    assert not wildcard, f"sockets bound to all interfaces: {wildcard}"
    public = [sock for sock in new if not _LOOPBACK.match(sock[1])]
    assert not public, f"sockets bound to a non-loopback address: {public}"
    port = int(re.search(r"port=(\d+)", partial.stdout).group(1))
    assert any(sock[2] == port for sock in new), f"nothing listens on MASTER_PORT {port}: {new}"
    assert after == before, f"the launch left listening sockets in the kernel: {after - before}"
    assert kernel.evaluate_json("held") is True


def test_the_test_kernel_takes_no_tcp_port_picked_for_it(kernel):
    """The harness's kernels talk over IPC sockets: a TCP port the manager picked free could
    be taken by another process (a rendezvous, a Ray node, a test beside) before the kernel
    bound it, and the kernel died at start ("Address already in use": a CI run lost a test so).
    """
    info = kernel.connection_info()
    assert info["transport"] == "ipc", info
    ports = {info[name] for name in ("shell_port", "iopub_port", "stdin_port", "hb_port")}
    held = {port for _, _, port in kernel.listening_sockets(include_kernel=True)}
    assert not ports & held, (info, held)


# ---------------------------------------------------------------------------- 7
BAD_INPUT_CELL = """
def whoami():
    return os.getpid()

bad_calls = {
    "num_processes=0": lambda: notebook_launcher(whoami, num_processes=0),
    "num_processes=-2": lambda: notebook_launcher(whoami, num_processes=-2),
    "num_processes=1.5": lambda: notebook_launcher(whoami, num_processes=1.5),
    "function=whoami()": lambda: notebook_launcher(whoami(), num_processes=2),
    "node_rank=2": lambda: notebook_launcher(whoami, num_processes=2, num_nodes=2, node_rank=2),
    "mixed_precision='fp12'": lambda: notebook_launcher(whoami, num_processes=2,
                                                         mixed_precision="fp12"),
}
bad_outcomes = {}
forks_before = FORKS[0]
for label, call in bad_calls.items():
    try:
        call()
        bad_outcomes[label] = ["no error", False, False, ""]
    except Exception as err:
        bad_outcomes[label] = [type(err).__name__, isinstance(err, ValueError),
                               isinstance(err, TypeError), str(err)]
bad_outcomes["forks"] = FORKS[0] - forks_before
"""


@pytest.mark.timeout(120)
def test_bad_input_raises_before_anything_starts(kernel):
    with kernel.watch_descendants(interval=0.01) as seen:
        kernel.run(BAD_INPUT_CELL, timeout=60)
    outcomes = kernel.evaluate_json("bad_outcomes")
    assert outcomes.pop("forks") == 0, "the launcher forked before rejecting bad input"
    assert not seen, f"processes were started: {describe_processes(list(seen.values()))}"
    expected = {
        "num_processes=0": ("num_processes", "value"),
        "num_processes=-2": ("num_processes", "value"),
        "num_processes=1.5": ("num_processes", "either"),
        "function=whoami()": ("function", "type"),
        "node_rank=2": ("node_rank", "value"),
        "mixed_precision='fp12'": ("mixed_precision", "value"),
    }
    for label, (argument, kind) in expected.items():
        name, is_value, is_type, message = outcomes[label]
        ok_kind = {"value": is_value, "type": is_type, "either": is_value or is_type}[kind]
        assert ok_kind, f"{label}: expected a {kind} error, got {name}: {message}"
        assert argument in message, f"{label}: the message does not name {argument!r}: {message}"
    message = outcomes["function=whoami()"][3]
    assert "result" in message.lower(), f"no 'pass the function, not its result' hint: {message}"


# ---------------------------------------------------------------------------- 8
PRECISION_CELL = """
def precision_seen():
    return Accelerator().mixed_precision

env_before, cwd_before = dict(os.environ), os.getcwd()
handlers_before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}
precisions = notebook_launcher(precision_seen, num_processes=2, mixed_precision="bf16",
                               return_all_ranks=True)
left_as_found = {
    "env": dict(os.environ) == env_before,
    "env_diff": sorted(set(os.environ.items()) ^ set(env_before.items())),
    "cwd": os.getcwd() == cwd_before,
    "signals": {s: signal.getsignal(s) for s in handlers_before} == handlers_before,
}
"""


@pytest.mark.timeout(120)
def test_mixed_precision_reaches_the_accelerator_and_kernel_is_left_as_found(kernel):
    kernel.run(PRECISION_CELL, timeout=60)
    assert kernel.evaluate_json("precisions") == ["bf16", "bf16"]
    state = kernel.evaluate_json("left_as_found")
    assert state["env"], f"the launch changed the kernel's environment: {state['env_diff']}"
    assert state["cwd"] and state["signals"], state


# ---------------------------------------------------------------------------- 9
EXISTING_ACCELERATOR_CELL = """
import nbaccel.runtime.process.state

def worker_pid():
    return os.getpid()

existing = {}
kernel_accelerator = Accelerator()            # a mistake: created in the kernel, not in the function
try:
    forks_before = FORKS[0]
    try:
        notebook_launcher(worker_pid, num_processes=2)
        existing["refusal"] = ["no error", False, ""]
    except Exception as err:
        existing["refusal"] = [type(err).__name__, isinstance(err, ValueError), str(err)]
    existing["forks"] = FORKS[0] - forks_before
finally:
    del kernel_accelerator
    nbaccel.runtime.process.state.reset_state()
existing["after_reset"] = notebook_launcher(worker_pid, num_processes=2) != os.getpid()
"""


@pytest.mark.timeout(120)
def test_accelerator_already_in_kernel_is_refused_before_forking(kernel):
    kernel.run(EXISTING_ACCELERATOR_CELL, timeout=60)
    existing = kernel.evaluate_json("existing")
    name, is_value, message = existing["refusal"]
    assert is_value, f"expected a ValueError, got {name}: {message}"
    assert "Accelerator" in message and "restart" in message.lower(), message
    assert existing["forks"] == 0, "the launcher forked before refusing"
    assert existing["after_reset"] is True
