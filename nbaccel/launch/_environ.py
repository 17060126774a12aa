"""A process's launch state for the length of a launch, and nothing after it: environment
variables, and the typed configuration and rank facts the runtime reads.

Example:
    >>> import os
    >>> with patched_environ({"NBACCEL_DOC": "1"}):
    ...     os.environ["NBACCEL_DOC"]
    '1'
    >>> "NBACCEL_DOC" in os.environ
    False
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from ..config import LaunchConfig, install_launch_config, installed_launch_config
from ..platform.process_env import (
    EnvironmentSnapshot,
    install_process_facts,
    installed_process_facts,
)


@contextlib.contextmanager
def patched_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` for the launch; afterwards the environment is exactly as before."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in saved]:
            del os.environ[key]
        for key, old in saved.items():
            if os.environ.get(key) != old:
                os.environ[key] = old


@contextlib.contextmanager
def installed(config: LaunchConfig, facts: EnvironmentSnapshot) -> Iterator[None]:
    """``config`` and ``facts`` as this process's launch state (a function run in the
    kernel itself); afterwards what was installed before."""
    saved = installed_launch_config(), installed_process_facts()
    install_launch_config(config)
    install_process_facts(facts)
    try:
        yield
    finally:
        install_launch_config(saved[0])
        install_process_facts(saved[1])


__all__ = ["installed", "patched_environ"]
