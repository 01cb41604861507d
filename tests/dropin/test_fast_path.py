"""torch's TransformerEncoderLayer / TransformerEncoder fast path reads ``linear1.weight``: tensorize() keeps a
tensorised block off that path (without a dense weight), and untensorize() puts it back on."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from comera_lightning.nn import TTLinear, tensorize, untensorize
from comera_lightning.nn.fast_path import restore_fast_paths, steer_off_fast_paths


def _encoder(batch_first: bool = True) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).double()


@pytest.mark.parametrize("context", ["grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("padding_mask", [False, True])
def test_tensorized_encoder_runs_in_eval(context, padding_mask):
    model = _encoder()
    tensorize(model, rank=64, min_features=32)  # full rank: the same function as the dense weights
    assert isinstance(model.layers[0].linear1, TTLinear)
    dense = copy.deepcopy(model)
    untensorize(dense)
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]]) if padding_mask else None
    model.eval(), dense.eval()
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[context]
    with ctx():
        out = model(x, src_key_padding_mask=mask)
        ref = dense(x, src_key_padding_mask=mask)
    if mask is not None:  # the dense model's nested fast path returns zeros at padded positions
        out, ref = out[~mask], ref[~mask]
    torch.testing.assert_close(out, ref)


def test_tensorize_steers_only_tensorized_blocks_and_untensorize_restores():
    model = _encoder()
    layer = model.layers[0]
    assert layer.activation_relu_or_gelu == 1 and model.use_nested_tensor
    tensorize(model, rank=8, min_features=32)
    assert all(m.activation_relu_or_gelu == 0 for m in model.layers) and model.use_nested_tensor is False
    untensorize(model)
    assert all(m.activation_relu_or_gelu == 1 for m in model.layers) and model.use_nested_tensor


def test_steering_names_the_tensorized_modules_and_leaves_dense_ones_on_the_fast_path():
    model = nn.ModuleDict({"tt": _encoder(), "dense": _encoder()})
    tensorize(model["tt"], rank=8, min_features=32)
    # again, over the whole model: the modules already switched off are named again, the dense encoder is not
    assert steer_off_fast_paths(model) == ["tt", "tt.layers.0", "tt.layers.1"]
    dense, tt = model["dense"], model["tt"]
    assert dense.use_nested_tensor is True and [m.activation_relu_or_gelu for m in dense.layers] == [1, 1]
    assert tt.use_nested_tensor is False and [m.activation_relu_or_gelu for m in tt.layers] == [0, 0]
    untensorize(tt)  # the values torch chose, kept through the second steer
    assert tt.use_nested_tensor is True and [m.activation_relu_or_gelu for m in tt.layers] == [1, 1]


def test_restoring_while_blocks_are_still_tensorized_keeps_them_off_the_fast_path():
    model = _encoder()
    tensorize(model, rank=8, min_features=32)
    restore_fast_paths(model)  # no dense weight is back: nothing to restore
    assert model.use_nested_tensor is False and [m.activation_relu_or_gelu for m in model.layers] == [0, 0]
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(2, 5, 32, dtype=torch.float64), src_key_padding_mask=mask)
    assert out.shape == (2, 5, 32) and bool(torch.isfinite(out).all())


def test_an_encoder_without_the_nested_switch_is_restored_without_nested_packing():
    model = _encoder()
    del model.use_nested_tensor  # as from a pickle of a torch whose encoder had no such switch
    tensorize(model, rank=8, min_features=32)
    assert model.use_nested_tensor is False
    untensorize(model)
    assert model.use_nested_tensor is False and [m.activation_relu_or_gelu for m in model.layers] == [1, 1]
