"""predict_step of MaskedLM, SequenceClassification and ClickThrough called directly (no Trainer, no datamodule)."""

from __future__ import annotations

import pytest
import torch

from comera_lightning.lit import ClickThrough, MaskedLM, SequenceClassification

ENCODER = dict(
    d_model=32,
    num_heads=2,
    d_ff=48,
    num_layers=1,
    max_len=16,
    layer_config=dict(rank=4, embedding_rank=4, min_features=16),
)


def test_masked_lm_returns_top_k_per_masked_position():
    torch.manual_seed(0)
    task = MaskedLM(vocab_size=60, predict_top_k=4, **ENCODER).eval()
    ids = torch.randint(5, 60, (3, 10))
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[2, 7], labels[2, 9] = 11, 12, 13
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
        "index": torch.tensor([40, 41, 42]),
    }
    with torch.no_grad():
        out = task.predict_step(batch, 0)
    assert list(out) == ["index", "position", "input_id", "true_id", "top_ids", "top_probs"]  # no tokenizer here
    assert out["index"].tolist() == [40, 42, 42] and out["position"].tolist() == [2, 7, 9]
    assert out["true_id"].tolist() == [11, 12, 13] and out["input_id"].tolist() == ids[[0, 2, 2], [2, 7, 9]].tolist()
    assert out["top_ids"].shape == out["top_probs"].shape == (3, 4) and out["top_probs"].dtype == torch.float32
    assert (out["top_probs"].diff(dim=1) <= 0).all() and (out["top_probs"].sum(1) <= 1 + 1e-6).all()
    # the probabilities are the softmax of the model's logits at those positions
    with torch.no_grad():
        logits = task.model.head(task.model.encoder(ids, batch["attention_mask"]))[[0, 2, 2], [2, 7, 9]]
    top = logits.float().softmax(-1).topk(4)
    assert torch.equal(out["top_ids"], top.indices) and torch.allclose(out["top_probs"], top.values)
    # without an index, rows within the batch; k larger than the vocabulary is clamped
    wide = MaskedLM(vocab_size=60, predict_top_k=100, **ENCODER).eval()
    with torch.no_grad():
        out = wide.predict_step({k: v for k, v in batch.items() if k != "index"}, 0)
    assert out["index"].tolist() == [0, 2, 2] and out["top_ids"].shape == (3, 60)


def test_masked_lm_without_labels_or_mask_token_fails_clearly():
    task = MaskedLM(vocab_size=60, **ENCODER)
    with pytest.raises(
        ValueError, match=r"needs batches with labels .*or a datamodule whose tokenizer has a \[MASK\] token"
    ):
        task.predict_step({"input_ids": torch.randint(5, 60, (2, 8))}, 0)
    with pytest.raises(ValueError, match="predict_top_k must be >= 1, got 0"):
        MaskedLM(vocab_size=60, predict_top_k=0, **ENCODER)
    assert "predict_top_k" not in task.hparams  # an inference option, not a saved hyperparameter


def test_sequence_classification_predicts_unlabelled_examples():
    torch.manual_seed(0)
    task = SequenceClassification(vocab_size=60, num_classes=3, **ENCODER).eval()
    ids = torch.randint(5, 60, (4, 12))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "labels": torch.tensor([0, 2, -1, -1]),
        "index": torch.arange(4),
    }
    with torch.no_grad():
        out = task.predict_step(batch, 0)
        logits = task(batch)
    assert list(out) == ["index", "label", "predicted", "probabilities"]
    assert out["label"].tolist() == [0, 2, -1, -1]
    assert torch.allclose(out["probabilities"], logits.float().softmax(-1))
    assert torch.equal(out["predicted"], logits.argmax(-1))


def test_click_through_returns_click_probabilities():
    torch.manual_seed(0)
    sizes = [20] * 26
    task = ClickThrough(
        table_sizes=sizes,
        bottom_mlp=[16, 8],
        top_mlp=[16],
        embedding_dim=8,
        layer_config=dict(rank=2, embedding_rank=2, min_features=8, min_embedding_rows=10),
    ).eval()
    batch = {
        "dense": torch.rand(5, 13),
        "sparse": torch.randint(0, 20, (5, 26)),
        "labels": torch.tensor([0.0, 1, 0, 0, 1]),
    }
    with torch.no_grad():
        out = task.predict_step(batch, 0)
        logits = task(batch)
    assert list(out) == ["label", "click_probability"]
    assert out["label"].tolist() == [0, 1, 0, 0, 1] and out["label"].dtype == torch.long
    assert torch.allclose(out["click_probability"], torch.sigmoid(logits.float()))
