"""``nbaccel launch``: run a training script on every device of this machine (or several).

The same engine as ``notebook_launcher``: one worker process per device (also for one),
each a fresh interpreter running the script as ``__main__``, supervised from this
process; nbaccel invents no rendezvous of its own (torch's TCPStore, on 127.0.0.1 with a
free port on a single machine, unless ``--main_process_port`` is given). The resolved
settings reach ``Accelerator()`` in the script as one typed configuration, not as
environment text. The exit code is the script's (the first failing rank's). The workers
never outlive this command: killed, even with SIGKILL, it takes them (and what they
started) along.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from ..config import LaunchConfig, default_config_path, resolve_launch_config
from ..config.accelerate_file import accelerate_default_path
from ..errors import ConfigError
from ._options import add_config_arguments, overrides_from_args

EPILOG = """\
examples:
  nbaccel launch train.py --epochs 3                 # settings from the config file
  nbaccel launch --num_processes 2 --cpu train.py    # 2 CPU processes over gloo
  nbaccel launch --mixed_precision bf16 train.py     # every GPU, bf16 autocast
  nbaccel launch -m mypackage.train --lr 1e-3        # run a module, like python -m
  nbaccel launch --config_file accel.yaml train.py   # a file `accelerate config` wrote
  # two machines; run this on each, with its own --machine_rank (0 and 1):
  nbaccel launch --num_machines 2 --machine_rank 0 \\
      --main_process_ip 10.0.0.1 --main_process_port 29500 train.py

Arguments after the script name are passed to the script unchanged. The exit
code is the script's (the first failing rank's, for several processes).
"""


#: the line ``nbaccel --help`` lists this command by
HELP = "run a training script on all devices (torchrun for several processes)"
#: what ``nbaccel launch --help`` opens with
DESCRIPTION = __doc__.splitlines()[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``nbaccel launch`` (its parser is made by :func:`nbaccel.cli.build_parser`)."""
    add_launch_arguments(parser)
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    parser.add_argument("script", metavar="SCRIPT", help="the training script (or module, -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for SCRIPT")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The LaunchConfig options plus ``--config_file`` (shared with ``nbaccel test``)."""
    add_config_arguments(parser)
    parser.add_argument(
        "--config_file",
        metavar="PATH",
        default=None,
        help="YAML or JSON config to read, nbaccel's or Accelerate's (default: "
        "$NBACCEL_CONFIG_FILE or ~/.cache/nbaccel/...)",
    )


def processes_per_node(cfg: LaunchConfig) -> int:
    """``cfg.num_processes``, else one per usable GPU, else 1."""
    from ..platform.hardware import default_num_processes

    if cfg.num_processes is not None:
        return cfg.num_processes
    return default_num_processes(cfg.compute_device, cfg.gpu_ids)


def launch(cfg: LaunchConfig, command: list[str], name: str = "nbaccel launch") -> int:
    """Run ``command`` on ``cfg``'s processes; the exit code (2: bad settings)."""
    from ..launch.launcher import run_script

    try:
        return run_script(cfg, command)
    except ConfigError as err:  # e.g. --main_process_port busy
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2


def config_file_to_read(given: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``given``, else None (nbaccel's file) if nbaccel has one, else Accelerate's default
    file (``accelerate config`` wrote it), said in one line on stderr; else None.

    Only ``nbaccel launch`` falls back to Accelerate's file, as ``accelerate launch`` does;
    a notebook launch does not (nor does Accelerate's ``notebook_launcher``).
    """
    env = os.environ if environ is None else environ
    if given is not None or env.get("NBACCEL_CONFIG_FILE") or default_config_path(env).exists():
        return given
    peer = accelerate_default_path(env)
    if peer is None:
        return None
    print(
        f"nbaccel launch: no nbaccel config file; reading Accelerate's config file {peer}",
        file=sys.stderr,
    )
    return str(peer)


def run(args: argparse.Namespace) -> int:
    try:
        config_file = config_file_to_read(args.config_file)
        cfg = resolve_launch_config(overrides_from_args(args), config_file=config_file)
    except ConfigError as err:
        print(f"nbaccel launch: error: {err}", file=sys.stderr)
        return 2
    if not args.module and not Path(args.script).is_file():
        print(f"nbaccel launch: error: script {args.script!r} does not exist", file=sys.stderr)
        return 2
    return launch(cfg, [*(["-m"] if args.module else []), args.script, *args.script_args])


__all__ = [
    "add_arguments",
    "add_launch_arguments",
    "config_file_to_read",
    "launch",
    "processes_per_node",
    "run",
]
