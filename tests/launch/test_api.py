"""The public launch API: Accelerate's parameter order, explicit arguments that win,
refusals instead of silently ignored settings, and every catchable error in nbaccel.errors.

No worker is started here (the pool's argument passing is checked in test_pool.py).
"""

from __future__ import annotations

import ast
import inspect
import os
import pathlib

import pytest

import nbaccel
from nbaccel import errors, notebook_launcher, start_workers
from nbaccel.cli import build_parser
from nbaccel.cli._options import overrides_from_args
from nbaccel.config import LaunchConfig, save_config
from nbaccel.launch.testing import plan_for as plan_launch

# notebook_launcher's parameters in Hugging Face Accelerate, in their order
ACCELERATE_ORDER = [
    "function",
    "args",
    "num_processes",
    "mixed_precision",
    "use_port",
    "master_addr",
    "node_rank",
    "num_nodes",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_conf",
    "rdzv_id",
    "max_restarts",
    "monitor_interval",
    "log_line_prefix_template",
]


def test_positional_parameters_follow_accelerate_and_the_rest_are_keyword_only():
    params = inspect.signature(notebook_launcher).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ACCELERATE_ORDER
    own = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    assert own and not set(own) & set(ACCELERATE_ORDER)
    pool_params = inspect.signature(start_workers).parameters.values()
    assert [p.name for p in pool_params if p.kind is p.POSITIONAL_OR_KEYWORD] == ["num_processes"]
    with pytest.raises(TypeError, match="return_all_ranks"):  # an option of pool.call()
        start_workers(num_processes=2, return_all_ranks=True)
    with pytest.raises(TypeError, match="num_gpus"):  # a misspelt option is named
        start_workers(num_processes=2, num_gpus=2)


def test_accelerate_style_positional_call_and_string_port():
    call = (print, (), 2, "bf16", "29512", "127.0.0.1", 0, 1, "static", "", None, "none", 0)
    bound = inspect.signature(notebook_launcher).bind(*call)  # as Accelerate's scripts call it
    plan = plan_launch(**bound.arguments)
    assert (plan.config.master_port, plan.config.mixed_precision) == (29512, "bf16")
    assert (plan.config.num_processes, plan.config.max_restarts) == (2, 0)


def _from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NBACCEL_CONFIG_FILE", str(tmp_path / "cfg.yaml"))
    save_config(LaunchConfig(max_restarts=3, start_method="spawn"), tmp_path / "cfg.yaml")
    monkeypatch.setenv("NBACCEL_NUM_NODES", "2")
    monkeypatch.setenv("NBACCEL_NODE_RANK", "1")
    monkeypatch.setenv("NBACCEL_MASTER_PORT", "29999")
    monkeypatch.setenv("NBACCEL_MASTER_ADDR", "10.1.2.3")


def test_explicit_arguments_equal_to_the_defaults_still_win(monkeypatch, tmp_path):
    # before: an argument equal to its default counted as "not given", so the file's
    # max_restarts=3 and the environment's two nodes won over num_nodes=1, max_restarts=0
    _from_environment(monkeypatch, tmp_path)
    cfg = plan_launch(
        print,
        num_processes=2,
        master_addr="127.0.0.1",
        node_rank=0,
        num_nodes=1,
        max_restarts=0,
        start_method="auto",
    ).config
    assert (cfg.num_nodes, cfg.node_rank, cfg.master_addr) == (1, 0, "127.0.0.1")
    assert (cfg.max_restarts, cfg.start_method) == (0, "auto")
    # not given: the environment and the file still apply
    cfg = plan_launch(print, num_processes=2, use_port=29999).config
    assert (cfg.num_nodes, cfg.node_rank, cfg.max_restarts) == (2, 1, 3)
    # over a config= object too
    given = LaunchConfig(num_processes=2, max_restarts=2, start_method="spawn")
    cfg = plan_launch(print, max_restarts=0, start_method="auto", config=given).config
    assert (cfg.max_restarts, cfg.start_method) == (0, "auto")


def test_cli_booleans_can_be_turned_off_and_on():
    parser = build_parser()
    off = overrides_from_args(parser.parse_args(["launch", "--no-fsdp_reshard_after_forward", "x"]))
    assert off["fsdp_reshard_after_forward"] is False
    on = overrides_from_args(parser.parse_args(["launch", "--fsdp_cpu_offload", "x"]))
    assert on["fsdp_cpu_offload"] is True and on["fsdp_reshard_after_forward"] is None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"rdzv_backend": "c10d", "num_nodes": 2}, "needs rdzv_endpoint='host:port'"),
        ({"rdzv_backend": "etcd"}, "rdzv_backend='etcd' is unknown"),
        ({"rdzv_conf": {"join_timeout": 5}}, "rdzv_conf="),
        ({"rdzv_id": "job-7"}, "rdzv_id='job-7'"),
    ],
)
def test_rendezvous_settings_that_would_be_ignored_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        notebook_launcher(print, num_processes=2, **kwargs)
    with pytest.raises(ValueError, match="needs rdzv_endpoint='host:port'"):
        start_workers(num_processes=2, num_nodes=2, rdzv_backend="c10d")


def _world_size() -> int:
    from nbaccel import PartialState

    return PartialState().num_processes


@pytest.mark.integration
def test_c10d_on_one_machine_runs_as_in_accelerates_notebook_test():
    """Accelerate's own notebook test calls notebook_launcher(f, (), num_processes=2,
    rdzv_backend="c10d"): on one machine it is the same meeting as the static one."""
    assert notebook_launcher(
        _world_size,
        (),
        num_processes=2,
        rdzv_backend="c10d",
        rdzv_conf={"join_timeout": 60},
        rdzv_id="notebook",
        return_all_ranks=True,
    ) == [2, 2]


_MACHINE = """
import sys
from nbaccel import PartialState, notebook_launcher

def where():
    state = PartialState()
    return state.process_index, state.num_processes

ranks = notebook_launcher(where, (), num_processes=1, num_nodes=2, rdzv_backend="c10d",
                          rdzv_endpoint=sys.argv[1], rdzv_id="two-machines", return_all_ranks=True)
print("RANKS", ranks)
"""


@pytest.mark.integration
def test_c10d_across_machines_gives_the_identical_cell_its_node_rank(tmp_path):
    """Two "machines" (two processes here) run the identical launch, without node_rank:
    torch elastic's c10d rendezvous numbers them, and they train as one world of 2."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    env = {**os.environ, "NBACCEL_CONFIG_FILE": str(tmp_path / "none.yaml")}
    cmd = [sys.executable, "-c", _MACHINE, endpoint]
    machines = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = []
    try:
        for machine in machines:
            outputs.append(machine.communicate(timeout=240)[0])
    finally:
        for machine in machines:
            if machine.poll() is None:
                machine.kill()
                machine.wait()
    lines = sorted(line for out in outputs for line in out.splitlines() if line.startswith("RANKS"))
    assert lines == ["RANKS [(0, 2)]", "RANKS [(1, 2)]"], outputs


def _exception_classes() -> list[tuple[str, str]]:
    """(module, class) of every public exception class defined in the package."""
    found = []
    root = pathlib.Path(nbaccel.__file__).parent
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
            if any(b.endswith(("Error", "Exception")) or b in ("Stopped",) for b in bases):
                found.append((str(path.relative_to(root)), node.name))
    return found


# control flow inside the engine: the launcher and the pool always catch it
INTERNAL = {("launch/engine/_supervisor.py", "JobFailed")}


def test_every_public_exception_is_defined_in_nbaccel_errors():
    classes = _exception_classes()
    assert ("errors.py", "WorkerTimeoutError") in classes
    outside = [(m, c) for m, c in classes if m != "errors.py" and (m, c) not in INTERNAL]
    assert not outside, f"define these in nbaccel/errors.py: {outside}"
    for name in ("WorkerTimeoutError", "Stopped", "CheckpointError", "CUDAInitializedError"):
        assert issubclass(getattr(errors, name), errors.NbaccelError)
    assert nbaccel.WorkerTimeoutError is errors.WorkerTimeoutError
