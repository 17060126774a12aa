"""Setting environment variables for the length of a launch, and nothing after it.

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


@contextlib.contextmanager
def patched_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` for the launch; afterwards the environment is exactly as before
    (torch_xla itself sets ``PJRT_LOCAL_PROCESS_*`` variables in the launching process)."""
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


__all__ = ["patched_environ"]
