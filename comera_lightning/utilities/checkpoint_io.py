"""AtomicCheckpointIO: Lightning's ``TorchCheckpointIO`` with atomic, fsync'ed local writes.

Lightning's own ``TorchCheckpointIO`` is not atomic in the crash sense: it writes through an fsspec
transaction that stages the file in the system temporary folder and moves it into place (a copy in
place when that folder is on another file system) and never fsyncs. This plugin writes local files with
:func:`comera_lightning.utilities.atomic.atomic_write`, so a checkpoint name never holds a partial file::

    Trainer(plugins=[AtomicCheckpointIO()])
    comera fit ... --trainer.plugins comera_lightning.utilities.checkpoint_io.AtomicCheckpointIO

:class:`~comera_lightning.callbacks.fault_tolerance.FaultTolerance` installs it by itself
(``atomic_io=True``) when the trainer has a plain ``TorchCheckpointIO``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from .atomic import atomic_torch_save

__all__ = ["AtomicCheckpointIO", "read_checkpoint"]

_SHARDED_METADATA = "meta.pt"  # what Lightning's distributed checkpoint folder keeps besides the tensors


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic and durable; remote URLs (``s3://`` ...) and
    loading are Lightning's."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        text = str(path)
        if storage_options is not None or ("://" in text and not text.startswith("file://")):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        atomic_torch_save(checkpoint, text.removeprefix("file://"))


def read_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """A Lightning checkpoint as one dict, read with ``weights_only=True``: a ``.ckpt`` file, or a distributed
    checkpoint folder (``ModelParallelStrategy``/FSDP with ``save_distributed_checkpoint=True``) with its shards
    consolidated into full tensors (``state_dict`` and the optimiser states), without any process group.

    Raises:
        ValueError: a folder that is not a distributed checkpoint.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return torch.load(folder, map_location=map_location, weights_only=True)
    if not (folder / ".metadata").is_file() or not (folder / _SHARDED_METADATA).is_file():
        raise ValueError(
            f"{os.fspath(path)!r} is a folder but not a distributed checkpoint (no .metadata and "
            f"{_SHARDED_METADATA}); pass a .ckpt file or the folder a sharded run saved"
        )
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = torch.load(folder / _SHARDED_METADATA, map_location=map_location, weights_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, Path(tmp) / "full.pt")
        checkpoint.update(torch.load(Path(tmp) / "full.pt", map_location=map_location, weights_only=True))
    return checkpoint
