"""``nbaccel config``: write the YAML launch configuration.

Interactive by default: one question per LaunchConfig field, typed answers over a
plain terminal, Enter keeps the default, an invalid answer is explained and asked
again. ``--default`` writes a config for the detected hardware without asking.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import PRECISIONS as _PRECISIONS
from ..config import (
    LaunchConfig,
    default_config_path,
    field_help,
    field_kind,
    load_config,
    save_config,
    write_basic_config,
)
from ..config.fields import coerce
from ..config.file import is_accelerate_file
from ..errors import ConfigError

EPILOG = """\
examples:
  nbaccel config                               # answer a few questions
  nbaccel config --default                     # detected hardware, no questions
  nbaccel config --default --mixed_precision bf16
  nbaccel config --config_file ./cluster.yaml  # write somewhere else
  NBACCEL_CONFIG_FILE=./cluster.yaml nbaccel config

The file is read by notebook_launcher, nbaccel launch and Accelerator();
arguments and NBACCEL_* environment variables take precedence over it.
"""

# Fields asked only when they can matter.
_MULTI_NODE = ("node_rank", "master_addr", "master_port")
#: threads per rank (this machine's follow its cores) and the wait for a lost node's
#: replacement: a Ray cluster's settings
_CLUSTER_ONLY = ("cpus_per_rank", "replace_timeout")


#: the line ``nbaccel --help`` lists this command by
HELP = "create the launch config (questionnaire, or --default)"
#: what ``nbaccel config --help`` opens with
DESCRIPTION = __doc__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``nbaccel config`` (its parser is made by :func:`nbaccel.cli.build_parser`)."""
    parser.add_argument(
        "--default", action="store_true", help="write a config for this hardware, no questions"
    )
    parser.add_argument(
        "--mixed_precision",
        choices=_PRECISIONS,
        default=None,
        help="with --default: the precision to store (default: no)",
    )
    parser.add_argument(
        "--config_file",
        metavar="PATH",
        default=None,
        help="where to write (default: $NBACCEL_CONFIG_FILE, else ~/.cache/nbaccel/...)",
    )
    parser.add_argument(
        "--force", action="store_true", help="with --default: overwrite an existing file"
    )


def _show(path: Path) -> None:
    print(f"Configuration saved to {path}:")
    print("  " + path.read_text(encoding="utf-8").rstrip().replace("\n", "\n  "))


def _run_default(args: argparse.Namespace) -> int:
    path = Path(args.config_file).expanduser() if args.config_file else default_config_path()
    if args.force and path.exists():
        path.unlink()
    written = write_basic_config(args.mixed_precision or "no", save_location=path)
    if written is None:
        print(
            f"A configuration already exists at {path}; not overwriting it. "
            "Use --force, or run `nbaccel config` to edit it."
        )
        return 0
    _show(written)
    return 0


def _starting_point(path: Path) -> LaunchConfig:
    """The defaults offered: the existing file's values, else the detected hardware."""
    if path.exists():
        try:
            return load_config(path)
        except ConfigError as err:
            print(f"(ignoring the existing file: {err})")
    from ..config.store import with_host_defaults
    from ..platform.hardware import detect_hardware, notebook_host

    hw = detect_hardware()
    cfg = LaunchConfig(compute_device=hw.kind)  # type: ignore[arg-type]
    cfg = with_host_defaults(cfg, notebook_host(), hw.kind)  # Colab/Kaggle: devices, precision
    if cfg.num_processes is None:
        cfg = cfg.replace(num_processes=hw.device_count if hw.kind != "cpu" else 1)
    return cfg


def _text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _ask_field(name: str, current: dict[str, Any], ask: Callable[[str], str]) -> Any:
    """Ask for one field until the answer is valid; return the parsed value."""
    kind, choices = field_kind(name)
    hint = "/".join(choices) if choices else ("yes/no" if kind is bool else kind.__name__)
    prompt = (
        f"\n{name}: {field_help().get(name, '')}\n"
        f"  {name} [{hint}] (default {_text(current[name])}): "
    )
    while True:
        answer = ask(prompt).strip()
        if not answer:
            return current[name]
        try:
            value = coerce(name, answer, "your answer", from_text=True)
            _check_alone(name, value, current)
            return value
        except ConfigError as err:
            print(f"  invalid: {err} Please try again.")


def _check_alone(name: str, value: Any, current: dict[str, Any]) -> None:
    """Validate ``value`` against the answers so far; ignore errors about other fields."""
    trial = {**current, name: value}
    if name == "num_nodes":  # node_rank is asked next; do not hold an old one against this
        trial["node_rank"] = min(trial["node_rank"], max(value - 1, 0))
    try:
        LaunchConfig(**trial)
    except ConfigError as err:
        if f"{name}=" in str(err):
            raise


def _may_use_gpus(compute_device: str) -> bool:
    if compute_device == "gpu":
        return True
    from ..platform.hardware import cuda_device_count

    return compute_device == "auto" and cuda_device_count() > 0


def questionnaire(path: Path, ask: Callable[[str], str] = input) -> LaunchConfig:
    """Ask for every relevant field (defaults from ``path`` or the hardware) and validate."""
    current = dataclasses.asdict(_starting_point(path))
    print(f"Configuring nbaccel; the answers are saved to {path}.")
    print("Press Enter to keep the default shown.")
    for field in dataclasses.fields(LaunchConfig):
        name = field.name
        if name in _MULTI_NODE and current["num_nodes"] == 1:
            current[name] = field.default if name != "node_rank" else 0
            continue
        if name in _CLUSTER_ONLY and not current["cluster"]:
            current[name] = field.default  # a cluster's setting: nothing here reads it
            continue
        if name == "gpu_ids" and not _may_use_gpus(current["compute_device"]):
            current[name] = None
            continue
        if name.startswith("parallelism_config_"):
            continue  # mesh sizes: set with launch flags or the file, never asked
        if name.startswith(("fsdp_", "deepspeed_")) and not name.startswith(current["strategy"]):
            continue  # a strategy's options are asked only when it was chosen
        current[name] = _ask_field(name, current, ask)
        if name == "num_nodes":
            current["node_rank"] = min(current["node_rank"], current[name] - 1)
            if current[name] > 1 and current["master_port"] is None:
                current["master_port"] = 29500  # the offered default; every node must agree
    return LaunchConfig(**current)


def _run_questionnaire(args: argparse.Namespace) -> int:
    path = Path(args.config_file).expanduser() if args.config_file else default_config_path()
    try:
        cfg = questionnaire(path)
    except (EOFError, KeyboardInterrupt):
        print("\nAborted; nothing was written.", file=sys.stderr)
        return 1
    except ConfigError as err:
        print(f"nbaccel config: error: {err}; nothing was written.", file=sys.stderr)
        return 1
    _show(save_config(cfg, path))
    return 0


def run(args: argparse.Namespace) -> int:
    path = Path(args.config_file).expanduser() if args.config_file else default_config_path()
    if is_accelerate_file(path):  # nbaccel reads Accelerate's file; it never overwrites it
        print(
            f"nbaccel config: error: {path} is Accelerate's config file (`accelerate config` "
            "wrote it); nbaccel reads it as it is and writes only its own format: pass "
            "--config_file with another path (nothing was written).",
            file=sys.stderr,
        )
        return 1
    if args.default:
        return _run_default(args)
    if args.mixed_precision or args.force:
        print("nbaccel config: --mixed_precision/--force need --default", file=sys.stderr)
        return 2
    return _run_questionnaire(args)


__all__ = ["add_arguments", "questionnaire", "run"]
