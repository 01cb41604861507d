"""Parameter counts of the paper's six-encoder MNLI model, CoMERA (TT) against its dense twin, checked by hand.

The TT cores of one fc1, fc2, attention projection and the word embedding are counted from their modes and ranks
(a TT core k holds r_{k-1} s_k r_k parameters), per layer type the TT model against the dense one,
and the totals against ``size_report``. Construction only: a few seconds.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from comera_lightning.models import SequenceClassifier
from comera_lightning.nn import size_report

PAPER = dict(
    vocab_size=30522,
    num_classes=3,
    d_model=768,
    num_heads=12,
    d_ff=3072,
    num_layers=6,
    max_len=128,
    type_vocab_size=2,
    layer_config=dict(rank=30, embedding_rank=32),
)
# layer type -> regex on the qualified module name
LAYER_TYPES = {
    "word embedding": r"^encoder\.embeddings\.word_embeddings$",
    "position embedding": r"^encoder\.embeddings\.position_embeddings$",
    "token-type embedding": r"^encoder\.embeddings\.token_type_embeddings$",
    "attention q/k/v/out": r"^encoder\.layers\.\d+\.attention\.(query|key|value|output)$",
    "FFN fc1": r"^encoder\.layers\.\d+\.fc1$",
    "FFN fc2": r"^encoder\.layers\.\d+\.fc2$",
    "pooler": r"^pooler$",
    "classifier": r"^classifier$",
    "LayerNorms": r"norm$",
}
# (layer type, an example module, core sizes s_k, ranks); a TTM core's size is v_k * e_k
HAND = [
    ("FFN fc1", "encoder.layers.0.fc1", [12, 8, 8, 12, 16, 16], [1, 12, 30, 30, 30, 16, 1]),
    ("FFN fc2", "encoder.layers.0.fc2", [16, 16, 12, 8, 8, 12], [1, 16, 30, 30, 30, 12, 1]),
    ("attention q/k/v/out", "encoder.layers.0.attention.query", [12, 8, 8, 8, 8, 12], [1, 12, 30, 30, 30, 12, 1]),
    ("word embedding", "encoder.embeddings.word_embeddings", [16 * 4, 20 * 4, 10 * 8, 10 * 6], [1, 32, 32, 32, 1]),
]
D, FF, LAYERS, VOCAB = 768, 3072, 6, 30522
FC1 = FC2 = 28960
ATTENTION, EMBEDDING = 20448, 167808


def build(tt: bool) -> nn.Module:
    torch.manual_seed(0)
    return SequenceClassifier(**dict(PAPER, layer_config=dict(PAPER["layer_config"], tt_linears=tt, tt_embeddings=tt)))


@pytest.fixture(scope="module")
def models():
    return build(True), build(False)


def core_parameters(sizes: list[int], ranks: list[int]) -> int:
    """sum_k r_{k-1} s_k r_k, written out so the test does not trust the library's own count."""
    assert len(ranks) == len(sizes) + 1 and ranks[0] == ranks[-1] == 1
    return sum(ranks[k] * sizes[k] * ranks[k + 1] for k in range(len(sizes)))


def test_tt_core_counts_by_hand(models):
    tt_model, _ = models
    modules = dict(tt_model.named_modules())
    reported = {layer.name: layer.active_parameters for layer in size_report(tt_model).layers}
    fc1 = 1 * 12 * 12 + 12 * 8 * 30 + 30 * 8 * 30 + 30 * 12 * 30 + 30 * 16 * 16 + 16 * 16 * 1
    fc2 = 1 * 16 * 16 + 16 * 16 * 30 + 30 * 12 * 30 + 30 * 8 * 30 + 30 * 8 * 12 + 12 * 12 * 1
    attention = 1 * 12 * 12 + 12 * 8 * 30 + 30 * 8 * 30 + 30 * 8 * 30 + 30 * 8 * 12 + 12 * 12 * 1
    embedding = 1 * (16 * 4) * 32 + 32 * (20 * 4) * 32 + 32 * (10 * 8) * 32 + 32 * (10 * 6) * 1
    assert (fc1, fc2, attention, embedding) == (FC1, FC2, ATTENTION, EMBEDDING)
    for _, name, sizes, ranks in HAND:
        layer = modules[name]
        assert layer.ranks == ranks, name
        assert layer.active_parameters() == core_parameters(sizes, ranks) == reported[name], name


def test_layer_types_cover_both_models(models):
    tt_model, dense_model = models
    report = size_report(tt_model)
    tt_core = {layer.name: layer.active_parameters for layer in report.layers}
    gate_ids = {id(g) for _, m in tt_model.named_modules() for g in getattr(m, "gates", [])}
    tt_modules, dense_modules = dict(tt_model.named_modules()), dict(dense_model.named_modules())

    def tt_size(name: str) -> int:
        # the active cores (when TT) plus every other parameter of the module (bias, LayerNorm), gates excluded
        module = tt_modules[name]
        others = sum(p.numel() for p in module.parameters() if id(p) not in gate_ids)
        if name in tt_core:
            return tt_core[name] + others - sum(c.numel() for c in module.cores)
        return others

    rows = {}
    for kind, pattern in LAYER_TYPES.items():
        names = [n for n in dense_modules if n and re.search(pattern, n)]
        dense = sum(p.numel() for n in names for p in dense_modules[n].parameters())
        rows[kind] = (len(names), dense, sum(tt_size(n) for n in names))
    dense_total = sum(p.numel() for p in dense_model.parameters())
    assert sum(dense for _, dense, _ in rows.values()) == dense_total
    assert sum(tt for _, _, tt in rows.values()) == report.active_parameters
    assert report.dense_equivalent_parameters == dense_total
    assert rows["FFN fc1"][2] == LAYERS * (FC1 + FF)
    assert rows["attention q/k/v/out"][0] == 24


def test_totals_and_compression_ratio(models):
    tt_model, dense_model = models
    report = size_report(tt_model)
    dense_layer = 4 * (D * D + D) + (D * FF + FF) + (FF * D + D) + 4 * D  # 4 projections, FFN, 2 LayerNorms
    dense_total = VOCAB * D + 128 * D + 2 * D + 2 * D + LAYERS * dense_layer + (D * D + D) + (D * 3 + 3)
    assert sum(p.numel() for p in dense_model.parameters()) == dense_total == 66_662_403
    position = next(layer for layer in report.layers if layer.name.endswith("position_embeddings"))
    tt_layer = 4 * (ATTENTION + D) + (FC1 + FF) + (FC2 + D) + 4 * D
    tt_total = EMBEDDING + position.active_parameters + 2 * D + 2 * D + LAYERS * tt_layer + (ATTENTION + D)
    tt_total += D * 3 + 3
    assert report.active_parameters == tt_total
    assert report.compression_ratio == pytest.approx(dense_total / tt_total)
    assert 50 < dense_total / tt_total < 70  # about 58x at initialisation, before any rank is pruned
