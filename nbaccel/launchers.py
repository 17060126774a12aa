"""The launchers at the path scripts know from ``accelerate.launchers`` (names only).

Example:
    >>> from nbaccel.launchers import notebook_launcher
    >>> notebook_launcher.__module__
    'nbaccel.launch.launcher'
"""

from .launch.launcher import debug_launcher, notebook_launcher
from .runtime.accelerate_utils.compat import PrepareForLaunch

__all__ = ["PrepareForLaunch", "debug_launcher", "notebook_launcher"]
