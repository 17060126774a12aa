"""``accelerate.utils.other``: a view of :mod:`nbaccel.utils` (every name there works here).

Example:
    >>> import nbaccel.utils.other as m
    >>> m.set_seed is __import__("nbaccel.utils").utils.set_seed
    True
"""

from ._alias import delegate

__getattr__, __dir__ = delegate()
