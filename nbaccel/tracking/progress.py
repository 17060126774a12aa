"""Progress bars shown once per job: ``nbaccel.tqdm(...)`` and ``nbaccel.trange(...)``.

Only the main process (rank 0) draws a bar; the others get a disabled bar that
still iterates. The bar is an ipywidgets progress bar when it runs in the kernel
process itself and ipywidgets is installed, and plain text everywhere else (a
terminal, a script, and worker processes, which cannot talk to the notebook
frontend). Inside a worker started by ``notebook_launcher`` every redraw is also
published on the launcher's event channel, so the kernel-side live view
(:mod:`nbaccel.monitor`) can show the bar in the launching cell.

Example:
    >>> from nbaccel import tqdm
    >>> total = 0
    >>> for i in tqdm(range(3), disable=True):
    ...     total += i
    >>> total
    3
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from tqdm.std import tqdm as _text_tqdm

from ..platform.environment import in_kernel_process
from . import events


def _rank() -> int:
    """This process's global rank: what a launcher installed, else ``RANK`` (torchrun)."""
    from ..platform.process_env import read_environment  # the one place that parses RANK & co.

    return read_environment().rank


def _widget_class() -> type[_text_tqdm] | None:
    """``tqdm.notebook.tqdm`` if ipywidgets can draw it here, else None."""
    if importlib.util.find_spec("ipywidgets") is None or not in_kernel_process():
        return None
    try:
        notebook = importlib.import_module("tqdm.notebook")
    except Exception:  # an ipywidgets too old for tqdm: fall back to text
        return None
    if getattr(notebook, "IProgress", None) is None:
        return None
    cls: type[_text_tqdm] = notebook.tqdm
    return cls


def _publish(bar: _text_tqdm, closed: bool = False) -> None:
    """Send the bar's state to the launching kernel (a no-op outside launched workers)."""
    fmt = bar.format_dict
    events.publish(
        "progress",
        n=fmt["n"],
        total=fmt["total"],
        desc=bar.desc,
        unit=fmt["unit"],
        elapsed=fmt["elapsed"],
        rate=fmt["rate"],
        closed=closed,
    )


class _PublishingText(_text_tqdm):
    """Text bar that also publishes each redraw (tqdm throttles redraws by ``mininterval``)."""

    def display(self, *args: Any, **kwargs: Any) -> Any:
        shown = super().display(*args, **kwargs)
        _publish(self)
        return shown

    def close(self) -> None:
        was_shown = not self.disable  # close() disables the bar
        super().close()
        if was_shown:
            _publish(self, closed=True)


class WorkerBar(_PublishingText):
    """What ``tqdm.auto`` / ``tqdm.notebook`` bars become inside a launched worker.

    A text bar drawn (and published to the launching kernel) by rank 0 only: a worker
    forked from a kernel cannot draw widgets (ipykernel drops its messages), and one bar
    per job is what a user of the plain ``tqdm`` import expects.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _rank() != 0:
            kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _new_worker_bar(cls: type, *args: Any, **kwargs: Any) -> WorkerBar:
    return WorkerBar(*args, **kwargs)  # not an instance of cls: its __init__ is skipped


_TQDM_MODULES = ("tqdm.notebook", "tqdm.autonotebook", "tqdm.auto")


def _reroute(module: Any) -> None:
    """Make one of the ``tqdm`` front-end modules hand out :class:`WorkerBar`."""
    widget_class = getattr(module, "tqdm", None)
    if (
        module.__name__ == "tqdm.notebook"
        and isinstance(widget_class, type)
        and issubclass(widget_class, _text_tqdm)
    ):
        # classes bound before the fork (tqdm.auto's derives from this one) build text bars
        widget_class.__new__ = staticmethod(_new_worker_bar)  # type: ignore[assignment]
    module.tqdm = WorkerBar
    module.trange = trange


class _Rerouting(importlib.abc.Loader):
    """Runs the real loader, then :func:`_reroute` on the fresh module."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _reroute(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the real loader's
        return getattr(self.__dict__["loader"], name)


class _RerouteOnImport(importlib.abc.MetaPathFinder):
    """Import hook: ``tqdm.auto`` & co. imported later in the worker are rerouted too."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _TQDM_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Rerouting(spec.loader)
                return spec
        return None


def use_text_bars_in_worker() -> None:
    """Route ``tqdm.auto``, ``tqdm.autonotebook`` and ``tqdm.notebook`` to :class:`WorkerBar`.

    Called by the launcher in each worker, never in the kernel. Costs nothing until the
    user imports one of them: modules already loaded (an earlier cell's import, inherited
    through fork) are rerouted now, later imports by an import hook.
    """
    for name in _TQDM_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            _reroute(module)
    if not any(isinstance(f, _RerouteOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RerouteOnImport())


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> _text_tqdm:
    """A ``tqdm`` progress bar drawn by the main process only.

    Takes every argument of ``tqdm.tqdm``. In a notebook kernel it is a widget
    (``tqdm.notebook``), elsewhere text.

    Args:
        *args: forwarded to tqdm (usually the iterable). For compatibility with the
            best-known peer's old signature, a leading bool is read as ``main_process_only``.
        main_process_only: draw on rank 0 only (other ranks iterate silently).
        **kwargs: forwarded to tqdm (``total``, ``desc``, ``disable``, ...).

    Returns:
        A tqdm instance; iterate over it or call ``update(n)``.

    Example:
        >>> import io
        >>> bar = tqdm(total=10, file=io.StringIO())
        >>> bar.update(4); bar.n
        4
        >>> bar.close()
    """
    if args and isinstance(args[0], bool):
        main_process_only, args = args[0], args[1:]
    if main_process_only and _rank() != 0:
        kwargs["disable"] = True
    cls = _widget_class() or _PublishingText
    return cls(*args, **kwargs)


def trange(*args: Any, main_process_only: bool = True, **kwargs: Any) -> _text_tqdm:
    """``tqdm(range(*args), ...)`` drawn by the main process only.

    Example:
        >>> sum(trange(4, disable=True))
        6
    """
    return tqdm(range(*args), main_process_only=main_process_only, **kwargs)


__all__ = ["WorkerBar", "tqdm", "trange", "use_text_bars_in_worker"]
