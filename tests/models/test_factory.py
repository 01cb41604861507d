"""LayerFactory: which layers become TT, which stay dense, and the names it records."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera_lightning.models import LayerConfig, LayerFactory
from comera_lightning.nn import TTEmbedding, TTLinear


def test_defaults_build_tt_for_large_layers_and_dense_for_small():
    f = LayerFactory(LayerConfig(rank=5, embedding_rank=6, rank_threshold=0.05))
    big = f.linear("big", 64, 96)
    small = f.linear("small", 64, 10)
    table = f.embedding("table", 100, 8, padding_idx=0)
    tiny_table = f.embedding("tiny_table", 10, 128)
    assert isinstance(big, TTLinear) and big.ranks[3] == 5 and big.rank_threshold == 0.05
    assert type(small) is nn.Linear and (small.in_features, small.out_features) == (64, 10)
    # rows decide for tables: a narrow table with many rows is TT, a wide table with few rows is dense
    assert isinstance(table, TTEmbedding) and table.padding_idx == 0 and max(table.ranks) <= 6
    assert type(tiny_table) is nn.Embedding
    assert f.layers == {"big": "tt", "small": "dense", "table": "tt", "tiny_table": "dense"}


def test_switches_off_give_dense_layers_with_the_same_interface():
    f = LayerFactory(LayerConfig(tt_linears=False, tt_embeddings=False))
    lin = f.linear("a", 128, 128, bias=False, in_modes=[8, 16], out_modes=[16, 8])
    emb = f.embedding("b", 500, 64, padding_idx=3, vocab_modes=[25, 20], dim_modes=[8, 8], deduplicate=True)
    assert type(lin) is nn.Linear and lin.bias is None
    assert type(emb) is nn.Embedding and emb.padding_idx == 3
    assert set(f.layers.values()) == {"dense"}


def test_linears_and_embeddings_switch_independently():
    f = LayerFactory(LayerConfig(tt_linears=False, tt_embeddings=True))
    assert type(f.linear("l", 128, 128)) is nn.Linear
    assert isinstance(f.embedding("e", 128, 128), TTEmbedding)
    f = LayerFactory(LayerConfig(tt_linears=True, tt_embeddings=False))
    assert isinstance(f.linear("l", 128, 128), TTLinear)
    assert type(f.embedding("e", 128, 128)) is nn.Embedding


def test_dense_layers_regex_is_searched_in_the_name():
    f = LayerFactory(LayerConfig(dense_layers=r"attention\.(query|key)$|^head"))
    kinds = {
        name: f.linear(name, 64, 64)
        for name in [
            "layers.0.attention.query",
            "layers.0.attention.key",
            "layers.0.attention.value",
            "head.dense",
            "x.head",
        ]
    }
    assert {n for n, m in kinds.items() if type(m) is nn.Linear} == {
        "layers.0.attention.query",
        "layers.0.attention.key",
        "head.dense",
    }
    assert f.forced_dense("head") and not f.forced_dense("x.head")


def test_explicit_modes_and_tt_kwargs_reach_the_tt_layer():
    f = LayerFactory(LayerConfig(rank=3))
    lin = f.linear("l", 96, 64, in_modes=[4, 24], out_modes=[8, 8])
    emb = f.embedding("e", 1000, 16, vocab_modes=[10, 10, 10], dim_modes=[4, 2, 2], deduplicate=True)
    assert lin.in_modes == [4, 24] and lin.out_modes == [8, 8]
    assert emb.vocab_modes == [10, 10, 10] and emb.dim_modes == [4, 2, 2] and emb.deduplicate


def test_min_embedding_rows_separates_tables_from_linears():
    f = LayerFactory(LayerConfig(min_features=64, min_embedding_rows=1000))
    assert type(f.embedding("small", 999, 16)) is nn.Embedding
    assert isinstance(f.embedding("large", 1000, 16), TTEmbedding)
    assert isinstance(f.linear("l", 64, 64), TTLinear)


def test_bad_arguments_and_reused_names_fail_loudly():
    with pytest.raises(ValueError, match="regular expression"):
        LayerConfig(dense_layers="(")
    with pytest.raises(ValueError, match=r"layer_config.min_features must be >= 1, got 0"):
        LayerConfig(min_features=0)
    with pytest.raises(ValueError, match=r"layer_ranks\['lm_head'\] must be a rank >= 1"):
        LayerConfig(layer_ranks={"lm_head": 0})
    with pytest.raises(ValueError, match="regular expression"):
        LayerConfig(layer_ranks={"(": 8})
    with pytest.raises(ValueError, match=r"unknown layer_config option\(s\) \['rnak'\]"):
        LayerFactory({"rnak": 4})
    with pytest.raises(TypeError, match="LayerConfig or a mapping"):
        LayerFactory(4)
    f = LayerFactory()
    f.linear("a", 8, 8)
    with pytest.raises(ValueError, match="was already used; names must be the modules' qualified names"):
        f.embedding("a", 8, 8)
    with pytest.raises(ValueError, match=r"every layer needs its qualified name \(got an empty name\)"):
        f.linear("", 8, 8)


def test_layer_ranks_give_single_layers_their_own_rank_first_match_wins():
    f = LayerFactory({"rank": 4, "embedding_rank": 5, "layer_ranks": {"lm_head": 12, "head|embed": 7}})
    head, block, embed = f.linear("lm_head", 64, 256), f.linear("layers.0.fc1", 64, 64), f.embedding("embed", 256, 64)
    assert max(head.ranks) == 12 and max(block.ranks) == 4 and max(embed.ranks) == 7
    assert f.rank_of("x.head", 3) == 7 and f.rank_of("other", 3) == 3


def test_a_mapping_and_a_config_build_the_same_layers_and_round_trip():
    config = LayerConfig(rank=6, dense_layers="b", layer_ranks={"a": 9})
    assert LayerConfig.of(config.to_dict()) == config and LayerConfig.of(config) is config
    assert LayerConfig.of(None) == LayerConfig()
    from_dict, from_config = LayerFactory(config.to_dict()), LayerFactory(config)
    assert from_dict.linear("a", 64, 64).ranks == from_config.linear("a", 64, 64).ranks
    assert type(from_dict.linear("b", 64, 64)) is type(from_config.linear("b", 64, 64)) is nn.Linear


def test_low_rank_linears_are_a_gated_product_of_two_factors_in_float64():
    f = LayerFactory({"rank": 6, "min_features": 8, "low_rank_linears": "head$", "layer_ranks": {"head": 5}})
    head, block = f.linear("lm_head", 24, 40, bias=False), f.linear("fc", 64, 64)
    assert (head.in_modes, head.out_modes, head.ranks) == ([24], [40], [1, 5, 1])
    assert len(block.in_modes) > 1  # the others keep their tensor modes
    head = head.double()
    with torch.no_grad():
        head.gates[0].uniform_(0.5, 1.5)  # the gate scales the bond: W = A diag(g) B
    a, b = head.cores[0][0], head.cores[1][..., 0]  # (24, 5), (5, 40)
    x = torch.randn(3, 24, dtype=torch.float64, requires_grad=True)
    expected = x @ (a * head.gates[0]) @ b
    torch.testing.assert_close(head(x), expected)
    grad = torch.randn(3, 40, dtype=torch.float64)
    (dx,) = torch.autograd.grad(head(x), x, grad)
    (dx_ref,) = torch.autograd.grad(expected, x, grad)
    torch.testing.assert_close(dx, dx_ref)
    with pytest.raises(
        ValueError, match=r"matches low_rank_linears but its model gives it modes .*: leave it out of low_rank_linears"
    ):
        f.linear("x.head", 64, 64, in_modes=[8, 8], out_modes=[8, 8])


def test_low_rank_embeddings_are_a_gated_product_of_two_factors_in_float64():
    f = LayerFactory({"embedding_rank": 4, "min_features": 8, "low_rank_embeddings": "word"})
    table, other = f.embedding("word_embeddings", 50, 12), f.embedding("position_embeddings", 64, 16)
    assert (table.vocab_modes, table.dim_modes, table.ranks) == ([50, 1], [1, 12], [1, 4, 1])
    assert len(other.vocab_modes) > 1  # the others keep their tensor modes
    table = table.double()
    with torch.no_grad():
        table.gates[0].uniform_(0.5, 1.5)
    a, b = table.cores[0][0, :, 0, :], table.cores[1][:, 0, :, 0]  # (50, 4), (4, 12)
    ids = torch.tensor([[0, 7, 49], [3, 3, 12]])
    expected = ((a * table.gates[0]) @ b)[ids]
    torch.testing.assert_close(table(ids), expected)
    grad = torch.randn(2, 3, 12, dtype=torch.float64)
    (da,) = torch.autograd.grad(table(ids), table.cores[0], grad)
    (da_ref,) = torch.autograd.grad(((table.cores[0][0, :, 0, :] * table.gates[0]) @ b)[ids], table.cores[0], grad)
    torch.testing.assert_close(da, da_ref)
    with pytest.raises(
        ValueError,
        match=r"matches low_rank_embeddings but its model gives it modes .*: leave it out of low_rank_embeddings",
    ):
        f.embedding("x.word", 64, 16, vocab_modes=[8, 8], dim_modes=[4, 4])
    with pytest.raises(ValueError, match=r"layer_config.low_rank_embeddings is not a valid regular expression"):
        LayerConfig(low_rank_embeddings="(")


def test_cola_layers_are_a_low_rank_product_with_silu_between_the_factors_in_float64():
    f = LayerFactory(
        {
            "rank": 5,
            "min_features": 8,
            "low_rank_linears": ".",
            "bottleneck_activation": "silu",
            "activation_layers": r"(^|\.)layers\.",
            "learn_gates": False,
        }
    )
    block, head = f.linear("layers.0.fc1", 24, 40), f.linear("lm_head", 24, 40, bias=False)
    assert (block.bottleneck_activation, head.bottleneck_activation) == ("silu", None)
    assert block.ranks == [1, 5, 1] and not any(g.requires_grad for g in block.gates)
    block = block.double()
    a, b = block.cores[0][0], block.cores[1][..., 0]  # (24, 5), (5, 40); frozen gates are 1
    x = torch.randn(3, 24, dtype=torch.float64, requires_grad=True)
    expected = torch.nn.functional.silu(x @ a) @ b + block.bias
    torch.testing.assert_close(block(x), expected)
    grad = torch.randn(3, 40, dtype=torch.float64)
    for got, ref in zip(
        torch.autograd.grad(block(x), [x, block.cores[0]], grad),
        torch.autograd.grad(expected, [x, block.cores[0]], grad),
        strict=True,
    ):
        torch.testing.assert_close(got, ref)


def test_a_list_in_layer_ranks_fixes_every_internal_rank_and_frozen_gates_stay_at_one():
    f = LayerFactory(
        {"rank": 8, "min_features": 8, "learn_gates": False, "layer_ranks": {r"(^|\.)fc$": [3, 5, 2], "embed": [4, 3]}}
    )
    fc = f.linear("block.fc", 64, 64, in_modes=[4, 4, 4], out_modes=[64])
    embed = f.embedding("embed", 64, 16, vocab_modes=[8, 8, 1], dim_modes=[2, 2, 4])
    assert fc.ranks == [1, 3, 5, 2, 1] and embed.ranks == [1, 4, 3, 1]
    assert all(not g.requires_grad and bool((g == 1).all()) for layer in (fc, embed) for g in layer.gates)
    assert LayerFactory({"rank": 8}).linear("fc", 64, 64).gates[0].requires_grad


def test_bad_layer_kind_options_name_the_fix():
    with pytest.raises(ValueError, match="bottleneck_activation must be null or one of"):
        LayerConfig(bottleneck_activation="softmax")
    with pytest.raises(ValueError, match="activation_layers picks the layers for bottleneck_activation"):
        LayerConfig(activation_layers="layers")
    with pytest.raises(ValueError, match=r"layer_ranks\['fc'\] must be a rank >= 1 or a non-empty list"):
        LayerConfig(layer_ranks={"fc": [3, 0]})
    with pytest.raises(ValueError, match="must be a rank >= 1 or a non-empty list"):
        LayerConfig(layer_ranks={"fc": []})
