"""build_tt_layer(): the one builder behind tensorize(), LayerFactory and the export's loader."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from comera_lightning.nn import TTEmbedding, TTLayerOptions, TTLinear, build_tt_layer, layer_shape


def _same_cores(a: nn.Module, b: nn.Module) -> None:
    assert [tuple(c.shape) for c in a.cores] == [tuple(c.shape) for c in b.cores]
    for x, y in zip(a.cores, b.cores, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_defaults_build_the_layers_the_constructors_build():
    torch.manual_seed(0)
    linear, error = build_tt_layer("linear", (48, 64), TTLayerOptions(rank=5))
    torch.manual_seed(0)
    _same_cores(linear, TTLinear(48, 64, 5))
    assert error is None and linear.bias is not None and linear.rank_threshold == 0.01
    torch.manual_seed(0)
    embedding, _ = build_tt_layer("embedding", (100, 32), TTLayerOptions(rank=5, embedding_rank=7), padding_idx=0)
    torch.manual_seed(0)
    _same_cores(embedding, TTEmbedding(100, 32, 7, padding_idx=0))
    assert embedding.padding_idx == 0


def test_options_reach_the_layer():
    options = TTLayerOptions(
        rank=3, rank_threshold=0.05, low_rank=True, bottleneck_activation="silu", learn_gates=False
    )
    linear, _ = build_tt_layer("linear", (16, 24), options, init_std=0.1)
    assert (linear.in_modes, linear.out_modes, linear.ranks) == ([16], [24], [1, 3, 1])
    assert linear.bottleneck_activation == "silu" and linear.rank_threshold == 0.05
    assert not any(g.requires_grad for g in linear.gates)
    # an embedding has no bottleneck activation: the option is for linears only
    embedding, _ = build_tt_layer("embedding", (50, 8), options)
    assert (embedding.vocab_modes, embedding.dim_modes, embedding.ranks) == ([50, 1], [1, 8], [1, 3, 1])
    mup, _ = build_tt_layer("linear", (64, 64), TTLayerOptions(rank=4, parameterization="mup"))
    assert mup.parameterization == "mup"
    # a layer argument takes precedence over the options
    plain, _ = build_tt_layer("linear", (16, 24), options, bottleneck_activation=None)
    assert plain.bottleneck_activation is None


def test_explicit_modes_and_their_conflict_with_low_rank():
    layer, _ = build_tt_layer("linear", (48, 64), TTLayerOptions(rank=4), modes=([6, 8], [8, 8]))
    assert (layer.in_modes, layer.out_modes) == ([6, 8], [8, 8])
    with pytest.raises(ValueError, match=r"low_rank sets one mode per side, but modes \[6, 8\] x \[8, 8\]"):
        build_tt_layer("linear", (48, 64), TTLayerOptions(rank=4, low_rank=True), modes=([6, 8], [8, 8]))
    with pytest.raises(ValueError, match="kind must be 'linear' or 'embedding', got 'conv'"):
        build_tt_layer("conv", (4, 4), TTLayerOptions())  # type: ignore[arg-type]


def test_from_a_dense_module_by_tt_svd():
    dense = nn.Linear(16, 24).double()
    layer, error = build_tt_layer("linear", (16, 24), TTLayerOptions(rank=100), dense=dense)
    assert error is not None and error < 1e-10 and layer.cores[0].dtype == torch.float64
    torch.testing.assert_close(layer.weight_dense(), dense.weight)
    table = nn.Embedding(100, 32, padding_idx=2)
    embedding, error = build_tt_layer("embedding", (100, 32), TTLayerOptions(rank=2), dense=table)
    assert embedding.padding_idx == 2 and error is not None and 0 < error < 1
    with pytest.raises(ValueError, match=r"dense must be an nn.Linear of shape \(24, 16\)"):
        build_tt_layer("linear", (24, 16), TTLayerOptions(rank=2), dense=dense)
    with pytest.raises(ValueError, match=r"dense must be an nn.Embedding of shape \(36, 8\)"):
        build_tt_layer("embedding", (36, 8), TTLayerOptions(rank=2), dense=dense)


def test_from_a_dense_module_with_the_models_modes_and_the_options():
    torch.manual_seed(0)
    options = TTLayerOptions(rank=100, rank_threshold=0.05, parameterization="mup")
    dense = nn.Linear(48, 64).double()
    layer, error = build_tt_layer("linear", (48, 64), options, modes=([4, 12], [2, 32]), dense=dense)
    assert (layer.in_modes, layer.out_modes) == ([4, 12], [2, 32])  # not the balanced [8, 6] x [8, 8]
    assert (layer.rank_threshold, layer.parameterization) == (0.05, "mup")
    assert error is not None and error < 1e-10
    torch.testing.assert_close(layer.weight_dense(), dense.weight, rtol=1e-10, atol=1e-12)
    table = nn.Embedding(60, 12, dtype=torch.float64)
    embedding, error = build_tt_layer(
        "embedding", (60, 12), options, modes=([3, 4, 5], [2, 3, 2]), dense=table, deduplicate=True
    )
    assert (embedding.vocab_modes, embedding.dim_modes) == ([3, 4, 5], [2, 3, 2])  # not [10, 6] x [4, 3]
    assert (embedding.rank_threshold, embedding.parameterization, embedding.deduplicate) == (0.05, "mup", True)
    assert error is not None and error < 1e-10
    ids = torch.tensor([0, 7, 59])
    torch.testing.assert_close(embedding(ids), table.weight[ids], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "layer",
    [TTLinear(48, 64, 3, in_modes=[6, 8], out_modes=[4, 16]), TTEmbedding(100, 32, 4)],
    ids=["linear", "embedding"],
)
def test_layer_shape_builds_the_same_structure_again(layer):
    kind, shape, modes = layer_shape(layer)
    again, _ = build_tt_layer(kind, shape, TTLayerOptions(rank=layer.ranks[1:-1]), modes=modes)
    assert type(again) is type(layer) and layer_shape(again) == layer_shape(layer) and again.ranks == layer.ranks


@pytest.mark.parametrize(
    ("kind", "dense", "clash"),
    [
        ("linear", nn.Linear(8, 6), {"bias": False}),
        ("linear", nn.Linear(8, 6), {"dtype": torch.float64, "device": "cpu"}),
        ("embedding", nn.Embedding(8, 6), {"padding_idx": 0}),
    ],
)
def test_arguments_the_dense_module_fixes_are_refused_with_it(kind, dense, clash):
    shape = (8, 6)
    names = ", ".join(sorted(clash))
    message = f"dense= fixes {names} (taken from the dense module); drop {names}, or set them on the dense module"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build_tt_layer(kind, shape, TTLayerOptions(rank=2), dense=dense, **clash)


@pytest.mark.parametrize("clash", [{"bias": False}, {"dtype": torch.float64, "padding_idx": 0}, {"device": "cpu"}])
@pytest.mark.parametrize("decompose", [False, True])
def test_tensorize_refuses_layer_kwargs_that_the_replaced_module_fixes(clash, decompose):
    from comera_lightning.nn import tensorize

    model = nn.Sequential(nn.Linear(16, 32), nn.Embedding(20, 16))
    before = [p.clone() for p in model.parameters()]
    names = ", ".join(sorted(clash))
    message = f"layer_kwargs may not set {names}: each TT layer takes them from the module it replaces; set them"
    with pytest.raises(ValueError, match=f"^{re.escape(message)} on the model before tensorizing it"):
        tensorize(model, rank=2, min_features=16, decompose=decompose, **clash)
    assert isinstance(model[0], nn.Linear) and all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )
