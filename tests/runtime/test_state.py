"""nbaccel.runtime.process.state: environment parsing, device/backend choice, the cached process group."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from nbaccel.errors import ConfigError, LaunchError
from nbaccel.launch.testing import find_free_port, run_on_workers
from nbaccel.runtime.process.state import (
    DistributedType,
    ProcessState,
    current_state,
    get_state,
    read_environment,
    reset_state,
)

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")


@pytest.fixture(autouse=True)
def _fresh_state():
    for name in (*_LAUNCH_VARS, "NBACCEL_TIMEOUT", "NBACCEL_USE_CPU"):
        os.environ.pop(name, None)
    reset_state()
    yield
    reset_state()


def test_read_environment_defaults_and_torchrun_variables():
    assert read_environment({}) == read_environment({"WORLD_SIZE": "1"})
    env = read_environment(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
            "NBACCEL_TIMEOUT": "12.5",
            "NBACCEL_USE_CPU": "1",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.node_rank, env.master_addr, env.master_port) == (1, "10.0.0.1", "29500")
    assert env.timeout == 12.5 and env.use_cpu
    # without LOCAL_* the local rank/node rank derive from the global ones
    derived = read_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert (derived.local_rank, derived.node_rank) == (1, 1)


@pytest.mark.parametrize(
    ("environ", "needle"),
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 must be < WORLD_SIZE=2"),
        ({"NBACCEL_TIMEOUT": "soon"}, "NBACCEL_TIMEOUT='soon'"),
        ({"NBACCEL_TIMEOUT": "-3"}, "NBACCEL_TIMEOUT='-3'"),
    ],
)
def test_read_environment_rejects_bad_values(environ, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        read_environment(environ)


def test_single_process_state_is_cached_and_immutable():
    assert current_state() is None
    state = get_state()
    assert state.world_size == 1 and state.rank == 0
    assert state.distributed_type is DistributedType.NO and state.backend is None
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert not state.use_distributed
    assert get_state() is state and current_state() is state
    with pytest.raises(AttributeError):
        state.rank = 1  # type: ignore[misc]
    cpu_state = get_state(cpu=True)  # one process: another device is fine
    assert cpu_state.device == torch.device("cpu")
    assert DistributedType.MULTI_CPU == "MULTI_CPU" and {t.value for t in DistributedType} >= {
        "NO",
        "MULTI_CPU",
        "MULTI_GPU",
        "XLA",
    }
    reset_state()
    assert current_state() is None


def test_process_state_properties():
    last = ProcessState(3, 4, 1, 2, 1, torch.device("cpu"), "gloo", DistributedType.MULTI_CPU)
    assert last.is_last_process and not last.is_main_process and not last.is_local_main_process
    assert last.use_distributed and last.num_nodes == 2


@pytest.mark.parametrize("timeout_from", ["NBACCEL_TIMEOUT", "InitProcessGroupKwargs"])
def test_failed_rendezvous_raises_launch_error_naming_address_and_fix(monkeypatch, timeout_from):
    from nbaccel import Accelerator, InitProcessGroupKwargs

    port = find_free_port()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # the second process never comes
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(LaunchError) as info:
        if timeout_from == "NBACCEL_TIMEOUT":
            monkeypatch.setenv("NBACCEL_TIMEOUT", "1")
            get_state()
        else:
            one_second = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=1))
            Accelerator(kwargs_handlers=[one_second])
    message = str(info.value)
    assert f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}" in message and "timeout 1s" in message
    assert "Fix:" in message and "NBACCEL_TIMEOUT" in message
    assert not dist.is_initialized() and current_state() is None


def test_missing_master_address_is_a_launch_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(LaunchError, match="MASTER_ADDR and MASTER_PORT is not set"):
        get_state()


def _group_facts():
    """Worker: the group is real, shared by later calls, and conflicts are refused."""
    reset_state()
    state = get_state(timeout=datetime.timedelta(seconds=60))
    out = {
        "type": state.distributed_type.value,
        "backend": state.backend,
        "device": str(state.device),
        "rank": state.rank,
        "initialized": dist.is_initialized(),
        "same": get_state() is state and get_state(cpu=True) is state,
    }
    try:
        get_state(init_kwargs={"backend": "nccl"})
    except ConfigError as err:
        out["conflict"] = str(err)
    # a group initialised by someone else is adopted, not re-created
    reset_state()
    adopted = get_state()
    out["adopted"] = (adopted.world_size, adopted.rank, adopted.backend)
    total = torch.tensor([float(state.rank + 1)])
    dist.all_reduce(total)
    out["sum"] = total.item()
    return out


def test_two_processes_form_one_real_gloo_group():
    results = run_on_workers(_group_facts, num_processes=2)
    for rank, out in enumerate(results):
        assert out["type"] == "MULTI_CPU" and out["backend"] == "gloo"
        assert out["device"] == "cpu" and out["rank"] == rank and out["initialized"]
        assert out["same"]
        assert "conflicts with the running process group" in out["conflict"]
        assert out["adopted"] == (2, rank, "gloo")
        assert out["sum"] == 3.0


def _exit_handlers_destroy_the_group() -> tuple[int, bool, bool]:
    import atexit

    from nbaccel.runtime.process import state

    reset_state()
    handlers = atexit._ncallbacks()
    get_state()
    registered = atexit._ncallbacks() - handlers
    before = dist.is_initialized()
    # both ranks have joined before either tears down: a rank that destroys its group
    # while its peer is still connecting the gloo mesh fails that peer ("closed by peer")
    dist.barrier()
    # what the interpreter runs at a script's normal exit (running every exit function
    # here would also run multiprocessing's, which joins this very worker)
    state._destroy_group_at_exit()
    return registered, before, dist.is_initialized()


@pytest.mark.integration
def test_group_created_by_nbaccel_is_destroyed_at_exit():
    # a group left open at exit makes torch abort (status 134) in some runs of a script
    assert (
        run_on_workers(_exit_handlers_destroy_the_group, num_processes=2) == [(1, True, False)] * 2
    )
