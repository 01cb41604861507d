"""`comera test` and `comera predict` through the real entry point, at tiny sizes: test/ metrics in MLflow,
predictions written by PredictionWriter, one JSON record per example."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch
from helpers.cli import CONFIGS, TINY_TRAINER, _tiny_overrides
from mlflow.tracking import MlflowClient

import comera_lightning
from comera_lightning.cli import EXPERIMENT, main
from comera_lightning.data import MNLI_LABELS, CodeMLMDataModule

#: the shipped configs (in a checkout, or installed with the package)
CONFIG_DIR = CONFIGS if (CONFIGS / "quickstart.yaml").is_file() else Path(comera_lightning.__file__).parent / "configs"


def _latest_metrics() -> dict[str, float]:
    """Metrics of the most recently started MLflow run of the comera experiment."""
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
    return dict(runs[0].data.metrics)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _writer(path: Path) -> list[str]:
    return ["--trainer.callbacks+=PredictionWriter", f"--trainer.callbacks.output_path={path}"]


@pytest.mark.slow
def test_masked_lm_test_and_predict_after_fit(workdir):
    config = f"--config={CONFIG_DIR / 'quickstart.yaml'}"
    overrides = [*_tiny_overrides("quickstart.yaml", workdir / "mnli"), *TINY_TRAINER]
    main(["fit", config, *overrides, "--trainer.max_steps=2"])
    checkpoint = next((workdir / "runs").rglob("last.ckpt"))

    main(["test", config, *overrides, f"--ckpt_path={checkpoint}"])
    metrics = _latest_metrics()
    assert {"test/loss", "test/mlm_accuracy", "test/perplexity"} <= set(metrics)
    assert not any(key.startswith("val/") for key in metrics), "test logged validation names"
    assert 0.0 <= metrics["test/mlm_accuracy"] <= 1.0
    assert metrics["test/perplexity"] == pytest.approx(float(torch.exp(torch.tensor(metrics["test/loss"]))), rel=1e-4)

    out = workdir / "preds" / "mlm.jsonl"
    main(["predict", config, *overrides, f"--ckpt_path={checkpoint}", "--model.predict_top_k=3", *_writer(out)])
    records = _records(out)
    assert records and set(records[0]) == {
        "index",
        "position",
        "input_id",
        "true_id",
        "top_ids",
        "top_probs",
        "true_token",
        "top_tokens",
    }
    # one record per masked position of the (deterministically masked) validation rows, with the true ids
    dm = CodeMLMDataModule(
        max_files=15,
        max_sequences=400,
        val_fraction=0.2,
        vocab_size=512,
        seq_len=16,
        batch_size=8,
        cache_dir=str(workdir / ".cache" / "comera"),
    )
    expected = {}
    for batch in dm.predict_dataloader():
        for row, pos in (batch["labels"] != -100).nonzero().tolist():
            expected[(int(batch["index"][row]), pos)] = int(batch["labels"][row, pos])
    assert {(r["index"], r["position"]): r["true_id"] for r in records} == expected
    for record in records:
        assert len(record["top_ids"]) == len(record["top_probs"]) == len(record["top_tokens"]) == 3
        assert record["top_probs"] == sorted(record["top_probs"], reverse=True)
        assert record["top_probs"][-1] >= 0.0 and sum(record["top_probs"]) <= 1.0 + 1e-5
        assert isinstance(record["true_token"], str) and all(isinstance(t, str) for t in record["top_tokens"])
    assert records[0]["true_token"] == dm.tokenizer.decode([records[0]["true_id"]], skip_special_tokens=False)


@pytest.mark.slow
def test_click_through_test_and_predict_on_a_held_out_slice(workdir):
    config = f"--config={CONFIG_DIR / 'dlrm_criteo.yaml'}"
    overrides = [*_tiny_overrides("dlrm_criteo.yaml", workdir), *TINY_TRAINER, "--data.test_fraction=0.1"]
    main(["test", config, *overrides])
    metrics = _latest_metrics()
    assert {"test/auc", "test/logloss"} <= set(metrics) and not any(k.startswith("val/") for k in metrics)

    out = workdir / "ctr.jsonl"
    main(["predict", config, *overrides, *_writer(out)])
    records = _records(out)
    assert [r["index"] for r in records] == list(range(200))  # the last 10% of 2000 synthetic rows
    assert all(set(r) == {"index", "label", "click_probability"} for r in records)
    assert all(r["label"] in (0, 1) and 0.0 < r["click_probability"] < 1.0 for r in records)
    # the file exists now: a second run refuses to overwrite it, naming the option
    with pytest.raises(FileExistsError, match="overwrite=True"):
        main(["predict", config, *overrides, *_writer(out)])
    main(["predict", config, *overrides, *_writer(out), "--trainer.callbacks.overwrite=true"])
    assert len(_records(out)) == 200


@pytest.mark.slow
def test_sequence_classification_test_and_predict_on_mnli_mismatched(workdir):
    config = f"--config={CONFIG_DIR / 'mnli_6enc.yaml'}"
    overrides = [*_tiny_overrides("mnli_6enc.yaml", workdir / "mnli"), *TINY_TRAINER]
    main(["test", config, *overrides])
    metrics = _latest_metrics()
    assert {"test/loss", "test/accuracy"} <= set(metrics) and not any(k.startswith("val/") for k in metrics)

    out = workdir / "mnli.jsonl"
    main(["predict", config, *overrides, *_writer(out)])
    records = _records(out)
    with open(workdir / "mnli" / "dev_mismatched.tsv", newline="") as fh:
        labels = [MNLI_LABELS[row["gold_label"]] for row in csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)]
    assert [r["index"] for r in records] == list(range(64))  # validation_mismatched: held out from validation
    assert [r["label"] for r in records] == labels
    names = ["entailment", "neutral", "contradiction"]
    for record in records:
        assert set(record) == {"index", "label", "predicted", "probabilities", "predicted_name"}
        assert len(record["probabilities"]) == 3 and sum(record["probabilities"]) == pytest.approx(1.0, abs=1e-5)
        assert record["predicted"] == max(range(3), key=record["probabilities"].__getitem__)
        assert record["predicted_name"] == names[record["predicted"]]
