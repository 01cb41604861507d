"""Parameter counts of the paper's six-encoder model against hand counts (construction only)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "param_counts.py"


@pytest.fixture(scope="module")
def counts():
    spec = importlib.util.spec_from_file_location("param_counts", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.collect()  # collect() itself asserts the model against its hand counts


def test_tt_core_counts_by_hand(counts):
    _, result = counts
    # sum_k r_{k-1} s_k r_k with the METHOD.md shapes, written out
    fc1 = 1 * 12 * 12 + 12 * 8 * 30 + 30 * 8 * 30 + 30 * 12 * 30 + 30 * 16 * 16 + 16 * 16 * 1
    fc2 = 1 * 16 * 16 + 16 * 16 * 30 + 30 * 12 * 30 + 30 * 8 * 30 + 30 * 8 * 12 + 12 * 12 * 1
    attention = 1 * 12 * 12 + 12 * 8 * 30 + 30 * 8 * 30 + 30 * 8 * 30 + 30 * 8 * 12 + 12 * 12 * 1
    embedding = 1 * (16 * 4) * 32 + 32 * (20 * 4) * 32 + 32 * (10 * 8) * 32 + 32 * (10 * 6) * 1
    assert (fc1, fc2, attention, embedding) == (28960, 28960, 20448, 167808)
    reported = {h["layer"]: h["reported"] for h in result["hand_counts"]}
    assert reported == {"FFN fc1": fc1, "FFN fc2": fc2, "attention q/k/v/out": attention, "word embedding": embedding}


def test_totals_and_compression_ratio(counts):
    _module, result = counts
    d, ff, layers, vocab = 768, 3072, 6, 30522
    dense_layer = 4 * (d * d + d) + (d * ff + ff) + (ff * d + d) + 4 * d  # 4 projections, FFN, 2 LayerNorms
    dense_total = vocab * d + 128 * d + 2 * d + 2 * d + layers * dense_layer + (d * d + d) + (d * 3 + 3)
    assert result["total"]["dense_parameters"] == dense_total == 66_662_403

    rows = {r["layer_type"]: r for r in result["layer_types"]}
    position_tt = rows["position embedding"]["tt_parameters"]  # automatic modes: checked in the script
    tt_layer = 4 * (20448 + d) + (28960 + ff) + (28960 + d) + 4 * d
    tt_total = 167808 + position_tt + 2 * d + 2 * d + layers * tt_layer + (20448 + d) + (d * 3 + 3)
    assert result["total"]["tt_parameters"] == tt_total
    ratio = dense_total / tt_total
    assert result["total"]["compression"] == pytest.approx(ratio)
    assert result["total"]["size_report_compression_ratio"] == pytest.approx(ratio)
    assert 50 < ratio < 70  # about 58x at initialisation, before any rank is pruned
    assert rows["FFN fc1"]["tt_parameters"] == layers * (28960 + ff)
    assert rows["attention q/k/v/out"]["modules"] == 24


def test_markdown_and_json_output(counts, capsys):
    module, result = counts
    text = module.to_markdown(result)
    assert "| **total** |" in text and "28,960" in text and "167,808" in text
    import json

    json.dumps(result)  # JSON-serialisable
