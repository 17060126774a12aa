"""``get_logger`` at the path scripts know from ``accelerate.logging`` (names only).

Example:
    >>> from nbaccel.logging import get_logger
    >>> get_logger(__name__).logger.name
    'nbaccel.logging'
"""

from .runtime.accelerate_utils.logging_adapter import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]
