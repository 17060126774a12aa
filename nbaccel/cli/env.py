"""``nbaccel env``: versions, platform, devices and the active config, for bug reports.

Never initialises CUDA: GPUs are counted through NVML and named by nvidia-smi.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

from ..config import ENV_VARS, default_config_path, load_config
from ..errors import ConfigError

EPILOG = """\
examples:
  nbaccel env                       # paste the output into a bug report
  NBACCEL_CONFIG_FILE=./c.yaml nbaccel env
"""

_PACKAGES = ("torch", "numpy", "safetensors", "ipywidgets", "ipykernel", "jupyterlab", "torch_xla")


#: the line ``nbaccel --help`` lists this command by
HELP = "print versions, platform, devices and the active config"
#: what ``nbaccel env --help`` opens with
DESCRIPTION = __doc__.splitlines()[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """None: ``nbaccel env`` only reports (its parser is made by :func:`nbaccel.cli.build_parser`)."""


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> list[tuple[str, str]]:
    """``[(label, value), ...]`` describing this environment."""
    from .._version import __version__
    from ..platform.hardware import detect_hardware, notebook_host

    rows = [
        ("nbaccel", __version__),
        ("Python", sys.version.split()[0] + f" ({sys.executable})"),
        ("Platform", platform.platform()),
    ]
    rows += [(name, _version(name.replace("_", "-"))) for name in _PACKAGES]
    try:
        import torch

        rows.append(("torch CUDA build", str(torch.version.cuda or "none")))
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    hw = detect_hardware()
    rows.append(("Devices", hw.summary()))
    host = notebook_host()
    suggested = ", ".join(f"{k}={v!r}" for k, v in host.defaults().items())
    rows.append(("Notebook host", host.label))
    rows.append(("Suggested defaults", suggested or "from the devices above"))
    try:
        import psutil

        rows.append(("Memory", f"{psutil.virtual_memory().total / 2**30:.1f} GiB"))
    except ImportError:  # pragma: no cover
        pass
    path = default_config_path()
    if not path.exists():
        rows.append(("Config file", f"{path} (not found; run `nbaccel config`)"))
    else:
        rows.append(("Config file", str(path)))
        try:
            cfg = load_config(path)
            rows += [(f"  {k}", repr(v)) for k, v in vars(cfg).items()]
        except ConfigError as err:
            rows.append(("  error", str(err)))
    for var in sorted({*ENV_VARS, "NBACCEL_USE_CPU", "NBACCEL_CONFIG_FILE"}):
        if var in os.environ:
            rows.append((var, os.environ[var]))
    for var in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PJRT_DEVICE"):
        if var in os.environ:
            rows.append((var, os.environ[var]))
    return rows


def run(args: argparse.Namespace) -> int:
    rows = report()
    width = max(len(label) for label, _ in rows)
    print("Copy and paste this into your bug report:\n")
    for label, value in rows:
        print(f"- {label.ljust(width)} : {value}")
    return 0


__all__ = ["add_arguments", "report", "run"]
