"""Verified caches: the one mechanism behind every file the data modules derive and keep.

Trained tokenizers, encoded tensors (``.pt``) and token stores (folders of ``.bin`` files) are all cache
entries: a file, or a folder of files, built by a function and kept for the next run. Each entry carries a
manifest, ``<file>.manifest.json`` beside a file entry or ``manifest.json`` inside a folder entry, with

* ``format`` (of the manifest), ``kind`` and the kind's own ``version`` (bumped when its layout changes);
* ``source``: a digest of what the entry was derived from (corpus fingerprint, tokenizer hash, options),
  and the same parts in readable form;
* per file its ``size`` and a ``fingerprint``: SHA-256 of the whole file up to 64 MiB, above that of its size
  and 64 blocks of 64 KiB spread over it (a cheap check that still catches truncation and most damage
  without reading gigabytes on every start).

:func:`load_or_build` verifies an entry before use. A missing entry is built; one that does not verify
(damaged, truncated, stale, another version, or no manifest) is rebuilt with a warning that names it and
says why; one that cannot be rebuilt (``rebuildable=False``) raises :class:`CacheError` naming the file and
the fix. A file is never used unverified.

Building is safe against concurrent builders (two runs on one machine, DDP ranks): it holds an exclusive
lock (``fcntl.flock`` on the hidden ``.<entry>.lock`` beside the entry, left there: removing a lock file
races with its next user) and verifies again once it has it, so the second
builder finds the first one's entry instead of building again; files are written under a temporary name
and renamed into place (:mod:`comera_lightning.utilities.atomic`), folders likewise, and the manifest comes
last, so a killed builder leaves an entry that does not verify, never one that verifies and is wrong.
Readers verify without the lock; one that meets an entry being replaced waits for the lock and verifies
again. Where ``fcntl`` is missing (Windows) the builders race, and the atomic renames keep every entry whole.

What is built, from what and where is reported when the build starts and when it ends, and a long build
reports progress (``progress(text)`` from the builder) every ``PROGRESS_EVERY_S`` seconds.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from ..utilities.atomic import atomic_write, file_lock, fsync_dir
from .common import cache_key

__all__ = [
    "CACHE_FORMAT",
    "CacheError",
    "Progress",
    "cached_tensors",
    "file_fingerprint",
    "load_or_build",
    "manifest_path",
    "verify_cache",
]

CACHE_FORMAT = 1
MANIFEST_SUFFIX = ".manifest.json"
FOLDER_MANIFEST = "manifest.json"
FULL_HASH_LIMIT = 64 << 20
_SAMPLES, _SAMPLE_BYTES = 64, 64 << 10
PROGRESS_EVERY_S = 10.0
MISSING = "is missing"

#: ``progress(text)``: what a builder has done so far ("1,204 documents, 3.1 M tokens"), reported when due
Progress = Callable[[str], None]


class CacheError(RuntimeError):
    """A cache entry that does not verify and cannot be rebuilt; the message names the file and the fix."""


# ---------------------------------------------------------------------------------------------- manifests
def manifest_path(path: str | os.PathLike[str], files: Sequence[str] | None = None) -> Path:
    """Where the manifest of the entry ``path`` lives: inside a folder entry (``files`` given), else beside it."""
    path = Path(path)
    return path / FOLDER_MANIFEST if files is not None else path.with_name(path.name + MANIFEST_SUFFIX)


def file_fingerprint(path: str | os.PathLike[str]) -> str:
    """``sha256:<hex>`` of a file up to :data:`FULL_HASH_LIMIT` bytes, ``sampled-sha256:<hex>`` (size and
    64 evenly spread blocks) above."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= FULL_HASH_LIMIT:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
            return f"sha256:{digest.hexdigest()}"
        digest.update(str(size).encode())
        step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
        for i in range(_SAMPLES):
            fh.seek(i * step)
            digest.update(fh.read(_SAMPLE_BYTES))
    return f"sampled-sha256:{digest.hexdigest()}"


def _source_digest(source: Mapping[str, Any]) -> str:
    return cache_key(source)


def _describe_files(root: Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    return {
        name: {"size": os.path.getsize(root / name), "fingerprint": file_fingerprint(root / name)} for name in names
    }


def _write_manifest(
    target: Path, kind: str, version: int, source: Mapping[str, Any], files: dict[str, dict[str, Any]]
) -> None:
    record = {
        "format": CACHE_FORMAT,
        "kind": kind,
        "version": version,
        "source": _source_digest(source),
        "source_parts": json.loads(json.dumps(dict(source), default=str)),
        "files": files,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with atomic_write(target) as tmp:
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))


def verify_cache(
    path: str | os.PathLike[str],
    *,
    kind: str,
    version: int,
    source: Mapping[str, Any],
    files: Sequence[str] | None = None,
) -> str | None:
    """``None`` when the entry ``path`` verifies against its manifest, else why not (``"is missing"``,
    ``"is truncated: ..."``, ``"is stale: ..."``, ...).

    Args:
        path: the entry: a file, or a folder holding ``files``.
        kind, version: what the entry must be (its manifest records both).
        source: what it must have been derived from (compared by digest).
        files: the names inside a folder entry; ``None`` for a file entry.
    """
    path = Path(path)
    manifest = manifest_path(path, files)
    if not path.exists():
        return MISSING
    if not manifest.is_file():
        return (
            "has no manifest (written by an older version of comera_lightning, or its writer was killed "
            "before finishing)"
        )
    try:
        record = json.loads(manifest.read_text())
        recorded = record["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"has a damaged manifest {str(manifest)!r} ({type(error).__name__})"
    if record.get("format") != CACHE_FORMAT or record.get("kind") != kind or record.get("version") != version:
        return (
            f"is of another format (kind {record.get('kind')!r} version {record.get('version')!r}, manifest "
            f"format {record.get('format')!r}; expected {kind!r} version {version}, format {CACHE_FORMAT})"
        )
    if record.get("source") != _source_digest(source):
        changed = sorted(
            k
            for k in {*source, *record.get("source_parts", {})}
            if json.loads(json.dumps(source.get(k), default=str)) != record.get("source_parts", {}).get(k)
        )
        return f"is stale: it was built from another source (differs in {changed or 'its digest'})"
    names = list(files) if files is not None else [path.name]
    root = path if files is not None else path.parent
    for name in names:
        expected = recorded.get(name)
        target = root / name
        if expected is None:
            return f"is incomplete: its manifest does not list {name!r}"
        if not target.is_file():
            return f"is incomplete: {str(target)!r} is missing"
        size = target.stat().st_size
        if size != expected["size"]:
            what = "truncated" if size < expected["size"] else "longer than written"
            return f"is {what}: {str(target)!r} has {size:,} bytes, its manifest says {expected['size']:,}"
        if file_fingerprint(target) != expected["fingerprint"]:
            return f"is damaged: the content of {str(target)!r} does not match its manifest's checksum"
    return None


# ---------------------------------------------------------------------------------------------- building
class _Reporter:
    """Says what is built, from what and where; a long build's progress at most every ``PROGRESS_EVERY_S``."""

    def __init__(self, what: str, origin: str, path: Path) -> None:
        self.what, self.path = what, path
        self.start = self.last = time.monotonic()
        rank_zero_info(f"comera: building the {what} from {origin} into {path}")

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            rank_zero_info(f"comera:   {self.what}: {text} ({now - self.start:.0f} s)")

    def done(self, size: int) -> None:
        amount = f"{size / 2**20:,.1f} MiB" if size >= 1 << 20 else f"{size / 2**10:,.1f} KiB"
        rank_zero_info(
            f"comera: built the {self.what} in {time.monotonic() - self.start:.1f} s ({amount}): {self.path}"
        )


def _new_folder_beside(path: Path, suffix: str) -> Path:
    """A new empty hidden folder ``.<name>.<random><suffix>`` beside ``path``.

    Made with the mode a plain ``mkdir`` gives (``0o777`` less the umask), not ``tempfile.mkdtemp``'s private
    ``0o700``: a folder entry is this folder renamed into place, and must be as readable as the files in it.
    """
    for _ in range(100):
        folder = path.with_name(f".{path.name}.{secrets.token_hex(4)}{suffix}")
        try:
            folder.mkdir(0o777)  # the kernel applies the umask (and a default ACL) as for any mkdir
        except FileExistsError:
            continue
        return folder
    raise FileExistsError(errno.EEXIST, f"no free temporary folder name beside {str(path)!r}")


def _remove(path: Path, files: Sequence[str] | None) -> None:
    """Remove an entry that does not verify (a folder is renamed away first, so its name never holds half a
    folder), and its manifest."""
    manifest_path(path, files).unlink(missing_ok=True)
    if path.is_dir() and not path.is_symlink():
        doomed = _new_folder_beside(path, ".old")
        os.replace(path, doomed / path.name)
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _build(
    path: Path,
    kind: str,
    version: int,
    source: Mapping[str, Any],
    files: Sequence[str] | None,
    build: Callable[[Path, Progress], None],
    reporter: _Reporter,
) -> None:
    if files is None:
        with atomic_write(path) as tmp:
            build(tmp, reporter)
        _write_manifest(manifest_path(path), kind, version, source, _describe_files(path.parent, [path.name]))
        reporter.done(path.stat().st_size)
        return
    tmp = _new_folder_beside(path, ".tmp")
    try:
        build(tmp, reporter)
        described = _describe_files(tmp, files)
        for name in files:  # durable before the rename makes them visible
            fd = os.open(tmp / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _write_manifest(manifest_path(tmp, files), kind, version, source, described)
        os.rename(tmp, path)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    reporter.done(sum(entry["size"] for entry in described.values()))


def load_or_build(
    path: str | os.PathLike[str],
    *,
    kind: str,
    version: int,
    source: Mapping[str, Any],
    build: Callable[[Path, Progress], None],
    load: Callable[[Path], Any] | None = None,
    files: Sequence[str] | None = None,
    what: str | None = None,
    origin: str = "its source",
    rebuildable: bool = True,
    fix: str | None = None,
) -> tuple[Any, bool]:
    """The verified cache entry ``path`` (``load(path)``, or the path), built or rebuilt first when needed.

    Args:
        path: the entry: a file, or a folder (``files``: the names it holds).
        kind, version: what the entry is and its layout's version; another version is rebuilt.
        source: JSON-serialisable parts that identify what the entry is derived from; an entry built from
            other parts is stale and rebuilt.
        build: ``build(target, progress)`` writes the entry to ``target`` (a temporary file, or a new empty
            folder, renamed into place afterwards); it may call ``progress("...")`` as it goes.
        load: reads a verified entry; an entry that verifies but does not load is rebuilt like a damaged one.
        what, origin: for the messages: "the {what} from {origin} into {path}".
        rebuildable: ``False`` for entries that must not be replaced (a folder the user named): a failed check
            raises :class:`CacheError` with ``fix``.

    Returns:
        ``(loaded entry or path, built)``: ``built`` is whether this call (re)built it.
    """
    path = Path(path).expanduser()
    what = what or kind
    reason = verify_cache(path, kind=kind, version=version, source=source, files=files)
    if reason is None:
        loaded, reason = _try_load(path, load)
        if reason is None:
            return loaded, False
    with file_lock(path):
        # again under the lock: another process may have built it (or be the one replacing it) meanwhile
        reason = verify_cache(path, kind=kind, version=version, source=source, files=files)
        if reason is None:
            loaded, reason = _try_load(path, load)
            if reason is None:
                return loaded, False
        if reason != MISSING:
            if not rebuildable:
                raise CacheError(
                    f"the cached {what} {str(path)!r} {reason}. {fix or 'Delete it and run again to rebuild it.'}"
                )
            warnings.warn(f"comera: the cached {what} {str(path)!r} {reason}; rebuilding it", stacklevel=2)
            _remove(path, files)
        path.parent.mkdir(parents=True, exist_ok=True)
        _build(path, kind, version, source, files, build, _Reporter(what, origin, path))
        loaded, reason = _try_load(path, load)
        if reason is not None:
            raise CacheError(
                f"the {what} just built at {str(path)!r} does not load ({reason}); this is a bug: "
                "please report it with the command that ran"
            )
        return loaded, True


def _try_load(path: Path, load: Callable[[Path], Any] | None) -> tuple[Any, str | None]:
    if load is None:
        return path, None
    try:
        return load(path), None
    except Exception as error:
        return None, f"does not load ({type(error).__name__}: {error})"


def cached_tensors(
    path: str | os.PathLike[str],
    *,
    source: Mapping[str, Any],
    make: Callable[[], Any],
    what: str,
    origin: str,
    version: int = 1,
    mmap: bool = False,
) -> Any:
    """Tensors (a dict of them, any ``weights_only`` object) cached at ``path``: loaded when the entry verifies,
    else ``make()``, saved (:func:`load_or_build`, kind ``"tensors"``) and returned without reading it back."""
    import torch

    made: list[Any] = []

    def build(target: Path, progress: Progress) -> None:
        made.append(make())
        with open(target, "wb") as fh:  # a file object: a full disk is an OSError (utilities.atomic)
            torch.save(made[0], fh)

    def load(target: Path) -> Any:
        return made[0] if made else torch.load(target, map_location="cpu", weights_only=True, mmap=mmap)

    return load_or_build(
        path, kind="tensors", version=version, source=source, build=build, load=load, what=what, origin=origin
    )[0]
