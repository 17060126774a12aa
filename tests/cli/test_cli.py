"""The ``nbaccel`` command, run as a real subprocess (and the questionnaire through a pty).

Every test points NBACCEL_CONFIG_FILE and XDG_CACHE_HOME into tmp_path, so the
real ~/.cache is never read or written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nbaccel.config import LaunchConfig, load_config, save_config

NBACCEL = [sys.executable, "-m", "nbaccel"]


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBACCEL_")}
    env.update(
        NBACCEL_CONFIG_FILE=str(tmp_path / "config" / "default_config.yaml"),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        PYTHONUNBUFFERED="1",
    )
    env.pop("OMP_NUM_THREADS", None)
    return env


def nbaccel(
    *args: str, env: dict[str, str], timeout: float = 240, **kw
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*NBACCEL, *args], env=env, capture_output=True, text=True, timeout=timeout, **kw
    )


# ----------------------------------------------------------------------------- help


@pytest.mark.parametrize("command", [[], ["config"], ["launch"], ["test"], ["env"]])
def test_help_everywhere_with_examples(command, cli_env):
    out = nbaccel(*command, "--help", env=cli_env)
    assert out.returncode == 0, out.stderr
    assert "usage: nbaccel" in out.stdout
    assert "examples:" in out.stdout


def test_console_script_and_version(cli_env):
    script = shutil.which("nbaccel", path=os.path.dirname(sys.executable))
    assert script is not None, "the nbaccel console script is not installed in this environment"
    out = subprocess.run([script, "--version"], env=cli_env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("nbaccel ")


def test_choices_come_from_the_config_module(cli_env):
    from nbaccel.config import COMPUTE_DEVICES, PRECISIONS, START_METHODS

    text = nbaccel("launch", "--help", env=cli_env).stdout
    for choices in (PRECISIONS, START_METHODS, COMPUTE_DEVICES):
        assert "{" + ",".join(choices) + "}" in text


def test_no_command_prints_help(cli_env):
    out = nbaccel(env=cli_env)
    assert out.returncode == 2 and "COMMAND" in out.stdout


# --------------------------------------------------------------------------- config


def test_config_default_writes_a_valid_file(cli_env):
    path = Path(cli_env["NBACCEL_CONFIG_FILE"])
    out = nbaccel("config", "--default", "--mixed_precision", "bf16", env=cli_env)
    assert out.returncode == 0, out.stderr
    assert str(path) in out.stdout
    cfg = load_config(path)
    assert cfg.mixed_precision == "bf16" and cfg.num_processes is not None
    # never overwritten silently ...
    out = nbaccel("config", "--default", "--mixed_precision", "fp16", env=cli_env)
    assert out.returncode == 0 and "already exists" in out.stdout
    assert load_config(path).mixed_precision == "bf16"
    # ... unless asked to
    out = nbaccel("config", "--default", "--force", env=cli_env)
    assert out.returncode == 0 and load_config(path).mixed_precision == "no"


def test_config_default_to_explicit_path(cli_env, tmp_path):
    target = tmp_path / "elsewhere" / "c.yaml"
    out = nbaccel("config", "--default", "--config_file", str(target), env=cli_env)
    assert out.returncode == 0, out.stderr
    assert load_config(target).mixed_precision == "no"
    assert not Path(cli_env["NBACCEL_CONFIG_FILE"]).exists()


def test_config_default_path_from_xdg(cli_env, tmp_path):
    del cli_env["NBACCEL_CONFIG_FILE"]
    out = nbaccel("config", "--default", env=cli_env)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "cache" / "nbaccel" / "default_config.yaml").exists()


def test_questionnaire_through_a_pseudo_terminal(cli_env):
    pexpect = pytest.importorskip("pexpect")
    path = Path(cli_env["NBACCEL_CONFIG_FILE"])
    child = pexpect.spawn(
        NBACCEL[0], [*NBACCEL[1:], "config"], env=cli_env, encoding="utf-8", timeout=60
    )
    try:

        def answer(field: str, text: str) -> None:
            child.expect(rf"{field} \[")
            child.expect("default .*: ")
            child.sendline(text)

        def rejected() -> None:
            child.expect("invalid: ")

        answer("compute_device", "cpu")
        answer("num_processes", "0")
        rejected()
        answer("num_processes", "3")
        answer("mixed_precision", "fp64")
        rejected()
        answer("mixed_precision", "BF16")
        answer("gradient_accumulation_steps", "")  # Enter keeps the default
        answer("num_nodes", "2")
        answer("node_rank", "2")  # must be < num_nodes
        rejected()
        answer("node_rank", "1")
        answer("master_addr", "10.0.0.2")
        answer("master_port", "")  # default offered for several nodes: 29500
        answer("cluster", "")  # Enter: this machine (no Ray cluster)
        answer("start_method", "spawn")
        answer("max_restarts", "")
        answer("timeout", "soon")
        rejected()
        answer("timeout", "60")
        answer("debug", "yes")
        answer("hang_after", "-1")
        rejected()
        answer("hang_after", "600")
        answer("on_hang", "")
        answer("debug_collectives", "")
        answer("strategy", "fsdp")  # the FSDP options are asked only after choosing fsdp
        answer("fsdp_auto_wrap_policy", "size_wrap")
        rejected()
        answer("fsdp_auto_wrap_policy", "size_based_wrap")
        answer("fsdp_transformer_cls_names_to_wrap", "")
        answer("fsdp_min_num_params", "1000000")
        answer("fsdp_reshard_after_forward", "")
        answer("fsdp_cpu_offload", "")
        answer("fsdp_activation_checkpointing", "yes")
        answer("fsdp_state_dict_type", "full_state_dict")
        answer("fsdp_cpu_ram_efficient_loading", "")
        child.expect("Configuration saved to")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert load_config(path) == LaunchConfig(
        compute_device="cpu",
        num_processes=3,
        mixed_precision="bf16",
        num_nodes=2,
        node_rank=1,
        master_addr="10.0.0.2",
        master_port=29500,
        start_method="spawn",
        timeout=60.0,
        debug=True,
        hang_after=600.0,
        strategy="fsdp",
        fsdp_auto_wrap_policy="size_based_wrap",
        fsdp_min_num_params=1_000_000,
        fsdp_activation_checkpointing=True,
        fsdp_state_dict_type="FULL_STATE_DICT",
    )


def test_questionnaire_defaults_come_from_the_existing_file(cli_env):
    path = save_config(
        LaunchConfig(compute_device="cpu", num_processes=4, mixed_precision="bf16"),
        cli_env["NBACCEL_CONFIG_FILE"],
    )
    # plain pipe, every answer empty: the existing values are kept
    out = nbaccel("config", env=cli_env, input="\n" * 20)
    assert out.returncode == 0, out.stderr
    assert "default 4" in out.stdout and "default bf16" in out.stdout
    assert load_config(path).num_processes == 4


def test_questionnaire_aborted_writes_nothing(cli_env):
    out = nbaccel("config", env=cli_env, input="cpu\n")
    assert out.returncode == 1
    assert "nothing was written" in out.stderr
    assert not Path(cli_env["NBACCEL_CONFIG_FILE"]).exists()


# --------------------------------------------------------------------------- launch

TRAIN_SCRIPT = """
import json, os, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from nbaccel import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
x = torch.linspace(-1, 1, 32).unsqueeze(1)
data = DataLoader(TensorDataset(x, 3 * x - 1), batch_size=4)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
losses = []
for epoch in range(3):
    for inputs, targets in data:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
# one write per line: under `python -u` print() writes the text and the newline separately,
# so lines of the two ranks could interleave in the shared pipe
sys.stdout.write("RESULT " + json.dumps({
    "rank": accelerator.process_index,
    "world": accelerator.num_processes,
    "batches": len(data),
    "first": losses[0],
    "last": losses[-1],
    "weights": weights.tolist(),
    "args": sys.argv[1:],
    "precision": accelerator.mixed_precision,
    "nbaccel_env": sorted(k for k in os.environ if k.startswith("NBACCEL_") and k != "NBACCEL_CONFIG_FILE"),
    "omp": os.environ.get("OMP_NUM_THREADS"),
}) + "\\n")
sys.stdout.flush()
"""


def _results(stdout: str) -> list[dict]:
    import json

    rows = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.integration
def test_launch_trains_on_two_cpu_processes(cli_env, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    # the config file says bf16; the flag must win (arguments > file)
    save_config(LaunchConfig(mixed_precision="bf16"), cli_env["NBACCEL_CONFIG_FILE"])
    # as a module (`-m train`, found in the working directory, its arguments its own); a
    # script's path is what every other launch here and in tests/scripts/ gives
    out = nbaccel(
        "launch", "--num_processes", "2", "--cpu", "--mixed_precision", "no",
        "-m", "train", "--lr", "0.3", env=cli_env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    results = _results(out.stdout)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["world"] == 2
        assert r["batches"] == 4  # 8 batches of the dataset, sharded over 2 processes
        assert r["last"] < r["first"]
        assert r["args"] == ["--lr", "0.3"]
        assert r["precision"] == "no" and r["nbaccel_env"] == []  # typed, not as text
        assert r["omp"] == str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert results[0]["weights"] == results[1]["weights"]


@pytest.mark.integration
def test_launch_single_process_uses_plain_python(cli_env, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    save_config(LaunchConfig(compute_device="cpu", num_processes=1), cli_env["NBACCEL_CONFIG_FILE"])
    out = nbaccel("launch", str(script), env=cli_env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    (result,) = _results(out.stdout)
    assert result["world"] == 1 and result["batches"] == 8


FAILING_SCRIPT = """
import os, sys
rank = int(os.environ.get("RANK", "0"))
print(f"rank {rank} running", flush=True)
if rank == int(sys.argv[1]):
    sys.exit(int(sys.argv[2]))
if sys.argv[2] == "raise":
    raise RuntimeError("boom")
"""


@pytest.mark.integration
# (one process: test_a_script_exits_with_its_own_code)
@pytest.mark.parametrize(("nproc", "failing_rank", "code"), [(2, 1, 3)])
def test_launch_propagates_the_exit_code(cli_env, tmp_path, nproc, failing_rank, code):
    script = tmp_path / "fail.py"
    script.write_text(FAILING_SCRIPT)
    out = nbaccel(
        "launch", "--cpu", "--num_processes", str(nproc), str(script),
        str(failing_rank), str(code), env=cli_env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == code, out.stdout + out.stderr
    if nproc > 1:
        assert f"rank {failing_rank}" in out.stderr and f"code {code}" in out.stderr


@pytest.mark.integration
def test_launch_uncaught_exception_exits_1(cli_env, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING_SCRIPT)
    out = nbaccel(
        "launch", "--cpu", "--num_processes", "2", str(script), "-1", "raise",
        env=cli_env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 1
    assert "RuntimeError: boom" in out.stderr


RESTARTED_SCRIPT = """
import os, sys
if os.environ["RANK"] == "1" and not os.path.exists("failed-once"):
    open("failed-once", "w").close()
    sys.exit(3)
print("attempt done", flush=True)
"""


@pytest.mark.integration
def test_launch_restarts_through_the_launchers_one_restart_loop(cli_env, tmp_path):
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED_SCRIPT)
    out = nbaccel(
        "launch", "--cpu", "--num_processes", "2", "--max_restarts", "1", str(script),
        env=cli_env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    # notebook_launcher's loop and words: which failure caused the restart
    assert "workers failed (rank 1" in out.stderr and "restarting, attempt 1 of 1" in out.stderr
    assert out.stdout.count("attempt done") >= 2, out.stdout


def test_launch_rejects_bad_settings_before_starting(cli_env, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('should not run')\n")
    out = nbaccel("launch", "--num_processes", "0", str(script), env=cli_env)
    assert out.returncode == 2 and "num_processes=0" in out.stderr
    out = nbaccel("launch", str(tmp_path / "missing.py"), env=cli_env)
    assert out.returncode == 2 and "does not exist" in out.stderr
    Path(cli_env["NBACCEL_CONFIG_FILE"]).parent.mkdir(parents=True, exist_ok=True)
    Path(cli_env["NBACCEL_CONFIG_FILE"]).write_text("num_gpus: 2\n")
    out = nbaccel("launch", str(script), env=cli_env)
    assert out.returncode == 2 and "unknown key 'num_gpus'" in out.stderr
    assert "should not run" not in out.stdout


# ----------------------------------------------------------------------------- test


@pytest.mark.integration
def test_nbaccel_test_passes_on_cpu(cli_env):
    out = nbaccel("test", "--cpu", env=cli_env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 process(es) per node" in out.stdout
    for check in ("sharding", "gather", "training", "in sync"):
        assert f"[ok] {check}" in out.stdout
    assert "nbaccel test: PASS" in out.stdout


def test_nbaccel_test_reports_an_invalid_config_as_fail(cli_env):
    out = nbaccel("test", "--num_nodes", "2", env=cli_env)
    assert out.returncode == 1 and "FAIL" in out.stderr and "master_port" in out.stderr


# ------------------------------------------------------------------------------ env


def test_env_prints_versions_devices_and_config(cli_env):
    save_config(LaunchConfig(num_processes=2), cli_env["NBACCEL_CONFIG_FILE"])
    out = nbaccel("env", env={**cli_env, "NBACCEL_MIXED_PRECISION": "bf16"})
    assert out.returncode == 0, out.stderr
    for fragment in ("nbaccel", "torch", "Platform", "Devices", cli_env["NBACCEL_CONFIG_FILE"]):
        assert fragment in out.stdout
    assert "num_processes" in out.stdout and "NBACCEL_MIXED_PRECISION" in out.stdout


def test_env_reports_a_broken_config_without_failing(cli_env):
    path = Path(cli_env["NBACCEL_CONFIG_FILE"])
    path.parent.mkdir(parents=True)
    path.write_text("num_processes: [\n")
    out = nbaccel("env", env=cli_env)
    assert out.returncode == 0 and "not valid YAML" in out.stdout


def test_env_in_process_does_not_initialise_cuda(cli_env, monkeypatch, capsys):
    import torch

    from nbaccel.cli import main

    for key, value in cli_env.items():
        monkeypatch.setenv(key, value)
    assert main(["env"]) == 0
    assert "Devices" in capsys.readouterr().out
    assert not torch.cuda.is_initialized()


def test_script_arguments_are_not_parsed_by_nbaccel(cli_env, tmp_path):
    script = tmp_path / "echo.py"
    script.write_text("import sys; print(sys.argv[1:])\n")
    save_config(LaunchConfig(compute_device="cpu", num_processes=1), cli_env["NBACCEL_CONFIG_FILE"])
    out = nbaccel("launch", str(script), "--num_processes", "7", "--help", env=cli_env)
    assert out.returncode == 0, out.stderr
    assert textwrap.dedent(out.stdout).strip() == "['--num_processes', '7', '--help']"


def test_a_script_leaves_with_its_group_destroyed_and_its_exit_handlers_run(cli_env, tmp_path):
    # A process group left alive at exit makes torch abort in some runs (exit code 134).
    script = tmp_path / "group.py"
    script.write_text(
        "import atexit, sys\n"
        "import torch.distributed as dist\n"
        "from nbaccel.launch.testing import find_free_port\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{find_free_port()}',\n"
        "                        rank=0, world_size=1)\n"
        "atexit.register(lambda: print('alive at exit:', dist.is_initialized()))\n"
        "print('main:', __name__, 'argv:', sys.argv)\n"
    )
    out = nbaccel("launch", "--cpu", "--num_processes", "1", str(script), "x", env=cli_env)
    assert out.returncode == 0, out.stderr
    assert f"main: __main__ argv: ['{script}', 'x']" in out.stdout
    assert "alive at exit: False" in out.stdout


@pytest.mark.parametrize(
    ("body", "code", "stderr"),
    [
        ("import sys\nsys.exit(3)\n", 3, ""),
        ("import sys\nsys.exit('bad input')\n", 1, "bad input"),
        ("raise ValueError('boom')\n", 1, "ValueError: boom"),
    ],
)
def test_a_script_exits_with_its_own_code(cli_env, tmp_path, body, code, stderr):
    # the worker leaves through os._exit (no C++ teardown abort), so it must carry the code
    script = tmp_path / "exits.py"
    script.write_text("import atexit\natexit.register(lambda: print('handlers ran'))\n" + body)
    out = nbaccel("launch", "--cpu", "--num_processes", "1", str(script), env=cli_env)
    assert out.returncode == code, out.stderr
    assert stderr in out.stderr
    assert "handlers ran" in out.stdout
