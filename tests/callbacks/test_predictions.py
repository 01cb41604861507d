"""PredictionWriter: JSON lines, one record per example, atomic, never overwriting by surprise."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from comera_lightning.callbacks import PredictionWriter
from comera_lightning.callbacks.predictions import prediction_records


class _Scores(LightningModule):
    """predict_step returns a dict like the comera tasks: per-example tensors, a list and a shared scalar."""

    def __init__(self, fail_at: int | None = None, nan: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.fail_at, self.nan, self.calls = fail_at, nan, 0

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        self.calls += 1
        if batch_idx == self.fail_at:
            raise RuntimeError("boom")
        x = batch.float()
        probs = torch.stack([x / 100, 1 - x / 100], dim=1)
        if self.nan:
            probs[0, 0] = math.nan
        return {
            "index": batch,
            "probs": probs,
            "name": [f"row{int(i)}" for i in batch],
            "batch": torch.tensor(batch_idx),
        }


def _trainer(tmp_path: Path, writer: PredictionWriter) -> Trainer:
    return Trainer(
        default_root_dir=str(tmp_path),
        callbacks=[writer],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def _loader(n: int = 10) -> DataLoader:
    return DataLoader(torch.arange(n), batch_size=4)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prediction_records_split_per_example():
    records = prediction_records(
        {
            "a": torch.tensor([1, 2]),
            "b": torch.tensor([[0.5, 0.25], [1.0, 0.0]]),
            "c": ["x", "y"],
            "d": torch.tensor(7),
            "e": "same",
        }
    )
    assert records == [
        {"a": 1, "b": [0.5, 0.25], "c": "x", "d": 7, "e": "same"},
        {"a": 2, "b": [1.0, 0.0], "c": "y", "d": 7, "e": "same"},
    ]
    assert prediction_records(torch.tensor([3, 4])) == [{"prediction": 3}, {"prediction": 4}]
    assert prediction_records(None) == []
    assert prediction_records({"p": torch.tensor([0.5], dtype=torch.bfloat16)}) == [{"p": 0.5}]
    with pytest.raises(ValueError, match=r"first dimension.*'a': 2, 'b': 3"):
        prediction_records({"a": torch.zeros(2), "b": [1, 2, 3]})


def test_writes_one_record_per_example_to_the_default_path(tmp_path):
    writer = PredictionWriter()
    _trainer(tmp_path, writer).predict(_Scores(), _loader(), return_predictions=False)
    path = tmp_path / "predictions.jsonl"
    assert writer.path == path and writer.records_written == 10
    records = _read(path)
    assert [r["index"] for r in records] == list(range(10))
    assert records[3] == {"index": 3, "probs": [pytest.approx(0.03), pytest.approx(0.97)], "name": "row3", "batch": 0}
    assert records[9]["batch"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["predictions.jsonl"]  # no temporary file left


def test_existing_file_is_refused_before_predicting_unless_overwrite(tmp_path):
    path = tmp_path / "out" / "preds.jsonl"
    path.parent.mkdir()
    path.write_text("keep me\n")
    model = _Scores()
    with pytest.raises(FileExistsError, match=r"preds\.jsonl.*overwrite=True"):
        _trainer(tmp_path, PredictionWriter(str(path))).predict(model, _loader(), return_predictions=False)
    assert model.calls == 0 and path.read_text() == "keep me\n"
    _trainer(tmp_path, PredictionWriter(str(path), overwrite=True)).predict(model, _loader(), return_predictions=False)
    assert len(_read(path)) == 10


def test_a_failed_run_leaves_no_file_and_no_temporary(tmp_path):
    path = tmp_path / "preds.jsonl"
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, PredictionWriter(str(path))).predict(_Scores(fail_at=1), _loader(), return_predictions=False)
    assert list(tmp_path.iterdir()) == []


def test_non_finite_numbers_become_null(tmp_path):
    path = tmp_path / "preds.jsonl"
    _trainer(tmp_path, PredictionWriter(str(path))).predict(_Scores(nan=True), _loader(4), return_predictions=False)
    first = json.loads(path.read_text().splitlines()[0])  # strict JSON: no NaN literal in the file
    assert first["probs"][0] is None and "NaN" not in path.read_text()
