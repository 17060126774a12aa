"""Remember where CUDA was first initialised in this process.

When CUDA is already initialised in a kernel, a fork-based launch must refuse,
and the most useful thing the error can say is *which line* did it. torch
funnels every lazy CUDA initialisation (``.cuda()``, ``torch.zeros(device="cuda")``,
``torch.cuda.current_device()``...) through ``torch.cuda._lazy_init``; wrapping
that one attribute records the Python stack of the first call that initialised
CUDA.

The driver is initialised by more than that (issue 32): ``torch.cuda.is_available()``
(``torch._C._cuda_getDeviceCount``, also wrapped), ``import torchao``, CuPy, Numba. Those
leave torch's flag alone, yet break every forked worker. Two more witnesses name them:
IPython cell hooks that note the cell (and the modules it imported) during which the
driver became initialised, and, when nbaccel was not watching yet, the lines of the
kernel's input history that touch CUDA.

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
import re
import sys
import traceback
from types import ModuleType
from typing import Any

from . import cudafork

_first_init: list[traceback.FrameSummary] | None = None
_driver_first: list[traceback.FrameSummary] | None = None  # torch's device count did it
_driver_cell: list[str] = []  # the cell during which the driver became initialised
_cell_before: list[tuple[bool, frozenset[str]]] = []
_WRAPPED = "_nbaccel_cudatrace"
# lines of a kernel's history that initialise CUDA or its driver (a refusal's best guess
# when nbaccel was not watching yet)
_TOUCHES_CUDA = re.compile(
    r"\.cuda\(|device\s*=\s*['\"]cuda|\.to\(\s*['\"]cuda|torch\.cuda\.(is_available|init|get_device_\w+|"
    r"current_device|set_device|synchronize|mem_get_info|memory_\w+|Stream|Event)\(|"
    r"^\s*(import|from)\s+(torchao|bitsandbytes|cupy|numba\.cuda|pycuda)\b|"
    r"TrainingArguments\(|numba\s+import\s+cuda|\bcuInit\("
)
# loaded modules known to initialise the driver on import (seen on an H200, issue 32)
_IMPORTS_INIT = ("torchao", "bitsandbytes", "pycuda.autoinit")


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
    _wrap_device_count(sys.modules.get("torch._C"))


def _wrap_device_count(torch_c: ModuleType | None) -> None:
    """torch.cuda.is_available() and device_count() without NVML go through
    ``torch._C._cuda_getDeviceCount`` (cudaGetDeviceCount), which initialises the driver."""
    original = getattr(torch_c, "_cuda_getDeviceCount", None)
    if original is None or getattr(original, _WRAPPED, False):
        return

    def _cuda_getDeviceCount() -> Any:
        global _driver_first
        if _driver_first is not None or _first_init is not None:
            return original()
        before = cudafork.driver_initialized()
        result = original()
        if not before and cudafork.driver_initialized():
            _driver_first = traceback.extract_stack()[:-1]
        return result

    setattr(_cuda_getDeviceCount, _WRAPPED, True)
    torch_c._cuda_getDeviceCount = _cuda_getDeviceCount  # type: ignore[union-attr]


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
    _watch_cells()


def _shell() -> Any:
    ipython = sys.modules.get("IPython")
    try:
        return ipython.get_ipython() if ipython is not None else None
    except Exception:
        return None


def _watch_cells() -> None:
    """In a kernel: note the cell during which the driver becomes initialised (once)."""
    shell = _shell()
    events = getattr(shell, "events", None)
    if events is None or _driver_cell or cudafork.driver_initialized():
        return
    callbacks = events.callbacks.get("pre_run_cell", [])
    if _before_cell not in callbacks:
        events.register("pre_run_cell", _before_cell)
        events.register("post_run_cell", _after_cell)


def _unwatch_cells() -> None:
    events = getattr(_shell(), "events", None)
    for name, hook in (("pre_run_cell", _before_cell), ("post_run_cell", _after_cell)):
        if events is not None and hook in events.callbacks.get(name, []):
            events.unregister(name, hook)


def _before_cell(*_info: Any) -> None:
    _cell_before[:] = [(cudafork.driver_initialized(), frozenset(sys.modules))]


def _after_cell(result: Any = None) -> None:
    if not _cell_before:
        return
    (was, modules), _cell_before[:] = _cell_before[0], []
    if was:
        _unwatch_cells()  # initialised before this cell: nothing to learn from later ones
    elif cudafork.driver_initialized():
        count = getattr(result, "execution_count", None)
        raw = getattr(getattr(result, "info", None), "raw_cell", "") or ""
        new = sorted({m.split(".")[0] for m in set(sys.modules) - modules if "." not in m})
        name = f"Cell In[{count}]" if count is not None else "a cell"
        lines = [line for line in raw.splitlines() if line.strip()][:3]
        text = f"  {name}" + (f" (it imported {', '.join(new[:8])})" if new else "")
        _driver_cell[:] = [text] + [f"    {line.strip()}" for line in lines]
        _unwatch_cells()


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
    return _describe_stack(_first_init, max_frames)


def _describe_stack(stack: list[traceback.FrameSummary] | None, max_frames: int) -> str | None:
    if stack is None:
        return None
    frames = [f for f in stack if not _is_library_frame(f.filename)] or list(stack)
    if len(frames) > max_frames:  # the outermost (the cell) and the innermost ones
        frames = frames[:1] + frames[1 - max_frames :]
    lines = []
    for frame in frames:
        where = _cell_name(frame.filename) or f'File "{frame.filename}"'
        lines.append(f"  {where}, line {frame.lineno}, in {frame.name}")
        code = frame.line or linecache.getline(frame.filename, frame.lineno or 0).strip()
        if code:
            lines.append(f"    {code}")
    return "\n".join(lines)


def _history_suspects(limit: int = 6) -> list[str]:
    """Lines of this kernel's input history that initialise CUDA or its driver."""
    history = getattr(_shell(), "user_ns", {}).get("In", [])
    found: list[str] = []
    for number, cell in enumerate(history):
        body: int | None = None  # indentation of the def whose body this is: not run here
        for lineno, line in enumerate(str(cell).splitlines(), 1):
            indent = len(line) - len(line.lstrip())
            if body is not None and line.strip() and indent <= body:
                body = None
            if re.match(r"\s*(async\s+)?def\s", line) and body is None:
                body = indent
            elif body is None and _TOUCHES_CUDA.search(line) and "notebook_launcher" not in line:
                found += [f"  Cell In[{number}], line {lineno}", f"    {line.strip()}"]
    return found[-2 * limit :]


def describe_cause(state: cudafork.CudaForkState) -> str:
    """What made a fork unsafe, as far as it can be known: the line that initialised CUDA
    or its driver, the cell during which it happened, or the likely lines in the history.

    Example:
        >>> describe_cause(cudafork.CudaForkState(driver=True)).startswith(("The", "Where", "nb"))
        True
    """
    if state.context and _first_init is not None:
        return f"CUDA was first initialised here:\n{describe_first_init()}"
    if _driver_first is not None:
        return f"The CUDA driver was first initialised here:\n{_describe_stack(_driver_first, 4)}"
    if _driver_cell:
        return "The CUDA driver was initialised during this cell:\n" + "\n".join(_driver_cell)
    loaded = [name for name in _IMPORTS_INIT if name in sys.modules]
    suspects = _history_suspects()
    if not suspects and not loaded:
        return (
            "Where it was first initialised is unknown: nbaccel watches from the first launch "
            "or `%load_ext nbaccel` on (run either before touching CUDA to have it named here)."
        )
    text = "nbaccel was not watching yet when that happened (it watches from the first launch "
    text += "or `%load_ext nbaccel` on)."
    if suspects:
        text += " Lines of this kernel's cells that do it:\n" + "\n".join(suspects)
    if loaded:
        text += f"\nLoaded here, and known to initialise the driver on import: {', '.join(loaded)}"
    return text


def _reset_for_tests() -> None:
    global _first_init, _driver_first
    _first_init = _driver_first = None
    _driver_cell.clear()
    _cell_before.clear()


__all__ = ["describe_cause", "describe_first_init", "install"]
