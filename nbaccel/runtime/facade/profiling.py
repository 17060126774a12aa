"""``accelerator.profile()``: ``torch.profiler.profile`` configured by ``ProfileKwargs``.

Every rank profiles itself; with ``output_trace_dir`` each writes its chrome trace as
``profile_{rank}.json`` there when the block ends (the name Accelerate uses).

Example:
    >>> import torch
    >>> with profile(None, rank=0) as prof:
    ...     _ = torch.ones(4) * 2
    >>> any("mul" in event.key for event in prof.key_averages())
    True
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ...errors import ConfigError
from ...platform.torchcompat import profiler_survives_ddp_backward
from .options import ProfileKwargs

_ACTIVITIES = ("cpu", "cuda", "xpu", "mtia", "hpu")


_SAME_NAMED = (
    "on_trace_ready", "record_shapes", "profile_memory", "with_stack", "with_flops", "with_modules"
)  # fmt: skip


def _activities(names: list[str] | None) -> list[Any] | None:
    if names is None:
        return None  # torch's default: the CPU, and CUDA when available
    from torch.profiler import ProfilerActivity

    chosen = []
    for name in names:
        key = str(name).lower()
        member = getattr(ProfilerActivity, key.upper(), None) if key in _ACTIVITIES else None
        if member is None:
            raise ConfigError(
                f"ProfileKwargs(activities=[..., {name!r}, ...]): use some of "
                f"{[a for a in _ACTIVITIES if hasattr(ProfilerActivity, a.upper())]}."
            )
        chosen.append(member)
    return chosen


@contextlib.contextmanager
def profile(
    handler: ProfileKwargs | None, *, rank: int, data_parallel: bool = False
) -> Iterator[Any]:
    """Profile the block with ``torch.profiler``; yields the profiler (``prof.step()``,
    ``prof.key_averages()``). ``data_parallel``: the process trains a DDP model."""
    handler = handler or ProfileKwargs()
    if data_parallel and not profiler_survives_ddp_backward():
        # a crash in torch's C++ kills the rank without a Python error: say why beforehand
        warnings.warn(
            f"nbaccel: torch {torch.__version__} may crash this rank (SIGABRT or SIGSEGV; on "
            "torch 2.4 about one run in three) when the profiled block runs a "
            "DistributedDataParallel backward: a bug of torch < 2.7. Fix: install torch>=2.7, "
            "or profile forward passes only.",
            RuntimeWarning,
            stacklevel=5,  # the user's `with accelerator.profile():` (two context managers)
        )
    schedule = None
    if handler.schedule_option is not None:
        try:
            schedule = torch.profiler.schedule(**handler.schedule_option)
        except TypeError as err:
            raise ConfigError(
                f"ProfileKwargs(schedule_option={handler.schedule_option!r}): {err}; use the "
                "keys wait, warmup, active, repeat, skip_first."
            ) from None
    # ProfileKwargs' fields of these names are torch.profiler.profile's keywords as they are
    passed_as_is = {name: getattr(handler, name) for name in _SAME_NAMED}
    with torch.profiler.profile(
        activities=_activities(handler.activities), schedule=schedule, **passed_as_is
    ) as profiler:
        yield profiler
    if handler.output_trace_dir is not None:
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(
            os.path.join(os.fspath(handler.output_trace_dir), f"profile_{rank}.json")
        )


__all__ = ["ProfileKwargs", "profile"]
