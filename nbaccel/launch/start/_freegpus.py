"""Free notebook GPUs handled before anything starts: bf16 without native support, a
broken peer-to-peer path, a small ``/dev/shm``.

Each decision is a pure function of the GPU facts (:func:`nbaccel.platform.gpufacts.gpu_facts`),
the launch and the environment; each says itself in one line in the cell, and an
environment variable the user set always wins (nothing of theirs is overridden):

* bf16 on compute capability < 8.0 (Kaggle's and Colab's T4, V100): emulated, many times
  slower, so a line names fp16 with its GradScaler; with ``torch.compile`` in the function
  it is refused (pytorch#118122: Triton crashes on bf16 there).
* several GPUs without NVLink: a copy between each pair over the peer path, in a
  subprocess bounded in time (once per kernel); where the driver reports no peer path or
  the copy fails or hangs, ``NCCL_P2P_DISABLE=1`` for the run (Lightning#19425: two T4s
  hang in NCCL's P2P path).
* ``/dev/shm`` smaller than NCCL's shared-memory transport needs (Docker's 64 MB):
  ``NCCL_SHM_DISABLE=1`` for the run (torchtitan#853).

Example:
    >>> from nbaccel.platform.gpufacts import GpuFacts
    >>> facts = GpuFacts(("Tesla T4",), ((7, 5),), shm_bytes=64 << 20)
    >>> shm_decision(facts, nproc=2, environ={})[0]
    {'NCCL_SHM_DISABLE': '1'}
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError
from ...platform import gpufacts, hosts
from ...platform.gpufacts import GpuFacts

#: seconds the peer-to-peer copy between two GPUs may take before it counts as hung
P2P_CHECK_TIMEOUT = 30.0
_MIB = 1 << 20


@dataclass(frozen=True)
class GpuDecisions:
    """What a launch on these GPUs gets: environment for its workers, lines for the cell."""

    env: dict[str, str] = field(default_factory=dict)
    lines: tuple[str, ...] = ()


def used_gpus(
    facts: GpuFacts, nproc: int, gpu_ids: str | None, environ: Mapping[str, str]
) -> list[int]:
    """The GPUs (``nvidia-smi``'s numbers) a launch of ``nproc`` processes uses: ``gpu_ids``,
    else ``CUDA_VISIBLE_DEVICES``, else all; numbers only (a UUID list: all of them).

    Example:
        >>> used_gpus(GpuFacts(("a", "b", "c")), 2, None, {"CUDA_VISIBLE_DEVICES": "2,0"})
        [2, 0]
    """
    chosen = gpu_ids if gpu_ids and gpu_ids.strip().lower() != "all" else None
    chosen = chosen if chosen is not None else environ.get("CUDA_VISIBLE_DEVICES")
    indices = list(range(facts.count))
    if chosen is not None:
        parts = [p.strip() for p in chosen.split(",") if p.strip()]
        if all(p.isdigit() for p in parts):
            indices = [int(p) for p in parts if int(p) < facts.count]
    return indices[: max(nproc, 1)]


def precision_line(
    facts: GpuFacts, used: list[int], mixed_precision: str | None, compiles: bool
) -> str | None:
    """bf16 on a GPU older than compute capability 8.0: the line naming fp16 + GradScaler.

    Raises:
        ConfigError: bf16 with ``torch.compile`` there (pytorch#118122).

    Example:
        >>> precision_line(GpuFacts(("Tesla T4",), ((7, 5),)), [0], "bf16", False)[:40]
        "nbaccel: mixed_precision='bf16' on Tesla"
    """
    if mixed_precision != "bf16":
        return None
    capabilities = facts.capabilities
    old = [i for i in used if i < len(capabilities) and hosts.lacks_bf16(capabilities[i])]
    if not old:
        return None
    name, (major, minor) = facts.names[old[0]], facts.capabilities[old[0]]
    gpu = f"{name} (compute capability {major}.{minor})"
    if compiles:
        raise ConfigError(
            f"mixed_precision='bf16' with torch.compile on {gpu} crashes: Triton has no bf16 "
            "before compute capability 8.0 (pytorch#118122). Use mixed_precision='fp16' (with "
            "its GradScaler), or leave torch.compile out on this GPU."
        )
    return (
        f"nbaccel: mixed_precision='bf16' on {gpu} has no native bf16 and runs emulated, "
        "several times slower: mixed_precision='fp16' (with its GradScaler) is the fast choice."
    )


def p2p_decision(
    facts: GpuFacts,
    used: list[int],
    environ: Mapping[str, str],
    check: Callable[[list[tuple[int, int]]], bool],
) -> tuple[dict[str, str], str | None]:
    """Several GPUs not all joined by NVLink: ``NCCL_P2P_DISABLE=1`` where the driver reports
    no peer path or ``check`` (a bounded copy over it) fails; nothing if the user set
    ``NCCL_P2P_DISABLE`` or ``NCCL_P2P_LEVEL``.

    Example:
        >>> facts = GpuFacts(("T4", "T4"), ((7, 5), (7, 5)), ((True, True), (True, True)))
        >>> p2p_decision(facts, [0, 1], {}, lambda pairs: False)[0]
        {'NCCL_P2P_DISABLE': '1'}
    """
    if len(used) < 2 or "NCCL_P2P_DISABLE" in environ or "NCCL_P2P_LEVEL" in environ:
        return {}, None
    pairs = [(a, b) for i, a in enumerate(used) for b in used[i + 1 :]]
    if all(_cell(facts.nvlink, a, b) for a, b in pairs):
        return {}, None
    gpus = ",".join(map(str, used))
    if any(_cell(facts.p2p, a, b) is False or _cell(facts.p2p, b, a) is False for a, b in pairs):
        why = "have no peer-to-peer path between them (nvidia-smi topo -p2p r)"
    elif not check(pairs):
        why = (
            f"have no NVLink, and a copy between them over the peer-to-peer path failed or "
            f"took over {P2P_CHECK_TIMEOUT:.0f} s"
        )
    else:
        return {}, None
    return {"NCCL_P2P_DISABLE": "1"}, (
        f"nbaccel: GPUs {gpus} {why}, so this run sets NCCL_P2P_DISABLE=1 (NCCL goes through "
        "host memory instead of hanging; set NCCL_P2P_DISABLE yourself to decide)."
    )


def _cell(matrix: tuple[tuple[bool, ...], ...], a: int, b: int) -> bool | None:
    """``matrix[a][b]``; None where nvidia-smi did not say (the check decides then)."""
    return matrix[a][b] if a < len(matrix) and b < len(matrix[a]) else None


def shm_needed(nproc: int) -> int:
    """Bytes of ``/dev/shm`` a launch of ``nproc`` NCCL processes is given room for: NCCL's
    shared-memory transport maps buffers per pair of ranks (several MB each, per channel);
    Docker's default 64 MB is too small already for two."""
    return max(256 * _MIB, 64 * _MIB * nproc)


def shm_decision(
    facts: GpuFacts, nproc: int, environ: Mapping[str, str]
) -> tuple[dict[str, str], str | None]:
    """``/dev/shm`` smaller than :func:`shm_needed`: ``NCCL_SHM_DISABLE=1`` for the run
    (nothing if the user set ``NCCL_SHM_DISABLE``)."""
    size = facts.shm_bytes
    if nproc < 2 or size is None or "NCCL_SHM_DISABLE" in environ or size >= shm_needed(nproc):
        return {}, None
    return {"NCCL_SHM_DISABLE": "1"}, (
        f"nbaccel: /dev/shm holds {size // _MIB} MiB, less than NCCL's shared-memory transport "
        f"needs for {nproc} processes ({shm_needed(nproc) // _MIB} MiB), so this run sets "
        "NCCL_SHM_DISABLE=1 (or give the container more: docker run --shm-size=1g; set "
        "NCCL_SHM_DISABLE yourself to decide)."
    )


def decide(
    facts: GpuFacts,
    *,
    nproc: int,
    gpu_ids: str | None,
    mixed_precision: str | None,
    compiles: bool,
    environ: Mapping[str, str],
    check: Callable[[list[tuple[int, int]]], bool],
) -> GpuDecisions:
    """Every decision for a launch of ``nproc`` processes on these GPUs (none without GPUs).

    Raises:
        ConfigError: bf16 with torch.compile on a GPU before compute capability 8.0.
    """
    if facts.count == 0:
        return GpuDecisions()
    used = used_gpus(facts, nproc, gpu_ids, environ)
    env: dict[str, str] = {}
    lines = [precision_line(facts, used, mixed_precision, compiles)]
    if nproc > 1:
        for extra, line in (p2p_decision(facts, used, environ, check),
                            shm_decision(facts, nproc, environ)):  # fmt: skip
            env.update(extra)
            lines.append(line)
    return GpuDecisions(env, tuple(line for line in lines if line))


_checked: dict[tuple[tuple[int, int], ...], bool] = {}


def _check_once(pairs: list[tuple[int, int]]) -> bool:
    """The peer-to-peer copy check, once per kernel for each set of GPUs (a sweep's launches
    pay it once)."""
    key = tuple(pairs)
    if key not in _checked:
        _checked[key] = gpufacts.p2p_works(pairs, timeout=P2P_CHECK_TIMEOUT)
    return _checked[key]


def compiles(function: Any) -> bool:
    """Whether ``function`` (or code nested in it) calls ``torch.compile`` or passes
    ``dynamo_backend=``: read from its bytecode, nothing is run.

    Example:
        >>> import torch
        >>> compiles(lambda model: torch.compile(model)), compiles(print)
        (True, False)
    """
    code = getattr(function, "__code__", None)
    return code is not None and _compiles(code)


_ATTRIBUTE = ("LOAD_ATTR", "LOAD_METHOD")


def _compiles(code: Any) -> bool:
    # a call's keyword names are a tuple among the constants (Python 3.11+)
    if any(isinstance(c, tuple) and "dynamo_backend" in c for c in code.co_consts):
        return True
    previous = None
    for ins in dis.get_instructions(code):
        if ins.argval == "compile" and previous == "torch" and ins.opname in _ATTRIBUTE:
            return True
        previous = ins.argval if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST",
                                                "LOAD_DEREF") else None  # fmt: skip
    return any(_compiles(c) for c in code.co_consts if hasattr(c, "co_code"))


def for_launch(cfg: Any, nproc: int, function: Any, environ: Mapping[str, str]) -> GpuDecisions:
    """The decisions for a launch with config ``cfg``: facts read (cached), lines written
    to the cell's stderr, the environment to give the workers returned."""
    facts = gpufacts.gpu_facts()
    if cfg.compute_device in ("cpu", "tpu") or facts.count == 0:
        return GpuDecisions()
    decisions = decide(facts, nproc=nproc, gpu_ids=cfg.gpu_ids,
                       mixed_precision=cfg.mixed_precision, compiles=compiles(function),
                       environ=environ, check=_check_once)  # fmt: skip
    for line in decisions.lines:
        sys.stderr.write(line + "\n")
    return decisions


__all__ = [
    "P2P_CHECK_TIMEOUT",
    "GpuDecisions",
    "compiles",
    "decide",
    "for_launch",
    "p2p_decision",
    "precision_line",
    "shm_decision",
    "shm_needed",
    "used_gpus",
]
