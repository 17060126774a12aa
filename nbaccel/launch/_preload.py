"""What the kernel imports before forking, so that forked workers inherit it warm.

nbaccel's runtime (tens of ms each worker would repeat), and ``torch._dynamo`` once a
worker needed it (torch imports it lazily from every optimizer and DDP, ~0.8 s of CPU):
learned, not predicted, so a launch that never trains never pays it. Only on CPU-only
torch builds: on CUDA builds the import might touch the driver and make the fork unsafe.

Example:
    >>> learned_modules()
    []
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from ..config.fields import field_kind
from ..platform.forksafe import release_openmp_threads
from ._messages import Imported

_DYNAMO = "torch._dynamo"
_learned: set[str] = set()


def learned_modules() -> list[str]:
    """The modules workers reported importing themselves (imported before later forks)."""
    return sorted(_learned)


def remember_worker_imports(modules: list[str]) -> None:
    """A worker reported importing ``modules`` itself: pre-import them from now on."""
    _learned.update(m for m in modules if m == _DYNAMO)


class Learner:
    """Worker side: report, once, that a job imported ``torch._dynamo`` after the fork."""

    def __init__(self, forked: bool) -> None:
        self.watch = forked and _DYNAMO not in sys.modules

    def report(self, channel: Any) -> None:
        if self.watch and _DYNAMO in sys.modules:
            self.watch = False
            channel.send(Imported([_DYNAMO]))


def preload() -> None:
    """Prepare the kernel so that forked workers inherit a warm, fork-safe runtime: the
    imports above, then the OpenMP pool released (a child would hang in its first
    multi-threaded op). No CUDA, no threads; a failure is left for the worker to report."""
    with contextlib.suppress(Exception):
        from ..runtime import accelerator  # noqa: F401
    with contextlib.suppress(Exception):  # a cache every worker's Accelerator() reads
        field_kind("mixed_precision")
    torch = sys.modules.get("torch")
    if torch is not None and _DYNAMO in _learned and not torch.cuda._is_compiled():
        with contextlib.suppress(Exception):
            import torch._dynamo
    release_openmp_threads()


__all__ = ["Learner", "learned_modules", "preload", "remember_worker_imports"]
