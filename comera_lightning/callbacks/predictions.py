"""PredictionWriter: ``predict`` outputs as a JSON-lines file, one record per example, written atomically.

Use it from the CLI (``class_path: PredictionWriter`` resolves by short name)::

    comera predict --config configs/quickstart.yaml --ckpt_path runs/<exp>/<run>/checkpoints/last.ckpt \\
        --trainer.callbacks+=PredictionWriter --trainer.callbacks.output_path=preds.jsonl

or in YAML::

    trainer:
      callbacks:
        - class_path: PredictionWriter
          init_args:
            output_path: preds.jsonl   # default: <trainer.default_root_dir>/predictions.jsonl
            overwrite: false

or in Python: ``Trainer(callbacks=[PredictionWriter("preds.jsonl")]).predict(model, datamodule)``.

What a record is: ``predict_step`` returns a dict whose values share a first dimension, the examples of
the batch (tensors of shape ``(N, ...)``, or lists of length ``N``); record ``i`` holds every value's
``i``-th entry, tensors as JSON numbers and lists. A 0-dim tensor or a plain scalar is repeated in every
record; a returned tensor (not a dict) is written as ``{"prediction": ...}``. The comera tasks return:

* ``MaskedLM``: one record per masked position: ``index`` (row), ``position``, ``input_id``, ``true_id``,
  ``top_ids``, ``top_probs`` (and ``true_token``, ``top_tokens`` decoded);
* ``SequenceClassification``: ``index``, ``label``, ``predicted``, ``probabilities`` (and ``predicted_name``);
* ``ClickThrough``: ``index``, ``label``, ``click_probability``.

Records are written as batches finish, in the loader's order, to a hidden temporary file next to
``output_path``, which is fsync'ed and renamed into place when prediction ends: a crashed or interrupted
run never leaves a partial file under the name. An existing file is refused before any prediction runs,
unless ``overwrite=True``. With several processes (DDP) each writes its own file,
``<stem>.rank<N><suffix>`` (e.g. ``predictions.rank1.jsonl``), holding the rows of that process's shard;
the ``index`` field tells where each row belongs. Non-finite numbers are written as ``null`` (strict JSON).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from ..utilities.atomic import atomic_write

__all__ = ["PredictionWriter", "prediction_records"]

DEFAULT_FILENAME = "predictions.jsonl"


def _plain(value: Any) -> Any:
    """A tensor (or a nested structure of them) as plain Python values for JSON."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.is_floating_point() and value.dtype not in (torch.float32, torch.float64):
            value = value.float()  # bf16/fp16: tolist() gives the same numbers as float32
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by ``None`` (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def prediction_records(prediction: Any) -> list[dict[str, Any]]:
    """Split one ``predict_step`` output into per-example records (see the module docstring).

    Raises:
        ValueError: the values of the dict do not share their first dimension (named with their sizes).
    """
    if prediction is None:
        return []
    if not isinstance(prediction, Mapping):
        prediction = {"prediction": prediction}
    per_example: dict[str, Any] = {}
    shared: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    for key, value in prediction.items():
        key = str(key)
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            per_example[key], sizes[key] = value, int(value.shape[0])
        elif isinstance(value, (list, tuple)):
            per_example[key], sizes[key] = value, len(value)
        else:
            shared[key] = value
    if len(set(sizes.values())) > 1:
        raise ValueError(
            "PredictionWriter: the values predict_step returned do not share a first dimension (one entry per "
            f"example): {sizes}; return tensors of shape (N, ...) or lists of length N for the N examples"
        )
    count = next(iter(sizes.values()), 1)
    columns = {key: _plain(value) for key, value in per_example.items()}
    shared_plain = {key: _plain(value) for key, value in shared.items()}
    records = []
    for i in range(count):
        record: dict[str, Any] = {}
        for key in prediction:  # the task's key order
            key = str(key)
            record[key] = columns[key][i] if key in columns else shared_plain[key]
        records.append(record)
    return records


class PredictionWriter(BasePredictionWriter):
    """Write ``predict`` outputs to a JSON-lines file, one record per example, atomically.

    Args:
        output_path: the file; relative paths are relative to the working directory. ``None``:
            ``predictions.jsonl`` in ``trainer.default_root_dir`` (``runs/`` under ``comera``).
        overwrite: replace an existing file; by default an existing file is refused, before predicting.

    See the module docstring (:mod:`comera_lightning.callbacks.predictions`) for the record format, the
    per-process files under DDP and the CLI/YAML usage.
    """

    def __init__(self, output_path: str | None = None, overwrite: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.output_path = output_path
        self.overwrite = overwrite
        self.path: Path | None = None  #: the file of this process, once prediction started
        self.records_written = 0
        self._writing: contextlib.ExitStack | None = None  #: the open temporary file, in atomic_write
        self._file: IO[str] | None = None

    # ------------------------------------------------------------------ paths
    def resolve_path(self, trainer: Trainer) -> Path:
        """This process's output file (``<stem>.rank<N><suffix>`` when there are several processes)."""
        if self.output_path:
            path = Path(self.output_path).expanduser()
        else:
            path = Path(trainer.default_root_dir) / DEFAULT_FILENAME
        if trainer.world_size > 1:
            path = path.with_name(f"{path.stem}.rank{trainer.global_rank}{path.suffix}")
        return path

    def _refuse_existing(self, path: Path) -> None:
        if path.exists() and not self.overwrite:
            raise FileExistsError(
                f"PredictionWriter: {str(path)!r} already exists and would be overwritten; pass overwrite=True "
                "(--trainer.callbacks.overwrite=true, or `overwrite: true` under the callback's init_args) or "
                "choose another output_path"
            )
        if path.is_dir():
            raise IsADirectoryError(f"PredictionWriter: output_path {str(path)!r} is a directory; name a file in it")

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "predict":
            return
        path = self.resolve_path(trainer)
        self._refuse_existing(path)  # before the model runs on anything
        self.path = path

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.path is None:
            self.path = self.resolve_path(trainer)
            self._refuse_existing(self.path)
        self._discard()
        self._writing = contextlib.ExitStack()
        tmp = self._writing.enter_context(atomic_write(self.path, overwrite=self.overwrite))
        self._file = self._writing.enter_context(open(tmp, "w", encoding="utf-8"))  # noqa: SIM115 (the stack closes it)
        self.records_written = 0

    @override
    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Append the batch's records to the temporary file."""
        if self._file is None:
            return
        lines = []
        for record in prediction_records(prediction):
            try:
                lines.append(json.dumps(record, allow_nan=False))
            except ValueError:  # NaN or infinity somewhere
                lines.append(json.dumps(_finite(record), allow_nan=False))
        if lines:
            self._file.write("\n".join(lines) + "\n")
        self.records_written += len(lines)

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Close the temporary file and move it into place (fsync'ed, atomic)."""
        if self._writing is None or self.path is None:
            return
        writing, self._writing, self._file = self._writing, None, None
        try:
            writing.close()
        except FileExistsError:  # created by someone else while predicting
            self._refuse_existing(self.path)
            raise

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._discard()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._discard()

    def _discard(self) -> None:
        """Close and delete the temporary file, if any (never the output file)."""
        if self._writing is not None:
            writing, self._writing, self._file = self._writing, None, None
            writing.__exit__(RuntimeError, RuntimeError("prediction did not finish"), None)
