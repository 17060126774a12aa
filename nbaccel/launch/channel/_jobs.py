"""What a worker can be asked to do: the table of job kinds, and its namespace.

``call`` (the objects themselves, inherited through a fork), ``run`` (the same with dill:
spawned workers and pool calls), ``exec`` (a ``%%distributed`` cell, with the kernel's
names it uses; a final expression's value comes back), ``push``/``pull``/``names`` (the
namespace), ``script`` (a file or module as ``__main__``, ``nbaccel launch``).

Example:
    >>> worker = Worker(rank=0)
    >>> JOBS["push"](worker, __import__("dill").dumps({"lr": 0.1}))
    >>> JOBS["pull"](worker, "lr"), JOBS["names"](worker)
    (0.1, ['lr'])
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import json
import linecache
import os
import runpy
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

from ._wire import dumps

CELL_VALUE_LIMIT = 8 << 20  # a bigger cell result is shown by its repr (pull it if needed)


class RemoteRepr:
    """Stands in for a value that cannot travel to the kernel: shows the worker's repr."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class Worker:
    """One worker's namespace, shared by pool calls, ``push``/``pull`` and cells."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.from_kernel: dict[str, int] = {}  # names a cell got from the kernel -> id(value)


def _call(worker: Worker, function: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    return function(*args, **kwargs)


def _run(worker: Worker, payload: bytes, sources: dict | None = None) -> Any:
    import dill

    linecache.cache.update(sources or {})  # notebook cells, for remote tracebacks
    return _call(worker, *dill.loads(payload))


def _exec(worker: Worker, source: str, filename: str, names: bytes, sources: dict) -> Any:
    import dill

    linecache.cache.update(sources)  # notebook cells, for remote tracebacks
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    ns = worker.namespace
    # The kernel's names the cell uses, as pool.run ships a function's globals. A name the
    # cell's own code set on this rank is the worker's own and is not overwritten.
    for name, value in dill.loads(names).items():
        if name not in ns or worker.from_kernel.get(name) == id(ns[name]):
            ns[name] = value
            worker.from_kernel[name] = id(value)
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)  # type: ignore[attr-defined]
    code = compile(tree, filename, "exec")
    if "accelerator" not in ns and _mentions(code, "accelerator"):
        from ...runtime.facade.accelerator import Accelerator

        ns["accelerator"] = Accelerator()  # the cell's ready-made handle
    try:
        exec(code, ns)
        return None if last is None else eval(compile(last, filename, "eval"), ns)
    finally:  # names the cell rebound are the worker's own from now on
        for name in [n for n, i in worker.from_kernel.items() if id(ns.get(n)) != i]:
            del worker.from_kernel[name]


def _mentions(code: Any, name: str) -> bool:
    nested = (c for c in code.co_consts if hasattr(c, "co_names"))
    return name in code.co_names or any(_mentions(c, name) for c in nested)


def _push(worker: Worker, payload: bytes) -> None:
    import dill

    values = dill.loads(payload)
    worker.namespace.update(values)
    for name in values:
        worker.from_kernel.pop(name, None)


def _pull(worker: Worker, name: str) -> Any:
    if name not in worker.namespace:
        raise NameError(
            f"name {name!r} is not defined on rank {worker.rank}: set it first with "
            f"pool.push({name}=...) or in a %%distributed cell (pool.names() lists them)."
        )
    return worker.namespace[name]


def _names(worker: Worker) -> list[str]:
    return sorted(k for k in worker.namespace if not k.startswith("__"))


def _script(worker: Worker, argv: list[str]) -> int:
    """Run ``argv`` (``[-m] target args...``) as ``python`` would; a non-zero exit code
    leaves as ``SystemExit(code)`` (the worker's exit code)."""
    as_module = argv[0] == "-m"
    target, *rest = argv[1:] if as_module else argv
    sys.argv = [target, *rest]
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python script.py`
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is not None and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
            raise SystemExit(1) from None
        raise
    except BaseException:
        traceback.print_exc()  # as python prints an uncaught exception
        raise
    return 0


JOBS: dict[str, Callable[..., Any]] = {
    "call": _call,
    "run": _run,
    "exec": _exec,
    "push": _push,
    "pull": _pull,
    "names": _names,
    "script": _script,
}


def check_syntax(source: str) -> None:
    """Kernel side: a cell's syntax error is raised before any rank runs it."""
    try:
        compile(source, "<distributed cell>", "exec")
    except SyntaxError as err:
        line = (err.text or "").strip()
        if line.startswith(("%", "!")):
            err.msg += (
                " (a %%distributed cell runs as plain Python on the workers: IPython magics "
                "and !shell lines work only in ordinary cells)"
            )
        raise


#: builtins that libraries replace in the kernel with functions of their own, and where each
#: keeps the interpreter's: (module, attribute). Ray's driver swaps ``print`` for its tqdm's
#: ``safe_print`` once a worker's log line has been shown (RAY_TQDM_PATCH_PRINT).
_PATCHED_BUILTINS = {"print": ("ray.experimental.tqdm_ray", "_print")}


@contextlib.contextmanager
def _genuine_builtins() -> Iterator[None]:
    """The interpreter's own builtins in place of the kernel's patched ones, for one dump.

    dill (``recurse=True``) follows the builtins a function names into their globals, and
    Ray's ``safe_print`` leads it round a cycle of Ray's functions until the recursion limit:
    every function that prints failed to ship from a Ray driver once Ray had shown a log
    line. A worker has its own builtins; what it gets must be the interpreter's print.
    """
    swapped = {}
    for name, (module, attr) in _PATCHED_BUILTINS.items():
        current = getattr(builtins, name, None)
        genuine = getattr(sys.modules.get(module), attr, None)
        if isinstance(current, types.FunctionType) and isinstance(
            genuine, types.BuiltinFunctionType
        ):
            swapped[name] = current
            setattr(builtins, name, genuine)
    try:
        yield
    finally:
        for name, current in swapped.items():
            setattr(builtins, name, current)


def dill_for_workers(
    value: Any, what: str, where: str = "e.g. inside the function or in a %%distributed cell"
) -> bytes:
    """Kernel side: ``value`` pickled with dill for the workers; TypeError naming ``what``
    and ``where`` to create what cannot be copied."""
    import dill

    try:
        with _genuine_builtins():
            return bytes(dill.dumps(value, recurse=True))
    except Exception as err:
        raise TypeError(
            f"could not send {what} to the workers ({type(err).__name__}: {err}). They are "
            "copied with dill: create unpicklable objects (open files, locks, CUDA models) on "
            f"the workers, {where}."
        ) from err


def ship(value: Any, kind: str) -> tuple[str, bytes]:
    """A job's value for the kernel; a cell's unsendable (or big) value travels as its repr."""
    try:
        shipped = dumps(value)
        if kind != "exec" or len(shipped[1]) <= CELL_VALUE_LIMIT:
            return shipped
    except Exception as err:
        if kind == "exec":
            return dumps(RemoteRepr(repr(value)))
        raise TypeError(
            f"the function's return value (a {type(value).__name__}) cannot be sent back to "
            f"the kernel: {type(err).__name__}: {err}. Return plain data instead: numbers, "
            "tensors, lists/dicts of them, or model.state_dict() (in a pool, keep it on the "
            "workers and pull what you need)."
        ) from err
    return dumps(RemoteRepr(repr(value)))


def collective_count() -> int | None:
    """How many collectives the default group has run (None: no group)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized():
            return None
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:
        return None


def last_collective() -> dict[str, Any] | None:
    """The last collective this process issued, as torch's flight recorder holds it
    (torch 2.13 records gloo's by default; ``TORCH_FR_BUFFER_SIZE`` sets how many): ``{"group", "seq", "call", "sizes"}``; None where torch records nothing."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized():
            return None
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]

        entries = json.loads(_dump_fr_trace_json(includeCollectives=True)).get("entries")
        last = entries[-1]
        return {
            "group": last["process_group"][1],
            "seq": int(last["collective_seq_id"]),
            "call": str(last["profiling_name"]),
            "sizes": last["input_sizes"],
        }
    except Exception:  # an older torch, no recorder, nothing recorded yet
        return None


__all__ = [
    "JOBS",
    "RemoteRepr",
    "Worker",
    "check_syntax",
    "collective_count",
    "dill_for_workers",
    "last_collective",
    "ship",
]
