"""The base of every comera data module: the options they all take, checked once, and the loaders they serve.

Each data module keeps the shared options (``batch_size``, ``num_workers``, ``seed``, ``cache_dir``) as plain
arguments of its own ``__init__``, with its own defaults, because LightningCLI reads a data module's options from
that signature (``data.init_args.batch_size`` in YAML, ``--data.batch_size`` on the command line). It hands them
to :class:`ComeraDataModule`, which checks them with the same messages in every module and serves the loaders:

* ``train_dataloader``: the training rows, shuffled by ``(seed, epoch)`` and resumable mid-epoch
  (:func:`~.common.rows_loader`);
* ``val_dataloader``: the validation rows in order;
* ``test_dataloader``: the rows :meth:`ComeraDataModule._test_rows` holds out, in order (by default the
  validation rows);
* ``predict_dataloader``: the same rows with ``index`` (the row number) added to every batch.

A module builds ``train_dataset`` and ``val_dataset`` in ``setup`` and says how a batch of rows becomes the
model's batch (:meth:`ComeraDataModule._collate_fn`); every loader with no rows is ``[]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Sampler
from typing_extensions import override

from .common import KeepIndex, cache_key, rows_loader, uses_validation_rows_notice

__all__ = ["ComeraDataModule"]


class ComeraDataModule(pl.LightningDataModule):
    """What every comera data module shares: the loader options, the datasets set up on first use, the loaders.

    Args:
        batch_size: rows per batch (per process under DDP); at least 1.
        num_workers: DataLoader worker processes; 0 loads in the training process.
        seed: seeds the training order (with the epoch) and the loaders' worker seeds; modules use it for their
            own draws too (subsets, masks, negatives).
        cache_dir: where tokenizers and encoded data are cached (``None``: the module caches nothing).
    """

    #: why ``test`` and ``predict`` run on the validation rows, said once at info level (``None``: not said)
    _no_test_split: str | None = None

    def __init__(self, batch_size: int, num_workers: int, seed: int, cache_dir: str | None) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.cache_dir = cache_dir
        # rows with __len__ and __getitems__ (TensorDictDataset, TokenRows); None until set up
        self.train_dataset: Any = None
        self.val_dataset: Any = None

    def _cache_file(self, name: str, source: Mapping[str, Any]) -> Path:
        """``<cache_dir>/encoded/<name>-<key>.pt``: where tensors derived from ``source`` are cached."""
        if self.cache_dir is None:
            raise RuntimeError(f"{type(self).__name__} has no cache_dir to cache {name!r} in")
        return Path(self.cache_dir).expanduser() / "encoded" / f"{name}-{cache_key(source)}.pt"

    # ------------------------------------------------------------------ what a module provides
    def _collate_fn(self, train: bool) -> Callable[[Any], Any]:
        """How a batch of rows becomes the model's batch, for the training loader or (``False``) the others."""
        raise NotImplementedError

    def _sampler(self, rows: Any, train: bool) -> Sampler[int] | None:
        """The order of ``rows``; ``None`` is :func:`~.common.rows_loader`'s (training: shuffled, else in order)."""
        return None

    def _test_rows(self, stage: str) -> Any:
        """The rows ``test`` and ``predict`` run on: the validation rows, unless a module holds out others."""
        rows = self._rows("val_dataset", stage)
        if self._no_test_split is not None:
            uses_validation_rows_notice(self, stage, self._no_test_split)
        return rows

    # ------------------------------------------------------------------ loaders
    def _rows(self, name: str, stage: str) -> Any:
        """The dataset attribute ``name``, set up for ``stage`` first when it is not yet (e.g. outside a Trainer)."""
        if getattr(self, name) is None:
            self.setup(stage)
        return getattr(self, name)

    def _loader(self, rows: Any, train: bool, collate_fn: Callable[[Any], Any] | None = None) -> DataLoader | list:
        """A loader of ``rows`` with this module's options (``[]`` when there are none)."""
        if not len(rows):
            return []
        return rows_loader(
            rows,
            batch_size=self.batch_size,
            collate_fn=self._collate_fn(train) if collate_fn is None else collate_fn,
            train=train,
            seed=self.seed,
            num_workers=self.num_workers,
            sampler=self._sampler(rows, train),
        )

    @override
    def train_dataloader(self) -> DataLoader | list:
        """The training rows, shuffled (the order a function of seed and epoch), resumable mid-epoch."""
        return self._loader(self._rows("train_dataset", "fit"), train=True)

    @override
    def val_dataloader(self) -> DataLoader | list:
        """The validation rows in order; ``[]`` without validation rows."""
        return self._loader(self._rows("val_dataset", "validate"), train=False)

    @override
    def test_dataloader(self) -> DataLoader | list:
        """The held-out rows (:meth:`_test_rows`) in order, batched as for validation."""
        return self._loader(self._test_rows("test"), train=False)

    @override
    def predict_dataloader(self) -> DataLoader | list:
        """The :meth:`test_dataloader` rows with ``index`` (the row's number among them, long) in every batch."""
        return self._loader(self._test_rows("predict"), train=False, collate_fn=KeepIndex(self._collate_fn(False)))
