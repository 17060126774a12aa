"""What the kernel imports before forking, so that forked workers inherit it warm.

* nbaccel's runtime (the ``Accelerator`` and its modules): tens of ms that every
  worker of every launch would otherwise spend importing it again.
* ``torch._dynamo``, only when the launched code needs it. torch imports it lazily
  even in a run that never compiles: ``Optimizer.add_param_group`` (so every optimizer
  constructor) is wrapped by ``torch._disable_dynamo``, ``Optimizer.step`` calls
  ``torch._dynamo.graph_break()``, and ``DistributedDataParallel.__init__`` asks
  ``torch._dynamo.utils`` for its DDP-optimizer mode. The import costs ~0.8 s of CPU
  on a quiet machine; in the kernel that is paid once, in the workers by every worker
  of every launch (all at the same time, so seconds on a small machine). A launch
  that only forms a group and runs collectives never needs it, so it is imported
  only when :func:`needs_dynamo` finds an optimizer, a model wrapper or
  ``torch.compile`` in the launched code, or when a worker of an earlier launch had
  to import it itself (:func:`remember_worker_imports`: a misprediction costs once).
  (Only on CPU-only torch builds: on CUDA builds we cannot prove here that the import
  never touches the CUDA driver, which would make the fork unsafe.)

Example:
    >>> cell = "import torch\\ndef train():\\n    return torch.optim.SGD\\ndef ping(): return 1"
    >>> notebook = {"__name__": "__main__"}  # functions defined in a notebook cell
    >>> exec(cell, notebook)
    >>> needs_dynamo(notebook["train"], ()), needs_dynamo(notebook["ping"], ())
    (True, False)
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from typing import Any

from ..config.launch_config import field_kind
from ..platform.forksafe import release_openmp_threads

#: Names that, anywhere in the launched code, mean torch will import torch._dynamo in
#: the workers: optimizers, model wrappers (directly or through a facade's ``prepare``),
#: compilation and the peers' training entry points.
TRIGGER_NAMES = frozenset(
    {
        "optim",
        "Optimizer",
        "DistributedDataParallel",
        "DDP",
        "FullyShardedDataParallel",
        "fully_shard",
        "prepare",
        "prepare_model",
        "prepare_optimizer",
        "compile",
        "_dynamo",
        "Trainer",
        "setup_optimizers",
    }
)
#: Code objects looked at before giving up and assuming the import is needed.
SCAN_BUDGET = 400
_DYNAMO = "torch._dynamo"
#: The control-pipe event in which a forked worker reports what it had to import itself.
IMPORTED_EVENT = "nbaccel.imported"
_POOL_WORKER = "nbaccel.launch._pool_worker"  # the loop of nbaccel.start_workers' workers
_learned: set[str] = set()  # modules a worker of an earlier launch had to import itself


def remember_worker_imports(modules: list[str]) -> None:
    """A worker reported importing ``modules`` itself: pre-import them from now on."""
    _learned.update(m for m in modules if m == _DYNAMO)


def worker_report_modules() -> tuple[str, ...]:
    """The modules whose import a worker reports back (see :func:`remember_worker_imports`)."""
    return (_DYNAMO,)


class _Scan:
    """A bounded walk over the user's code reachable from the launched function.

    Library code (torch, nbaccel, anything installed) is not entered: the names the
    user's code calls it by are what tells (``torch.optim.SGD``, ``acc.prepare``).
    """

    def __init__(self) -> None:
        self.budget = SCAN_BUDGET
        self.seen: set[int] = set()

    def code(self, code: types.CodeType, namespace: dict[str, Any]) -> bool:
        if id(code) in self.seen:
            return False
        self.seen.add(id(code))
        self.budget -= 1
        if self.budget < 0:
            raise _OutOfBudget
        names = (*code.co_names, *code.co_varnames, *code.co_freevars)
        if not TRIGGER_NAMES.isdisjoint(names):
            return True
        for const in code.co_consts:  # nested functions, lambdas, comprehensions, classes
            if isinstance(const, types.CodeType) and self.code(const, namespace):
                return True
        modules = []
        for name in code.co_names:  # globals this code reads, resolved in its namespace
            value = namespace.get(name)
            if isinstance(value, types.ModuleType):
                if _is_user_module(value.__name__):
                    modules.append(value)
            elif value is not None and self.value(value):
                return True
        for module in modules:  # `helpers.train()`: what it reads of the user's modules
            for name in code.co_names:
                value = module.__dict__.get(name)
                if not isinstance(value, types.ModuleType | None) and self.value(value):
                    return True
        return False

    def value(self, value: Any) -> bool:
        """True if ``value`` (a global, closure cell, argument) leads to a trigger."""
        torch = sys.modules.get("torch")
        if isinstance(value, functools.partial):
            return self.value(value.func) or any(self.value(a) for a in value.args)
        if isinstance(value, types.MethodType):
            return self.value(value.__func__)
        if isinstance(value, types.FunctionType):
            if not _is_user_module(value.__module__):
                return False
            if any(self.value(c) for c in _cells(value)):
                return True
            return self.code(value.__code__, value.__globals__)
        if isinstance(value, type):
            if torch is not None and issubclass(
                value, torch.optim.Optimizer | torch.nn.parallel.DistributedDataParallel
            ):
                return True
            if not _is_user_module(value.__module__) or id(value) in self.seen:
                return False
            self.seen.add(id(value))  # a class of the user's: its methods may train
            return any(self.value(v) for v in vars(value).values())
        if torch is not None and isinstance(value, torch.optim.Optimizer):
            return True
        if isinstance(value, list | tuple | dict) and len(value) <= 64:
            items = value.values() if isinstance(value, dict) else value
            return any(self.value(v) for v in items)
        if callable(value) and _is_user_module(type(value).__module__):
            return self.value(type(value))  # a callable object of the user's class
        return False


class _OutOfBudget(Exception):
    pass


def _cells(function: types.FunctionType) -> list[Any]:
    out = []
    for cell in function.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell
            out.append(cell.cell_contents)
    return out


@functools.lru_cache(maxsize=256)
def _is_user_module(name: str | None) -> bool:
    """Notebook cells (``__main__``) and the user's own modules, not installed packages."""
    if not name or name == "__main__":
        return bool(name)
    if name.split(".")[0] in ("nbaccel", "torch"):  # installed editable in development
        return False
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if module is None or path is None:  # built-in or namespace: not the user's code
        return False
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, *_site_dirs()}
    return not any(os.path.abspath(path).startswith(os.path.join(r, "")) for r in roots if r)


def _site_dirs() -> list[str]:
    import site

    dirs = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    with contextlib.suppress(Exception):
        dirs += site.getsitepackages()
    return dirs


def needs_dynamo(function: Any, args: tuple[Any, ...]) -> bool:
    """Whether workers running ``function(*args)`` will import ``torch._dynamo``.

    A bounded static look at the user's code reachable from ``function``; when unsure
    (the walk is too large, fails, or ``function`` is not Python code), True: a wrong
    True costs one import in the kernel, a wrong False one import in every worker of
    that one launch (:func:`remember_worker_imports` corrects the next).
    """
    if _DYNAMO in _learned:
        return True
    if getattr(function, "__module__", None) == _POOL_WORKER:
        return True  # a warm pool's worker loop runs whatever later cells send it: training
    scan = _Scan()
    try:
        if scan.value(function) or any(scan.value(a) for a in args):
            return True
    except Exception:  # _OutOfBudget, or code the walk did not expect
        return True
    target = function.func if isinstance(function, functools.partial) else function
    target = getattr(target, "__func__", target)
    return not isinstance(target, types.FunctionType) and not _is_user_module(
        type(target).__module__
    )


def preload(function: Any, args: tuple[Any, ...]) -> None:
    """Prepare the kernel so that forked workers inherit a warm, fork-safe runtime.

    Imports nbaccel's runtime, ``torch._dynamo`` when :func:`needs_dynamo` says so (CPU-only
    torch builds), then releases the OpenMP pool: a child would otherwise hang in its
    first multi-threaded op. None of this starts CUDA or threads; a failure is left for
    the worker to report.
    """
    with contextlib.suppress(Exception):
        from ..runtime import accelerator  # noqa: F401
    with contextlib.suppress(Exception):  # a cache every worker's Accelerator() reads
        field_kind("mixed_precision")  # LaunchConfig's type hints, read by coerce()
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and _DYNAMO not in sys.modules
        and not torch.cuda._is_compiled()
        and needs_dynamo(function, args)
    ):
        with contextlib.suppress(Exception):
            import torch._dynamo
    release_openmp_threads()


__all__ = [
    "IMPORTED_EVENT",
    "needs_dynamo",
    "preload",
    "remember_worker_imports",
    "worker_report_modules",
]
