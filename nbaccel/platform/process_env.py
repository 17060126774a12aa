"""The launch environment variables of this process, parsed once into a frozen snapshot.

``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` and nbaccel's ``NBACCEL_USE_CPU``, ``NBACCEL_TIMEOUT``,
``NBACCEL_DEBUG_MODE`` are read here and nowhere else: the runtime's process state
and the progress bars both start from :func:`read_environment`. A worker started by
nbaccel's launcher does not parse them: the launcher hands it these facts typed, and the
worker installs them (:func:`install_process_facts`) before any user code runs.

Example:
    >>> read_environment({"RANK": "1", "WORLD_SIZE": "2"}).local_rank
    1
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class EnvironmentSnapshot:
    """The launch-related environment variables, parsed once (see :func:`read_environment`)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: str | None = None
    use_cpu: bool = False
    timeout: float | None = None
    debug: bool = False


def _int_var(environ: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer.") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={raw!r} must be >= {minimum}.")
    return value


_installed: list[EnvironmentSnapshot] = []  # at most one: set by nbaccel's worker bootstrap


def install_process_facts(facts: EnvironmentSnapshot | None) -> None:
    """Make ``facts`` what :func:`read_environment` returns in this process (None: undo)."""
    _installed[:] = [] if facts is None else [facts]


def installed_process_facts() -> EnvironmentSnapshot | None:
    """The facts a launcher installed in this process, or None."""
    return _installed[0] if _installed else None


def read_environment(environ: Mapping[str, str] | None = None) -> EnvironmentSnapshot:
    """This process's launch facts: installed by nbaccel's launcher, else parsed from the
    environment variables (the only place nbaccel's runtime reads them).

    Args:
        environ: mapping to parse; by default the installed facts, else ``os.environ``.

    Raises:
        ConfigError: a variable is malformed or inconsistent (e.g. ``RANK >= WORLD_SIZE``).

    Example:
        >>> read_environment({"RANK": "1", "WORLD_SIZE": "2"}).local_rank
        1
    """
    if environ is None and _installed:
        return _installed[0]
    env = os.environ if environ is None else environ
    world_size = _int_var(env, "WORLD_SIZE", 1, 1)
    rank = _int_var(env, "RANK", 0, 0)
    if rank >= world_size:
        raise ConfigError(
            f"RANK={rank} must be < WORLD_SIZE={world_size}; the launcher sets both, so check "
            "that every process of this job got the same WORLD_SIZE."
        )
    local_world_size = _int_var(env, "LOCAL_WORLD_SIZE", world_size, 1)
    local_rank = _int_var(env, "LOCAL_RANK", rank % local_world_size, 0)
    node_default = rank // local_world_size
    node_rank = _int_var(env, "GROUP_RANK", _int_var(env, "NODE_RANK", node_default, 0), 0)
    timeout: float | None = None
    raw_timeout = env.get("NBACCEL_TIMEOUT")
    if raw_timeout:
        try:
            timeout = float(raw_timeout)
        except ValueError:
            timeout = -1.0
        if not timeout > 0:
            raise ConfigError(
                f"environment variable NBACCEL_TIMEOUT={raw_timeout!r} must be a number of "
                "seconds > 0 (the process-group timeout)."
            )
    return EnvironmentSnapshot(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=env.get("MASTER_ADDR"),
        master_port=env.get("MASTER_PORT"),
        use_cpu=env.get("NBACCEL_USE_CPU", "").strip().lower() in ("1", "true", "yes"),
        timeout=timeout,
        debug=env.get("NBACCEL_DEBUG_MODE", "").strip().lower() in ("1", "true", "yes"),
    )


def distributed_active() -> bool:
    """True when a ``torch.distributed`` group of more than one process is initialised.

    Looks only at an already imported ``torch.distributed``: asking never imports torch.
    """
    dist = sys.modules.get("torch.distributed")
    return bool(
        dist is not None
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


__all__ = [
    "EnvironmentSnapshot",
    "distributed_active",
    "install_process_facts",
    "installed_process_facts",
    "read_environment",
]
