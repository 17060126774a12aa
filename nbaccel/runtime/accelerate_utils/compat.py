"""Helpers that ported scripts import from the best-known peer's ``utils`` and ``data_loader``.

Each is small and built on nbaccel's own runtime: enums with the peer's member names,
``release_memory`` / ``find_executable_batch_size`` for out-of-memory retries,
``patch_environment``, and ``prepare_data_loader`` with the peer's positional signature.

Example:
    >>> @find_executable_batch_size(starting_batch_size=8)
    ... def train(batch_size):
    ...     if batch_size > 2:
    ...         raise RuntimeError("CUDA out of memory.")
    ...     return batch_size
    >>> train()
    2
"""

from __future__ import annotations

import contextlib
import enum
import functools
import gc
import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ...errors import ConfigError
from ..collectives import ops
from ..compute import dynamo
from ..loading.data import PreparedDataLoader
from ..loading.data import prepare_data_loader as _prepare
from ..process.rng import validate_rng_types
from ..process.state import current_state, get_state
from ..training.wrappers import unwrap_model


class PrecisionType(str, enum.Enum):
    """Mixed-precision modes, as an enum (``mixed_precision=PrecisionType.BF16``)."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(str, enum.Enum):
    """The RNGs ``rng_types=`` can keep in step across processes."""

    TORCH = "torch"
    CUDA = "cuda"
    XLA = "xla"
    NUMPY = "numpy"
    PYTHON = "python"
    GENERATOR = "generator"


def wait_for_everyone() -> None:
    """Barrier: every process waits here until all arrive (no-op for one process)."""
    ops.barrier()


def release_memory(*objects: Any) -> list[None]:
    """Drop references the caller hands over, collect garbage, empty the CUDA cache.

    Returns one ``None`` per object: ``model, optimizer = release_memory(model, optimizer)``.
    """
    objects = tuple(None for _ in objects)
    gc.collect()
    empty_cuda_caches()
    return list(objects)


def empty_cuda_caches() -> None:
    """Give the GPU memory nothing references back: cuBLAS's workspaces, then the cache.

    torch keeps one cuBLAS workspace per handle and stream, allocated through its caching
    allocator at the first matrix product (65 MiB on an H200), and ``empty_cache()`` does
    not free it: ``memory_allocated()`` stays up after every tensor is gone (issue 32).
    The next product allocates a fresh one. Does nothing where CUDA was never initialised.

    Example:
        >>> empty_cuda_caches()
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        torch.cuda.synchronize()  # a workspace may still be in use by a queued kernel
        clear()
    torch.cuda.empty_cache()


_OOM_MARKERS = (
    "out of memory",
    "CUDNN_STATUS_NOT_SUPPORTED",
    "DefaultCPUAllocator: can't allocate",
)


def _is_oom(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MARKERS)


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Decorator: call ``function(batch_size, ...)``, with a smaller batch after each OOM.

    The decorated function takes ``batch_size`` as its first parameter; callers omit it.
    After an out-of-memory error the batch size becomes ``int(batch_size * 0.9)``
    (Accelerate's rule), or what ``reduce_batch_size_fn()`` returns.

    Raises:
        RuntimeError: the batch size reached zero.
        TypeError: the caller passed the batch size itself.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    wrapped = function

    @functools.wraps(wrapped)
    def run(*args: Any, **kwargs: Any) -> Any:
        batch_size = starting_batch_size
        params = list(inspect.signature(wrapped).parameters)
        if len(params) < len(args) + 1:
            raise TypeError(
                f"{wrapped.__name__}() receives batch_size from find_executable_batch_size: "
                f"call it without that first argument (got {len(args)} positional arguments)."
            )
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return wrapped(batch_size, *args, **kwargs)
            except Exception as err:
                if not _is_oom(err):
                    raise
                release_memory()
                if reduce_batch_size_fn is not None:
                    batch_size = int(reduce_batch_size_fn())
                else:
                    batch_size = int(batch_size * 0.9)

    return run


@contextlib.contextmanager
def patch_environment(**values: Any) -> Iterator[None]:
    """Set environment variables (upper-cased names, ``str`` values) inside the block."""
    saved = {k.upper(): os.environ.get(k.upper()) for k in values}
    os.environ.update({k.upper(): str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


class PrepareForLaunch:
    """Wrap ``launcher`` for ``torch.multiprocessing.start_processes``: each child gets its
    rank variables from its index, then runs ``launcher(*args)``.

    ``RANK = NODE_RANK * NPROC + index`` and ``LOCAL_RANK = index`` (``NPROC``: processes
    per node, default ``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``, else 1); with
    ``distributed_type="NO"`` nothing is set. ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``
    come from the caller's environment, as with Accelerate. ``debug=True`` runs the
    children on the CPU (``NBACCEL_USE_CPU=1``).

    Example:
        >>> PrepareForLaunch(print, distributed_type="MULTI_CPU").distributed_type.value
        'MULTI_CPU'
    """

    def __init__(
        self, launcher: Callable[..., Any], distributed_type: Any = "NO", debug: bool = False
    ) -> None:
        from ..process.state import DistributedType

        self.launcher = launcher
        self.distributed_type = DistributedType(
            str(getattr(distributed_type, "value", distributed_type))
        )
        self.debug = debug

    def __call__(self, index: int, *args: Any) -> Any:
        from ..process.state import DistributedType, reset_state

        if self.distributed_type is not DistributedType.NO or self.debug:
            env = os.environ
            nproc = int(env.get("NPROC", env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))))
            node_rank = int(env.get("NODE_RANK", env.get("GROUP_RANK", "0")))
            env.update(LOCAL_RANK=str(index), RANK=str(node_rank * nproc + index))
            env.setdefault("LOCAL_WORLD_SIZE", str(nproc))
            if self.debug:
                env["NBACCEL_USE_CPU"] = "1"
        os.environ["FORK_LAUNCHED"] = "1"  # Accelerate's marker (PartialState.fork_launched)
        reset_state()  # a forked child must not reuse its parent's process facts
        return self.launcher(*args)


def extract_model_from_parallel(
    model: Any,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> Any:
    """The user's module inside DDP/DataParallel (and ``torch.compile`` unless kept);
    ``recursive``: DDP/DataParallel wrappers nested inside it are replaced by their modules
    too (in place)."""

    def inner(m: Any) -> Any:
        return unwrap_model(m, keep_fp32_wrapper=keep_fp32_wrapper)

    unwrapped = dynamo.unwrap(model, inner, keep_torch_compile)
    if recursive:
        for parent in list(unwrapped.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(
                    child, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel
                ):
                    setattr(parent, name, inner(child))
    return unwrapped


def prepare_data_loader(
    dataloader: torch.utils.data.DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Sequence[str] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Callable[..., Any] | None = None,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
) -> PreparedDataLoader:
    """Shard ``dataloader`` for this process, with the peer's positional signature.

    ``num_processes`` / ``process_index`` default to this process's state; batches move
    to ``device`` (default: this process's) only with ``put_on_device=True``.
    ``use_seedable_sampler`` shuffles by ``data_seed`` + epoch as Accelerate's does;
    ``use_stateful_dataloader`` makes ``load_state`` resume mid-epoch.
    ``torch_device_mesh``: shard over its ``dp_replicate``/``dp_shard`` dimensions only.

    Raises:
        ConfigError: ``slice_fn_for_dispatch``, which nbaccel lacks.
    """
    if slice_fn_for_dispatch is not None:
        raise ConfigError(
            "prepare_data_loader(slice_fn_for_dispatch=...) is not supported; leave it None."
        )
    state = current_state() or get_state()
    if torch_device_mesh is not None:  # shard over its data-parallel dimensions only
        from ..parallel.config import data_parallel_share

        size, index = data_parallel_share(torch_device_mesh)
        num_processes = size if num_processes is None else num_processes
        process_index = index if process_index is None else process_index
    target = (device or state.device) if put_on_device else None
    return _prepare(
        dataloader,
        num_processes=state.world_size if num_processes is None else num_processes,
        process_index=state.rank if process_index is None else process_index,
        split_batches=split_batches,
        even_batches=even_batches,
        device=torch.device(target) if target is not None else None,
        non_blocking=non_blocking,
        rng_types=validate_rng_types(rng_types),
        dispatch_batches=(
            put_on_device and isinstance(dataloader.dataset, torch.utils.data.IterableDataset)
            if dispatch_batches is None
            else dispatch_batches
        ),
        data_seed=data_seed,
        use_stateful_dataloader=use_stateful_dataloader,
        use_seedable_sampler=use_seedable_sampler,
    )


__all__ = [
    "PrecisionType",
    "PrepareForLaunch",
    "RNGType",
    "empty_cuda_caches",
    "extract_model_from_parallel",
    "find_executable_batch_size",
    "patch_environment",
    "prepare_data_loader",
    "release_memory",
    "wait_for_everyone",
]
