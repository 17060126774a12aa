"""Run a training script as ``__main__`` (like ``python script.py``), then end its process group.

``nbaccel launch`` starts every torchrun worker through this module. Scripts
rarely call ``destroy_process_group()``, and a gloo/NCCL group still alive at
interpreter exit makes torch abort in some runs ("terminate called without an
active exception", exit code 134) even though the script succeeded. After a
successful run the group is destroyed here; after a failure the worker just
exits with its code (torchrun stops the other ranks).

Usage: ``python -m nbaccel.cli._run_script [-m] SCRIPT_OR_MODULE [ARGS...]``
"""

from __future__ import annotations

import os
import runpy
import sys


def _destroy_process_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m nbaccel.cli._run_script [-m] SCRIPT [ARGS...]")
    target, *rest = argv
    try:
        if as_module:
            sys.argv = [target, *rest]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *rest]
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` does
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code in (None, 0):
            _destroy_process_group()
        raise
    _destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
