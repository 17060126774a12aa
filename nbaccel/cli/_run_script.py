"""Run a training script as ``__main__`` (like ``python script.py``), then exit cleanly.

``nbaccel launch`` starts every torchrun worker through this module. A gloo/NCCL
process group (or another torch C++ thread) still alive while the interpreter
tears down makes torch abort in some runs ("terminate called without an active
exception", exit code 134) even though the script succeeded, and the command
would then report the abort instead of the script's own exit code. So after the
script (successful or not) the group is destroyed, the Python exit handlers run
and the streams are flushed, and the worker leaves with ``os._exit(code)``,
skipping only the C++ static destructors where the abort happens.

Usage: ``python -m nbaccel.cli._run_script [-m] SCRIPT_OR_MODULE [ARGS...]``
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import sys
import traceback

from ..platform import torchcompat


def _exit_code(exit_: SystemExit) -> int:
    if exit_.code is None:
        return 0
    if isinstance(exit_.code, int):
        return exit_.code
    print(exit_.code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1


def run(argv: list[str]) -> int:
    """Run the script or module named by ``argv``; return its exit code."""
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        print("usage: python -m nbaccel.cli._run_script [-m] SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    target, *rest = argv
    sys.argv = [target, *rest]
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py` does
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_:
        return _exit_code(exit_)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main(argv: list[str]) -> None:
    code = run(argv)
    torchcompat.destroy_process_group()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()  # the script's own exit handlers (trackers, files) still run
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
