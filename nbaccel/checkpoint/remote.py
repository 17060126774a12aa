"""The checkpoint-directory protocol on object storage (an fsspec URL): manifest last.

An object store has no directories to rename, so a checkpoint at URL ``T`` is:

* ``T/data-<save id>/...``: the files of one save (models, optimizers, DCP shards,
  ``rank_{r}.pt``), each uploaded by the rank that made it, straight from that rank's
  private staging folder (never through a disk another rank reads);
* ``T/nbaccel_checkpoint.json``: the manifest, written last by the main process, only
  after every listed file was confirmed in the store (its size read back), naming the
  data folder and every file with its size and sha256.

One object write is atomic on S3, GCS and Azure: a reader sees the old manifest or the
new one, never half of one. So the manifest is the commit point: a save that dies
before it leaves the previous manifest, which still names the previous (untouched)
data folder; overwriting ``T`` replaces the manifest in one write and only then removes
the data folder it replaced. A reader checks every listed file's size before it calls
a checkpoint complete, and its sha256 while downloading.

Rank files of ranks other than the main process may land after the manifest (the
ranks of a replicated save never wait for each other); as on local disk, a rank file is
used only if it carries the manifest's save id.

Example:
    >>> data_folder("s3://bucket/run/ckpt", "abc.0.7.1")
    's3://bucket/run/ckpt/data-abc.0.7.1'
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError
from .directory import AUTO_NAME, FORMAT, MANIFEST, VERSION, check_header, newest_complete
from .rank_files import RANK_FILE
from .store import basename, download, filesystem, join, upload

DATA = "data-"


def data_folder(target: str, save_id: str) -> str:
    """Where the files of save ``save_id`` of the checkpoint at ``target`` go."""
    return join(target, DATA + save_id)


def _child(fs: Any, path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _children(fs: Any, path: str) -> list[str]:
    """Names directly under ``path`` (nothing if it does not exist)."""
    fs.invalidate_cache(path)
    try:
        return sorted(_child(fs, p) for p in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def upload_folder(local: Path, remote: str) -> dict[str, tuple[int, str]]:
    """Upload every file under ``local`` to ``remote``; ``{relative name: (size, sha256)}``."""
    fs, root = filesystem(remote)
    written: dict[str, tuple[int, str]] = {}
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        name = path.relative_to(local).as_posix()
        written[name] = upload(fs, path, join(root, name))
    return written


def check_target(target: str) -> None:
    """Refuse to write a checkpoint over something at ``target`` that is not one."""
    fs, root = filesystem(target)
    foreign = [n for n in _children(fs, root) if n != MANIFEST and not n.startswith(DATA)]
    if foreign or (fs.isfile(root)):
        raise ConfigError(
            f"save_state will not overwrite {target!r}: it holds {foreign[:3] or 'a file'}, "
            "which is not an nbaccel checkpoint. Choose an empty or new location."
        )


def _read_json(fs: Any, path: str) -> Any:
    fs.invalidate_cache(path)
    with fs.open(path, "rb") as fh:
        return json.loads(fh.read())


def manifest_save_id(target: str) -> str | None:
    """The save id of the checkpoint published at ``target``, or None if there is none."""
    fs, root = filesystem(target)
    try:
        manifest = _read_json(fs, join(root, MANIFEST))
    except (OSError, ValueError):
        return None
    return str(manifest.get("save_id", "")) if isinstance(manifest, dict) else None


def publish(target: str, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` as the checkpoint at ``target`` (one atomic object write), then
    remove the data folder it replaced and folders of saves that never completed."""
    fs, root = filesystem(target)
    try:
        previous = str(_read_json(fs, join(root, MANIFEST)).get("data", ""))
    except (OSError, ValueError, AttributeError):
        previous = ""
    body = (
        json.dumps({**manifest, "format": FORMAT, "version": VERSION}, indent=2) + "\n"
    ).encode()
    fs.pipe_file(join(root, MANIFEST), body)
    fs.invalidate_cache(root)
    current = manifest["save_id"]
    keep = {manifest["data"], DATA + current}
    for name in _children(fs, root):
        save_id = name[len(DATA) :]
        if not name.startswith(DATA) or name in keep:
            continue
        # the data of the checkpoint just replaced, and of saves that died before publishing
        if name == previous or _died_before(save_id, current):
            fs.rm(join(root, name), recursive=True)


def _died_before(other: str, current: str) -> bool:
    """True if save ``other`` can only be one that died before its manifest: it is of
    another run, or an earlier save of this Accelerator. (A folder of this run's *next*
    save may already be filling up: other ranks do not wait for this one.)

    Save ids are ``<run>.<accelerator>.<step>.<count>``
    (:func:`nbaccel.runtime.saving._checkpoint_write.save_id_for`).
    """
    mine, theirs = current.split("."), other.split(".")
    if len(mine) != 4 or len(theirs) != 4 or mine[0] != theirs[0]:
        return True
    try:
        return mine[1] == theirs[1] and (int(theirs[2]), int(theirs[3])) < (
            int(mine[2]),
            int(mine[3]),
        )
    except ValueError:
        return False


def read_manifest(target: str) -> dict[str, Any]:
    """The manifest of the complete checkpoint at ``target``.

    Raises:
        FileNotFoundError: nothing at ``target``.
        CheckpointError: ``target`` is not a checkpoint, or a listed file is missing or
            has another size (a partial or damaged checkpoint is never loaded).
    """
    fs, root = filesystem(target)
    try:
        manifest = _read_json(fs, join(root, MANIFEST))
    except FileNotFoundError:
        if _children(fs, root):
            raise CheckpointError(
                f"{target!r} is not a complete nbaccel checkpoint: it has no {MANIFEST} (a "
                "save that did not finish, or not a checkpoint). Load the previous one "
                "(load_state() picks the latest complete one)."
            ) from None
        raise FileNotFoundError(
            f"no checkpoint at {target!r}: check the URL (or save_state first)."
        ) from None
    except ValueError as err:
        raise CheckpointError(f"{join(target, MANIFEST)!r} is damaged ({err}).") from err
    check_header(manifest, target)
    data = join(root, manifest.get("data", ""))
    fs.invalidate_cache(data)
    for name, size in manifest.get("files", {}).items():
        try:
            stored = int(fs.info(join(data, name))["size"])
        except FileNotFoundError:
            stored = -1
        if stored != size:
            raise CheckpointError(
                f"{target!r} is incomplete or damaged: {name} is missing or has the wrong size."
            )
    return manifest


def fetch(target: str, manifest: dict[str, Any], into: Path) -> None:
    """Download the data of the checkpoint at ``target`` into the local folder ``into``.

    Every file the manifest lists is checked against its sha256; rank files that joined
    after the manifest come too (the loader checks their save id).
    """
    fs, root = filesystem(target)
    data = join(root, manifest["data"])
    hashes = manifest.get("sha256", {})
    for path in sorted(fs.find(data)):
        name = path[len(data.rstrip("/")) + 1 :]
        if name not in manifest["files"] and not RANK_FILE.fullmatch(name):
            continue
        _, digest = download(fs, path, into / name)
        if name in hashes and hashes[name] != digest:
            raise CheckpointError(
                f"{target!r} is damaged: {name} does not match the sha256 in its {MANIFEST}."
            )
    missing = [n for n in manifest["files"] if not (into / n).is_file()]
    if missing:
        raise CheckpointError(f"{target!r} is incomplete: {missing[:3]} could not be read.")


def numbered(root: str) -> list[tuple[int, str]]:
    """``(i, url)`` of every ``checkpoint_{i}`` under ``root``, lowest first."""
    fs, path = filesystem(root)
    found = []
    for name in _children(fs, path):
        match = AUTO_NAME.fullmatch(name)
        if match:
            found.append((int(match.group(1)), join(root, name)))
    return sorted(found)


def latest_checkpoint(root: str) -> str | None:
    """The complete ``checkpoint_{i}`` under ``root`` with the highest ``i``, or None."""
    return newest_complete(numbered(root), read_manifest)


def prune(root: str, limit: int | None) -> None:
    """Delete the oldest complete checkpoints under ``root`` beyond ``limit``.

    The newest complete checkpoint is never deleted; a deleted checkpoint loses its
    manifest first, so no reader takes a half-deleted one for complete.
    """
    if limit is None:
        return
    fs, _ = filesystem(root)
    complete = [url for _, url in numbered(root) if manifest_save_id(url) is not None]
    for url in complete[: max(0, len(complete) - max(limit, 1))]:
        _, path = filesystem(url)
        fs.rm(join(path, MANIFEST))
        fs.rm(path, recursive=True)


def upload_weights(local: Path, url: str) -> list[str]:
    """Upload the weights files ``save_model`` wrote into ``local`` to the folder ``url``.

    Shards first, the index last (it is the commit point of a sharded save; one object
    write, so atomic); then the shards of an earlier ``save_model`` there that its index
    named and this save did not rewrite are removed. A shard set mixed from two saves is
    refused on load (every file carries its save's id). Returns the URLs written.
    """
    fs, root = filesystem(url)
    names = sorted(p.name for p in local.iterdir() if p.is_file())
    names.sort(key=lambda n: n.endswith(".index.json"))  # indexes last
    stale: set[str] = set()
    for index in (n for n in _children(fs, root) if n.endswith(".index.json")):
        try:
            stale.update(str(v) for v in _read_json(fs, join(root, index))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    for name in names:
        upload(fs, local / name, join(root, name))
    for name in sorted(stale - set(names)):
        if "/" not in name:  # only names inside this folder, as on local disk
            fs.rm(join(root, name))
    return [join(url, name) for name in names]


def upload_file(local: Path, url: str) -> None:
    """Upload one file to ``url`` (one object write: readers see the old or the new one)."""
    fs, path = filesystem(url)
    upload(fs, local, path)


def fetch_weights(url: str, into: Path) -> Path:
    """Download the weights at ``url`` (a file, an index, or a folder ``save_model`` wrote)
    into the local folder ``into``; return the local path to read them from."""
    fs, path = filesystem(url)
    if fs.isdir(path):
        names = [n for n in _children(fs, path) if n.endswith((".safetensors", ".bin", ".json"))]
        for name in names:
            download(fs, join(path, name), into / name)
        return into
    name = basename(path)
    download(fs, path, into / name)
    if name.endswith(".index.json"):  # and the shards it names, beside it
        folder = path.rstrip("/").rsplit("/", 1)[0]
        weight_map = json.loads((into / name).read_text()).get("weight_map", {})
        for shard in sorted(set(weight_map.values())):
            download(fs, join(folder, shard), into / shard)
    return into / name


def staging_folder(target: str) -> tempfile.TemporaryDirectory[str]:
    """A private local folder in which this rank builds its files for ``target``."""
    return tempfile.TemporaryDirectory(prefix=f"nbaccel-{basename(target)}-")


__all__ = [
    "MANIFEST",
    "check_target",
    "data_folder",
    "fetch",
    "fetch_weights",
    "latest_checkpoint",
    "manifest_save_id",
    "numbered",
    "prune",
    "publish",
    "read_manifest",
    "staging_folder",
    "upload_file",
    "upload_folder",
    "upload_weights",
]
