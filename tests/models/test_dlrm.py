"""DLRM with TT tables: shapes, which tables are TT (and deduplicated), the dot interaction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera_lightning.models import DLRM
from comera_lightning.nn import TTEmbedding, TTLinear

# 26 Criteo-like tables: a few large ones (TT), the rest small (dense)
TABLES = [5000, 3, 1200, 10, 7, 2048] + [4 + t for t in range(20)]
SMALL = dict(
    table_sizes=TABLES,
    embedding_dim=8,
    bottom_mlp=[64, 8],
    top_mlp=[64, 32],
    layer_config=dict(rank=4, embedding_rank=4),
)


def _batch(model, batch=6):
    dense = torch.randn(batch, 13)
    sparse = torch.stack([torch.randint(0, rows, (batch,)) for rows in model.table_sizes], dim=1)
    sparse[1] = sparse[0]  # repeated ids: what deduplication is for
    return dense, sparse


def test_output_shape_and_layer_choice():
    model = DLRM(**SMALL)
    dense, sparse = _batch(model)
    assert model(dense, sparse).shape == (6,)
    tt_tables = {t for t, table in enumerate(model.embeddings) if isinstance(table, TTEmbedding)}
    assert tt_tables == {0, 2, 5}  # >= min_embedding_rows (1000) rows
    assert all(model.embeddings[t].deduplicate for t in tt_tables)
    assert all(type(model.embeddings[t]) is nn.Embedding for t in set(range(26)) - tt_tables)
    # linears: 13 -> 64 and 64 -> 8 are too small; 359 -> 64 is TT; 64 -> 32 is too small; -> 1 too
    assert [type(m) for m in model.bottom_mlp] == [nn.Linear, nn.Linear]
    assert [type(m) for m in model.top_mlp] == [TTLinear, nn.Linear, nn.Linear]
    assert model.layer_kinds == {
        name: "tt" if isinstance(m, (TTLinear, TTEmbedding)) else "dense"
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding, TTLinear, TTEmbedding))
    }


def test_interaction_dimension():
    model = DLRM(**SMALL)
    assert model.interaction_dim == 8 + 27 * 26 // 2 == 359
    assert model.top_mlp[0].in_features == 359
    assert DLRM(**SMALL, interaction="cat").interaction_dim == 8 * 27
    criteo = DLRM(table_sizes=[10] * 26)  # default sizes: bottom 13-512-256-16, top 367-512-256-1
    assert criteo.interaction_dim == 16 + 351 == 367
    assert [m.out_features for m in criteo.top_mlp] == [512, 256, 1]


def test_dot_interaction_matches_a_loop():
    model = DLRM(**SMALL)
    bottom = torch.randn(2, 8)
    embedded = [torch.randn(2, 8) for _ in TABLES]
    z = model._interact(bottom, embedded)
    vectors = [bottom, *embedded]
    expected = [bottom] + [
        torch.stack([(vectors[i][b] * vectors[j][b]).sum() for b in range(2)])[:, None]
        for i in range(27)
        for j in range(i + 1, 27)
    ]
    torch.testing.assert_close(z, torch.cat(expected, dim=1))


def test_dense_twin_and_dense_layers():
    dense = DLRM(**dict(SMALL, layer_config=dict(rank=4, tt_linears=False, tt_embeddings=False)))
    assert set(dense.layer_kinds.values()) == {"dense"}
    partial = DLRM(**dict(SMALL, layer_config=dict(rank=4, embedding_rank=4, dense_layers=r"^embeddings\.0$")))
    assert type(partial.embeddings[0]) is nn.Embedding and isinstance(partial.embeddings[2], TTEmbedding)
    d, s = _batch(dense)
    assert dense(d, s).shape == partial(d, s).shape == (6,)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_every_parameter_gets_a_finite_gradient(autocast):
    model = DLRM(**SMALL)
    dense, sparse = _batch(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(dense, sparse)
        loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), torch.ones(6))
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_bad_arguments():
    with pytest.raises(
        ValueError, match=r"the last bottom_mlp width must equal embedding_dim=16 .*got bottom_mlp=\[64, 32\]"
    ):
        DLRM(table_sizes=[10], embedding_dim=16, bottom_mlp=[64, 32])
    with pytest.raises(ValueError, match=r"interaction must be one of \('dot', 'cat'\), got 'attention'"):
        DLRM(table_sizes=[10], interaction="attention")
    model = DLRM(**SMALL)
    with pytest.raises(ValueError, match=r"sparse must be \(batch=2, 26\) ids, got shape \(2, 25\)"):
        model(torch.randn(2, 13), torch.zeros(2, 25, dtype=torch.long))
