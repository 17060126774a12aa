"""The porting namespace: ``from nbaccel import accelerate`` stands in for ``import accelerate``.

Scripts written for Hugging Face Accelerate gate features on its version::

    import accelerate
    if version.parse(accelerate.__version__) >= version.parse("0.16.0"):
        accelerator.register_save_state_pre_hook(save_model_hook)

Ported as ``from nbaccel import accelerate``, ``accelerate.__version__`` is the version
of Accelerate's API that nbaccel follows (:data:`ACCELERATE_API_VERSION`), so such gates
take the path they take under Accelerate; every other name (``accelerate.Accelerator``,
``accelerate.utils``, ``accelerate.state``, ...) is nbaccel's. nbaccel's own version stays
``nbaccel.__version__`` (and ``accelerate.nbaccel_version`` here).

Example:
    >>> from nbaccel import accelerate
    >>> accelerate.__version__ == ACCELERATE_API_VERSION
    True
    >>> accelerate.utils.set_seed.__module__
    'nbaccel.runtime.process.rng'
"""

from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__ as nbaccel_version

#: The Accelerate release whose documented API nbaccel follows.
ACCELERATE_API_VERSION = "1.15.0"
__version__ = ACCELERATE_API_VERSION

# ``accelerate.<name>`` submodules scripts reach through the package attribute
_SUBMODULES = {
    "accelerator": "accelerator",
    "data_loader": "data_loader",
    "launchers": "launchers",
    "local_sgd": "local_sgd",
    "logging": "logging",
    "parallelism_config": "parallelism_config",
    "state": "state",
    "tracking": "tracking",
    "utils": "utils",
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"nbaccel.{_SUBMODULES[name]}")
    if name.startswith("__"):
        raise AttributeError(name)
    import nbaccel

    return getattr(nbaccel, name)


def __dir__() -> list[str]:
    import nbaccel

    return sorted({*dir(nbaccel), *_SUBMODULES, "ACCELERATE_API_VERSION", "nbaccel_version"})


__all__ = ["ACCELERATE_API_VERSION", "__version__", "nbaccel_version"]
