"""``LocalSGD`` at the path scripts know from ``accelerate.local_sgd`` (names only).

Example:
    >>> from nbaccel.local_sgd import LocalSGD
    >>> LocalSGD.__module__
    'nbaccel.runtime.training.local_sgd'
"""

from .runtime.training.local_sgd import LocalSGD

__all__ = ["LocalSGD"]
