"""Remember where CUDA was first initialised in this process.

When CUDA is already initialised in a kernel, a fork-based launch must refuse,
and the most useful thing the error can say is *which line* did it. torch
funnels every lazy CUDA initialisation (``.cuda()``, ``torch.zeros(device="cuda")``,
``torch.cuda.current_device()``...) through ``torch.cuda._lazy_init``; wrapping
that one attribute records the Python stack of the first call that initialised
CUDA.

:func:`install` is called when :mod:`nbaccel` is imported. It never
imports torch: if ``torch.cuda`` is not imported yet, a one-shot import hook
wraps it right after it is loaded.

Example:
    >>> from nbaccel.platform import cudatrace
    >>> cudatrace.install()
    >>> cudatrace.describe_first_init() is None or isinstance(cudatrace.describe_first_init(), str)
    True
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import linecache
import os
import sys
import traceback
from types import ModuleType
from typing import Any

_first_init: list[traceback.FrameSummary] | None = None
_WRAPPED = "_nbaccel_cudatrace"


def _wrap(cuda: ModuleType) -> None:
    original = getattr(cuda, "_lazy_init", None)
    if original is None or getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def _lazy_init(*args: Any, **kwargs: Any) -> Any:
        global _first_init
        was_initialized = bool(getattr(cuda, "_initialized", True))
        result = original(*args, **kwargs)
        if _first_init is None and not was_initialized and getattr(cuda, "_initialized", False):
            _first_init = traceback.extract_stack()[:-1]
        return result

    setattr(_lazy_init, _WRAPPED, True)
    cuda._lazy_init = _lazy_init  # type: ignore[attr-defined]


class _WrappingLoader(importlib.abc.Loader):
    """Delegates to torch.cuda's real loader, then wraps the loaded module."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _wrap(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, ...
        return getattr(self._inner, name)


class _TorchCudaFinder(importlib.abc.MetaPathFinder):
    """One-shot finder: intercepts the import of ``torch.cuda`` only."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch.cuda":
            return None
        _remove_finder()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _WrappingLoader(spec.loader)
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchCudaFinder)]


def install() -> None:
    """Start recording the first CUDA initialisation (idempotent, never imports torch)."""
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None:
        _wrap(cuda)
    elif not any(isinstance(f, _TorchCudaFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchCudaFinder())


def _is_library_frame(filename: str) -> bool:
    markers = (
        f"{os.sep}torch{os.sep}",
        f"{os.sep}nbaccel{os.sep}",
        f"{os.sep}IPython{os.sep}",
        f"{os.sep}ipykernel{os.sep}",
    )
    return any(m in filename for m in markers) or filename.startswith("<frozen")


def _cell_name(filename: str) -> str | None:
    """'Cell In[3]' for a notebook cell's pseudo file name, when IPython can tell."""
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
        name = shell.compile.format_code_name(filename) if shell is not None else None
    except Exception:
        name = None
    return f"{name[0]} {name[1]}" if name else None


def describe_first_init(max_frames: int = 4) -> str | None:
    """Where CUDA was first initialised, as readable text, or None when unknown."""
    if _first_init is None:
        return None
    frames = [f for f in _first_init if not _is_library_frame(f.filename)] or list(_first_init)
    lines = []
    for frame in frames[-max_frames:]:
        where = _cell_name(frame.filename) or f'File "{frame.filename}"'
        lines.append(f"  {where}, line {frame.lineno}, in {frame.name}")
        code = frame.line or linecache.getline(frame.filename, frame.lineno or 0).strip()
        if code:
            lines.append(f"    {code}")
    return "\n".join(lines)


def _reset_for_tests() -> None:
    global _first_init
    _first_init = None


__all__ = ["describe_first_init", "install"]
