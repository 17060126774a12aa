"""Random number generators: seeding, snapshot/restore, and cross-rank synchronisation.

Example:
    >>> from nbaccel.runtime.process.rng import set_seed, get_rng_state, set_rng_state
    >>> set_seed(0)
    >>> snapshot = get_rng_state()
    >>> import torch; a = torch.rand(1)
    >>> set_rng_state(snapshot); bool(torch.rand(1) == a)
    True
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...platform.tpu import loaded_backend, require_backend

# Every RNG kind that ``rng_types=`` accepts; "generator" means the dataloader samplers'.
RNG_TYPES: tuple[str, ...] = ("torch", "cuda", "python", "numpy", "generator", "xla")


def _process_index() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device, if CUDA is initialised).

    Args:
        seed: the seed.
        device_specific: add the process index so every rank draws different numbers
            (e.g. for data augmentation); model init should use the same seed everywhere.
        deterministic: also ask torch for deterministic algorithms.

    Example:
        >>> set_seed(42); import torch; torch.rand(1).item() == (set_seed(42) or torch.rand(1).item())
        True
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"set_seed(seed={seed!r}): seed must be an int.")
    if device_specific:
        seed += _process_index()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily
    if deterministic:
        torch.use_deterministic_algorithms(True)


def get_rng_state() -> dict[str, Any]:
    """Snapshot of python, numpy, torch (and CUDA, if initialised) RNG states.

    Each rank saves its own (checkpoints hold one file per rank).
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    xla = _xla_rng_state()
    if xla is not None:
        state["xla"] = xla
    return state


def _xla_rng_state() -> Any:
    backend = loaded_backend()  # a TPU backend in use in this process (torch_xla)
    return None if backend is None else backend.rng_state()


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned (missing kinds are left alone)."""
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "xla" in state:
        require_backend().set_rng_state(state["xla"])


def validate_rng_types(rng_types: Iterable[str] | None) -> tuple[str, ...]:
    """Check ``rng_types`` (default ``("generator",)``); raise ``ValueError`` on unknown names."""
    if rng_types is None:
        return ("generator",)
    if isinstance(rng_types, str):
        rng_types = [rng_types]
    names = tuple(str(getattr(r, "value", r)).lower() for r in rng_types)
    unknown = [n for n in names if n not in RNG_TYPES]
    if unknown:
        raise ValueError(f"rng_types has unknown entries {unknown}; use any of {list(RNG_TYPES)}.")
    return names


def synchronize_rng_state(rng_type: str | None = None, generator: Any = None) -> None:
    """Copy rank 0's state of one RNG (or of ``generator`` for ``"generator"``) to every rank."""
    if rng_type in (None, "generator") and generator is not None:
        synchronize_generators([generator])
        return
    synchronize_rng_states([rng_type or "torch"])


def synchronize_rng_states(rng_types: Iterable[str], generator: Any = None) -> None:
    """Copy rank 0's global RNG states (``torch``, ``cuda``, ``python``, ``numpy``) to every rank,
    and ``generator``'s state when ``"generator"`` is asked for with one.

    A collective: every rank must call it at the same point. ``"generator"`` alone needs
    no collective (dataloaders seed their samplers from a seed agreed at prepare time).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    rng_types = [str(getattr(t, "value", t)).lower() for t in rng_types]
    if generator is not None and "generator" in rng_types:
        synchronize_generators([generator])
    wanted = [t for t in rng_types if t in ("torch", "cuda", "python", "numpy")]
    if not wanted:
        return
    snapshot = get_rng_state()
    payload = [{k: snapshot[k] for k in wanted if k in snapshot}]
    dist.broadcast_object_list(payload, src=0)
    set_rng_state(payload[0])


def synchronize_generators(generators: Sequence[torch.Generator]) -> None:
    """Copy rank 0's state of each generator to every rank (a collective when distributed).

    The generators keep drawing their own stream: a prepared loader with the user's
    ``generator`` shuffles exactly like the unprepared loader would on rank 0.
    """
    if not generators or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() == 1:
        return
    states = [g.get_state() for g in generators]
    dist.broadcast_object_list(states, src=0)
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)


def agree_on_seed(generator: torch.Generator | None = None) -> int:
    """Draw a 63-bit seed on every rank and return rank 0's (a collective when distributed).

    Every rank draws, so their RNG streams advance identically.
    """
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [seed]
        dist.broadcast_object_list(box, src=0)
        seed = int(box[0])
    return seed


__all__ = [
    "RNG_TYPES",
    "agree_on_seed",
    "get_rng_state",
    "set_rng_state",
    "set_seed",
    "synchronize_generators",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "validate_rng_types",
]
