"""Durable file-system steps: fsync that reports errors, renames that reach the disk.

Every checkpoint and weights write follows one protocol: write under a temporary
name, fsync the file, rename it into place, fsync the parent directory. An error
reported by ``fsync`` is an error: NFS and full disks report lost writes only there,
and swallowing it would publish a manifest over data that never reached the disk.

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> tmp = temp_name(os.path.join(folder, "weights.bin"))
    >>> with open(tmp, "wb") as fh:
    ...     _ = fh.write(b"data")
    >>> fsync_path(tmp); replace(tmp, os.path.join(folder, "weights.bin"))
    >>> sorted(os.listdir(folder))
    ['weights.bin']
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
import uuid
from pathlib import Path

# Filesystems that cannot fsync a directory say so with these; the rename itself is
# still atomic there, and there is nothing more a program can do.
_DIR_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EBADF}
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a written file (or a directory's entry list) to disk.

    Raises:
        OSError: ``fsync`` failed on a file (e.g. EIO/ENOSPC on NFS), or failed on a
            directory for another reason than "this filesystem cannot fsync directories".
    """
    is_dir = os.path.isdir(path)
    if is_dir and sys.platform == "win32":
        # Windows cannot open a directory as a file (os.open raises PermissionError) and
        # has no directory fsync; NTFS journals the renames that made the entries.
        return
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if is_dir else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError as err:
        if not (is_dir and err.errno in _DIR_FSYNC_UNSUPPORTED):
            raise OSError(
                err.errno, f"fsync failed, the data may not be on disk: {err.strerror}", str(path)
            ) from err
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync every file and directory under ``path`` (bottom-up), then ``path`` itself."""
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_path(os.path.join(root, name))
        for name in dirs:
            fsync_path(os.path.join(root, name))
    fsync_path(path)


def make_dirs(path: str | os.PathLike[str]) -> None:
    """``mkdir -p`` whose new directory entries are themselves fsynced into their parents."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    path.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        fsync_path(created.parent)


def temp_name(path: str | os.PathLike[str], kind: str = "tmp") -> Path:
    """A hidden sibling of ``path`` that no reader mistakes for it: ``.name.tmp-<id>``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{uuid.uuid4().hex[:12]}")


def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Atomically rename ``src`` over ``dst`` and fsync the parent so the rename persists."""
    os.replace(src, dst)
    fsync_path(Path(dst).parent)


def _renameat2() -> object | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False when the platform or filesystem cannot exchange (the caller then
    falls back to two renames, which :func:`nbaccel.checkpoint.directory.recover`
    repairs if a crash falls between them).
    """
    fn = _renameat2()
    if fn is None:
        return False
    result = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)  # type: ignore[operator]
    if result == 0:
        fsync_path(Path(b).parent)
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, f"cannot exchange {a} and {b}: {os.strerror(code)}")


__all__ = ["exchange", "fsync_path", "fsync_tree", "make_dirs", "replace", "temp_name"]
