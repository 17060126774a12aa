"""Object storage behind fsspec URLs: which paths are URLs, opening their store, copying.

A checkpoint path may be a local path or a URL (``s3://bucket/run``, ``gs://...``,
``file:///abs/dir``). ``file://`` (and ``local://``) URLs are plain local paths and take
the local protocol (fsync, atomic rename); every other scheme goes to an fsspec
filesystem. fsspec and the store's package (``s3fs``, ``gcsfs``, ``adlfs``...) are
optional: they are imported only here, only when such a URL is used, and a URL whose
package is missing, or whose scheme nothing handles, is refused with
:class:`~nbaccel.errors.StorageError` naming what to install, before anything is written.
Without this, ``Path("s3://bucket/x")`` is the relative local path ``s3:/bucket/x``.

Credentials and endpoints come from the store's own configuration (environment
variables such as ``AWS_PROFILE`` / ``AWS_ENDPOINT_URL``, ``~/.aws``, gcloud's
application-default credentials, fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>`` variables):
nbaccel passes no options and never logs them.

Example:
    >>> is_url("s3://bucket/run"), is_url("runs/a"), is_url("C:\\\\runs")
    (True, False, False)
    >>> as_local("file:///tmp/run")
    PosixPath('/tmp/run')
    >>> join("s3://bucket/run", "checkpoints", "checkpoint_0")
    's3://bucket/run/checkpoints/checkpoint_0'
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from ..errors import StorageError
from ..platform.stores import PACKAGES, install_hint, scheme

_LOCAL_SCHEMES = {"file", "local"}
_CHUNK = 8 * 2**20


def is_url(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a URL that names an object store (not ``file://``)."""
    found = scheme(path)
    return found is not None and found not in _LOCAL_SCHEMES


def as_local(path: str | os.PathLike[str]) -> Path:
    """``path`` as a local :class:`~pathlib.Path`; ``file:///x`` and ``local:///x`` become ``/x``."""
    found = scheme(path)
    if found in _LOCAL_SCHEMES:
        return Path(str(path)[len(found) + 3 :] or "/")
    return Path(path)


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended, ``/``-separated (object keys, not OS paths)."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def basename(url: str) -> str:
    """The last component of ``url``."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def parent(url: str) -> str:
    """``url`` without its last component."""
    return url.rstrip("/").rsplit("/", 1)[0]


def filesystem(url: str) -> tuple[Any, str]:
    """Open the store of ``url``: ``(fsspec filesystem, path inside it)``.

    Raises:
        StorageError: fsspec or the scheme's package is not installed (the message says
            which to install), or no installed package handles the scheme.
    """
    found = scheme(url) or ""
    package = PACKAGES.get(found)
    try:
        import fsspec
    except ImportError:
        needed = "fsspec" if package is None else f"fsspec {package}"
        raise StorageError(
            f"{url!r} is an object-storage URL, which needs fsspec: {install_hint(needed)}. "
            "Nothing was written."
        ) from None
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as err:
        name = package or (getattr(err, "name", None) or "the package for this scheme")
        raise StorageError(
            f"{url!r} needs the package {name!r} to reach its {found}:// store: "
            f"{install_hint(name)}. Nothing was written. ({err})"
        ) from err
    except ValueError as err:
        raise StorageError(
            f"{url!r}: no installed package handles {found}:// URLs ({err}). Use a local "
            f"path or a URL fsspec knows (s3://, gs://, az://, file://); a scheme of a "
            f"third-party store needs its fsspec package installed. Nothing was written."
        ) from err
    return fs, path


def check(url: str | os.PathLike[str]) -> None:
    """Refuse a URL whose store cannot be opened (no-op for local paths)."""
    if isinstance(url, str) and is_url(url):
        filesystem(url)


def upload(fs: Any, local: Path, remote: str) -> tuple[int, str]:
    """Copy file ``local`` to ``remote`` (a path inside ``fs``); return its size and sha256.

    The object is read back (its size) before this returns: a store that lost the write
    fails here, not at the first load.

    Raises:
        OSError: the store holds another size than was written; the store's own errors
            (unreachable, refused) propagate for the caller to name the URL.
    """
    digest = hashlib.sha256()
    with open(local, "rb") as src, fs.open(remote, "wb") as dst:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            dst.write(chunk)
    size = local.stat().st_size
    fs.invalidate_cache(remote)  # listings cached before the write would hide it
    stored = int(fs.info(remote)["size"])
    if stored != size:
        raise OSError(f"{remote}: the store holds {stored} bytes, {size} were written")
    return size, digest.hexdigest()


def download(fs: Any, remote: str, local: Path) -> tuple[int, str]:
    """Copy object ``remote`` to file ``local``; return its size and sha256."""
    digest = hashlib.sha256()
    local.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    with fs.open(remote, "rb") as src, open(local, "wb") as dst:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            dst.write(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


__all__ = [
    "PACKAGES",
    "as_local",
    "basename",
    "check",
    "download",
    "filesystem",
    "is_url",
    "join",
    "parent",
    "scheme",
    "upload",
]
