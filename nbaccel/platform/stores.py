"""Which package reaches an object store's URL, and whether it is installed (nothing imported).

One table for the checkpoint layer, which opens the store through fsspec
(:mod:`nbaccel.checkpoint.store`), and for the launcher's pre-flight, which refuses a
launch whose arguments name a store this environment cannot reach before any rank starts
(the ranks would fail, each after its start; a package missing on one node only still
fails there). Only well-known store schemes are looked at: another ``scheme://`` string
may be anything (a database URL, an HTTP address) that the function handles itself.

Example:
    >>> scheme("s3://bucket/run"), scheme("runs/a")
    ('s3', None)
    >>> PACKAGES["gs"]
    'gcsfs'
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

from ..errors import StorageError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# the package that handles each well-known scheme (fsspec's registry names the same ones)
PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "hf": "huggingface_hub",
    "oci": "ocifs",
}


def scheme(path: str | os.PathLike[str]) -> str | None:
    """The URL scheme of ``path`` (lower case), or None for a plain path."""
    # a Path cannot hold a URL (it folds "//"), so only strings are looked at
    match = _SCHEME.match(path) if isinstance(path, str) else None
    return match.group(1).lower() if match else None


def install_hint(package: str) -> str:
    """The command that installs ``package`` (nbaccel's ``storage`` extra where it has it)."""
    return f"pip install {package}" + (
        " (or pip install 'nbaccel[storage]')"
        if package in ("fsspec", "s3fs", "fsspec s3fs")
        else ""
    )


def missing_for(url: object) -> str | None:
    """For a URL of a well-known store (``s3://``, ``gs://``, ``az://``...): the packages to
    install that are not (``"fsspec s3fs"``, ``"gcsfs"``); None when they are, or when
    ``url`` is no such URL. Found with ``importlib.util.find_spec``: nothing is imported."""
    found = scheme(url) if isinstance(url, str) else None
    package = PACKAGES.get(found or "")
    if package is None:
        return None
    if not _installed("fsspec"):  # the store's package needs it: both, in one command
        return f"fsspec {package}"
    return None if _installed(package) else package


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules: not importable
        return False


def check_args(args: Any) -> None:
    """Refuse, before any rank starts, a launch argument that is a URL of a well-known store
    (also one level inside a list, tuple or dict: ``({"project_dir": "s3://b/run"},)``) whose
    package is not installed here: the ranks would fail at their first save (or, before
    issue 52, write a local folder named ``s3:``). Other schemes are not looked at: they may
    be anything the function handles itself (a database, an HTTP address).

    Raises:
        StorageError: naming the argument and the command that installs what is missing.

    Example:
        >>> check_args(("runs/a", {"lr": 0.1}, "postgres://db/x"))
    """
    for name, value in _named(args):
        missing = missing_for(value)
        if missing is not None:
            raise StorageError(
                f"{name}={value!r} is an object-storage URL, and this environment cannot "
                f"reach it: {install_hint(missing)}, then launch again (on a cluster, on "
                "every node). Nothing was started and nothing was written."
            )


def _named(args: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for i, arg in enumerate(args if isinstance(args, list | tuple) else (args,)):
        out.append((f"args[{i}]", arg))
        if isinstance(arg, dict):
            out += [(f"args[{i}][{k!r}]", v) for k, v in arg.items()]
        elif isinstance(arg, list | tuple):
            out += [(f"args[{i}][{j}]", v) for j, v in enumerate(arg)]
    return out


__all__ = ["PACKAGES", "check_args", "install_hint", "missing_for", "scheme"]
