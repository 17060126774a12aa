"""``nbaccel test``: a short distributed self-check with the configured settings.

Starts the configured number of processes (at least 2 on a CPU-only setup) with
the same engine as ``nbaccel launch`` and notebooks; each checks data sharding, gather and
a few training steps. Prints PASS or FAIL and exits 0 or 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..config import resolve_launch_config
from ..errors import ConfigError
from ..platform.environment import package_dir
from ._options import overrides_from_args
from .launch import add_launch_arguments, launch, processes_per_node

EPILOG = """\
examples:
  nbaccel test                          # configured settings (2 CPU processes if no GPU)
  nbaccel test --num_processes 4 --cpu  # 4 CPU processes over gloo
  nbaccel test --mixed_precision bf16
  nbaccel test --config_file ./cluster.yaml
"""

# the workload is runtime code; it runs as a script under the launcher
_SELF_CHECK = Path(package_dir()) / "runtime" / "facade" / "selfcheck.py"


#: the line ``nbaccel --help`` lists this command by
HELP = "run a short distributed self-check and say whether the setup works"
#: what ``nbaccel test --help`` opens with
DESCRIPTION = __doc__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``nbaccel test`` (its parser is made by :func:`nbaccel.cli.build_parser`)."""
    add_launch_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = resolve_launch_config(overrides_from_args(args), config_file=args.config_file)
    except ConfigError as err:
        print(f"nbaccel test: FAIL: the configuration is invalid: {err}", file=sys.stderr)
        return 1
    # A hang must end the check, not the user's patience.
    cfg = cfg.replace(timeout=cfg.timeout or 120.0)
    nproc = processes_per_node(cfg)
    if args.num_processes is None and nproc < 2 and cfg.compute_device in ("auto", "cpu"):
        from ..platform.hardware import cuda_device_count

        if cfg.compute_device == "cpu" or cuda_device_count() == 0:
            nproc = 2  # a distributed check needs at least two processes
    print(
        f"nbaccel test: {nproc} process(es) per node x {cfg.num_nodes} node(s), "
        f"device {cfg.compute_device}, precision {cfg.mixed_precision}",
        flush=True,
    )
    started = time.monotonic()
    code = launch(cfg.replace(num_processes=nproc), [str(_SELF_CHECK)], "nbaccel test")
    seconds = time.monotonic() - started
    if code == 0:
        print(f"nbaccel test: PASS ({seconds:.1f}s): distributed training works with this setup.")
        return 0
    print(
        f"nbaccel test: FAIL (exit code {code}, {seconds:.1f}s): see the messages above; "
        "`nbaccel env` shows the versions and devices to include in a bug report.",
        file=sys.stderr,
    )
    return 1


__all__ = ["add_arguments", "run"]
