"""AtomicCheckpointIO: Lightning's ``TorchCheckpointIO`` with atomic, fsync'ed local writes.

Lightning's own ``TorchCheckpointIO`` is not atomic in the crash sense: it writes through an fsspec
transaction that stages the file in the system temporary folder and moves it into place (a copy in
place when that folder is on another file system) and never fsyncs. This plugin writes local files with
:func:`comera_lightning.training.atomic.atomic_write`, so a checkpoint name never holds a partial file::

    Trainer(plugins=[AtomicCheckpointIO()])
    comera fit ... --trainer.plugins comera_lightning.training.checkpoint_io.AtomicCheckpointIO

:class:`~comera_lightning.training.fault_tolerance.FaultTolerance` installs it by itself
(``atomic_io=True``) when the trainer has a plain ``TorchCheckpointIO``.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from .atomic import atomic_torch_save

__all__ = ["AtomicCheckpointIO"]


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
