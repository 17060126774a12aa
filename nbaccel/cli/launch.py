"""``nbaccel launch``: run a training script on every device of this machine (or several).

One process runs the script with plain ``python``; several run it through torch's
own elastic launcher (``torch.distributed.run``, i.e. torchrun) inside this
process, so nbaccel invents no rendezvous of its own. The resolved settings reach
``Accelerator()`` in the script through ``NBACCEL_*`` environment variables.

On a single machine the rendezvous is what the notebook path uses: a free port
(unless ``--main_process_port`` is given) and torch's TCPStore listening on
127.0.0.1 only, never on every interface, so two launches on one machine do not
collide and the store cannot be reached from the network.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config import LaunchConfig, resolve_launch_config, strategy_environment
from ..errors import ConfigError
from ._options import add_config_arguments, overrides_from_args

EPILOG = """\
examples:
  nbaccel launch train.py --epochs 3                 # settings from the config file
  nbaccel launch --num_processes 2 --cpu train.py    # 2 CPU processes over gloo
  nbaccel launch --mixed_precision bf16 train.py     # every GPU, bf16 autocast
  nbaccel launch -m mypackage.train --lr 1e-3        # run a module, like python -m
  # two machines; run this on each, with its own --machine_rank (0 and 1):
  nbaccel launch --num_machines 2 --machine_rank 0 \\
      --main_process_ip 10.0.0.1 --main_process_port 29500 train.py

Arguments after the script name are passed to the script unchanged. The exit
code is the script's (the first failing rank's, for several processes).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run a training script on all devices (torchrun for several processes)",
        description=__doc__.splitlines()[0].replace("``", ""),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_arguments(parser)
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    parser.add_argument("script", metavar="SCRIPT", help="the training script (or module, -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for SCRIPT")
    parser.set_defaults(func=run)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The LaunchConfig options plus ``--config_file`` (shared with ``nbaccel test``)."""
    add_config_arguments(parser)
    parser.add_argument(
        "--config_file",
        metavar="PATH",
        default=None,
        help="YAML config to read (default: $NBACCEL_CONFIG_FILE or ~/.cache/nbaccel/...)",
    )


def processes_per_node(cfg: LaunchConfig) -> int:
    """``cfg.num_processes``, else one per usable GPU, else 1."""
    from ..platform.hardware import default_num_processes

    if cfg.num_processes is not None:
        return cfg.num_processes
    return default_num_processes(cfg.compute_device, cfg.gpu_ids)


def worker_environment(
    cfg: LaunchConfig,
    nproc: int,
    base: Mapping[str, str],
    config_file: str | os.PathLike[str] | None = None,
) -> dict[str, str]:
    """The environment for the script: ``base`` plus the resolved ``NBACCEL_*`` settings."""
    from ..platform.hardware import cpu_count

    env = dict(base)
    env["NBACCEL_MIXED_PRECISION"] = cfg.mixed_precision
    env["NBACCEL_GRADIENT_ACCUMULATION_STEPS"] = str(cfg.gradient_accumulation_steps)
    env["NBACCEL_COMPUTE_DEVICE"] = cfg.compute_device
    env["NBACCEL_USE_CPU"] = "1" if cfg.compute_device == "cpu" else "0"
    env["NBACCEL_DEBUG_MODE"] = "1" if cfg.debug else "0"
    if cfg.timeout is not None:
        env["NBACCEL_TIMEOUT"] = str(cfg.timeout)
    if config_file is not None:
        env["NBACCEL_CONFIG_FILE"] = str(Path(config_file).resolve())
    if cfg.gpu_ids and cfg.gpu_ids.strip().lower() != "all":
        env["CUDA_VISIBLE_DEVICES"] = cfg.gpu_ids.replace(" ", "")
    env.update(strategy_environment(cfg))
    if cfg.compute_device == "tpu":
        env.setdefault("PJRT_DEVICE", "TPU")
    if "OMP_NUM_THREADS" not in base:
        # Without this every process starts one thread per core and they thrash.
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count() // max(nproc, 1)))
    return env


def _exit_code(returncode: int) -> int:
    # A worker killed by signal N reports -N; shells say 128 + N.
    return 128 - returncode if returncode < 0 else returncode


def run_single(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``python command...`` once and return its exit code (Ctrl-C reaches it too)."""
    proc = subprocess.Popen([sys.executable, *command], env=dict(env))
    try:
        return _exit_code(proc.wait())
    except KeyboardInterrupt:
        # The child got the same SIGINT (same process group); give it time to exit.
        try:
            return _exit_code(proc.wait(timeout=30))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return 130


def run_torchrun(
    cfg: LaunchConfig, nproc: int, command: Sequence[str], env: Mapping[str, str]
) -> int:
    """Run ``command`` on ``nproc`` processes per node with torch.distributed.run."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    env = dict(env)
    master_addr, master_port, store = cfg.master_addr, cfg.master_port, None
    if cfg.num_nodes == 1:
        master_addr, master_port, store = _loopback_store(cfg, env)
    argv = [
        f"--nnodes={cfg.num_nodes}",
        f"--nproc-per-node={nproc}",
        f"--node-rank={cfg.node_rank}",
        f"--master-addr={master_addr}",
        f"--max-restarts={cfg.max_restarts}",
    ]
    if master_port is not None:
        argv.append(f"--master-port={master_port}")
    # Each worker runs `python -u -m nbaccel.cli._run_script SCRIPT ...`: the script as
    # __main__, then its process group destroyed (see _run_script for why).
    argv += ["-m", "nbaccel.cli._run_script", *command]
    # torchrun hands its own environment to the workers.
    os.environ.clear()
    os.environ.update(env)
    try:
        torchrun.run(torchrun.parse_args(argv))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = _exit_code(failure.exitcode) or 1
        print(
            f"nbaccel launch: rank {rank} (pid {failure.pid}) exited with code {code}",
            file=sys.stderr,
        )
        return code
    except SignalException as err:
        return 128 + int(err.sigval)
    except KeyboardInterrupt:
        return 128 + int(signal.SIGINT)
    finally:
        del store  # stops the store server (torchrun's agent has finished with it)
    return 0


def _loopback_store(cfg: LaunchConfig, env: dict[str, str]) -> tuple[str, int, Any]:
    """Start this launch's TCPStore on a loopback socket; torchrun's agent then reuses it.

    torchrun's static rendezvous creates node 0's store with ``multi_tenant=True``,
    and torch shares one server per port within a process: so a server started here,
    on a socket bound to 127.0.0.1 (a free port unless one was given), is the one the
    agent and the workers use. Also keeps gloo/NCCL on the loopback interface.

    Raises:
        ConfigError: the requested port is busy (names it), or the address is not local.
    """
    from ..launch._rendezvous import Rendezvous, host_store

    rdzv = Rendezvous.reserve(cfg.master_addr, cfg.master_port, num_nodes=1, node_rank=0)
    try:
        fd = rdzv.listen_fd()
        assert fd is not None, "node 0 always holds the listening socket"
        # the store server takes over a duplicate; this process's socket object closes
        store = host_store(os.dup(fd), rdzv.store_host(), rdzv.port, cfg.timeout)
    finally:
        rdzv.close()
    env.update(rdzv.worker_env())
    return rdzv.addr, rdzv.port, store


def run(args: argparse.Namespace) -> int:
    try:
        cfg = resolve_launch_config(overrides_from_args(args), config_file=args.config_file)
    except ConfigError as err:
        print(f"nbaccel launch: error: {err}", file=sys.stderr)
        return 2
    if not args.module and not Path(args.script).is_file():
        print(f"nbaccel launch: error: script {args.script!r} does not exist", file=sys.stderr)
        return 2
    nproc = processes_per_node(cfg)
    env = worker_environment(cfg, nproc, os.environ, args.config_file)
    command = [*(["-m"] if args.module else []), args.script, *args.script_args]
    if nproc * cfg.num_nodes == 1 or cfg.compute_device == "tpu":
        # TPU: torch_xla's PJRT runtime starts one process per chip from a single host process.
        return run_single(["-u", *command], env)
    try:
        return run_torchrun(cfg, nproc, command, env)
    except ConfigError as err:  # e.g. --main_process_port busy
        print(f"nbaccel launch: error: {err}", file=sys.stderr)
        return 2


__all__ = ["processes_per_node", "register", "run", "run_single", "run_torchrun"]
