"""Atomic, durable file writes: a file carries its final name only once it is complete and on disk.

Every writer in the package (checkpoints, data caches, tokenizers, exports, prediction files) goes
through :func:`atomic_write`: the bytes go to a hidden temporary file in the target's folder, which is
fsync'ed and then renamed onto the target (``os.replace``, atomic on POSIX); the folder is fsync'ed so
the rename survives a power loss too. A killed writer can leave a hidden ``.<name>.<random>.tmp`` file
behind, never a partial file under the target's name.

The file gets the mode a plain ``open(path, "w")`` would give it: a new file ``0o666`` less the umask (the
temporary file is created with that mode, not ``tempfile``'s private ``0o600``), a replaced one keeps its mode.

:func:`file_lock` serialises a critical section between processes (creating a shared store, say).

A full disk is reported as such, whatever the writer: ``OSError(ENOSPC, "no space left on device while
writing <path> ...")`` naming the file, instead of, for instance, torch's ``unexpected pos 768 vs 662``
(:func:`atomic_torch_save` writes through a Python file object, so torch's writer sees the ``OSError``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["TEMP_SUFFIX", "atomic_torch_save", "atomic_write", "file_lock", "fsync_dir", "is_disk_full"]

TEMP_SUFFIX = ".tmp"


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """fsync a folder so renames in it are durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) says the file system is full."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(current) or "os error 28" in str(current):  # e.g. safetensors' Rust IO
            return True
        current = current.__cause__ or current.__context__
    return False


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], *, overwrite: bool = True) -> Iterator[Path]:
    """Yield a hidden temporary path beside ``path``; on a clean exit it becomes ``path``, durably.

    Write the whole file to the yielded path (by name: ``torch.save(obj, tmp)``, ``tokenizer.save(tmp)``).
    On exit the file is fsync'ed and renamed onto ``path``, then the folder is fsync'ed; on an exception
    the temporary file is removed and ``path`` is untouched.

    Args:
        path: the target file; its folder is created when missing.
        overwrite: with ``False`` an existing ``path`` is never replaced, not even one created while
            writing (the file is hard-linked into place): ``FileExistsError``.

    Raises:
        OSError: ``ENOSPC`` with a message naming ``path`` when the disk fills up while writing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_temporary(path)
    try:
        try:
            yield tmp
            fd = os.open(tmp, os.O_RDWR)
            try:
                os.fsync(fd)  # a delayed allocation on a full disk fails here
            finally:
                os.close(fd)
        except Exception as error:
            if is_disk_full(error):
                kept = "the earlier file is intact" if path.exists() else "nothing was written under that name"
                raise OSError(
                    errno.ENOSPC,
                    f"no space left on device while writing {str(path)!r} ({kept}): free "
                    f"space on the file system of {str(path.parent)!r} or write elsewhere",
                ) from error
            raise
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _create_temporary(path: Path) -> Path:
    """A new empty hidden file beside ``path``, with the mode ``open(path, "w")`` would give ``path``."""
    try:
        mode = path.stat().st_mode & 0o7777  # a replaced file keeps its mode, as open() keeps it
    except OSError:
        mode = None
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        try:
            # 0o666: the kernel applies the umask (and a default ACL) exactly as for open()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        try:
            if mode is not None:
                os.chmod(tmp, mode)
        finally:
            os.close(fd)
        return tmp
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside {str(path)!r}")


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock between processes on the hidden ``.<name>.lock`` beside ``path`` while inside.

    The lock file is left in place (removing it races with its next user). Where ``fcntl`` is missing
    (Windows) this is a no-op.
    """
    path = Path(path)
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _link_new(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)  # fails if path exists, atomically
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: check, then rename (a small race remains)
        if path.exists():
            raise FileExistsError(f"{str(path)!r} exists") from None
        os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` through :func:`atomic_write`."""
    with atomic_write(path) as tmp, open(tmp, "wb") as fh:
        # through a file object: a full disk then surfaces as OSError(ENOSPC), not as a torch RuntimeError
        torch.save(obj, fh)
