"""Packed dropout masks: their distribution, the masked map and its gradient, and attention with them."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comera_lightning.models import DecoderLM, SequenceClassifier
from comera_lightning.nn import dropout as packed
from comera_lightning.nn.dropout import PackedDropout, attention, dropout_layer, keep_mask, packed_dropout


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_mask_drops_the_rounded_share_and_scales_to_keep_the_mean(p):
    n = 400_003  # not a multiple of four lanes
    kept, scale = keep_mask((n,), p)
    effective = round(p * 65536) / 65536
    assert kept.dtype == torch.bool and kept.shape == (n,)
    assert scale == pytest.approx(1 / (1 - effective), rel=1e-12)
    sigma = math.sqrt(effective * (1 - effective) / n)
    assert abs((~kept).double().mean().item() - effective) < 5 * sigma


def test_keep_mask_lanes_are_independent_of_their_position_in_the_draw():
    # a lane that always came from the same 16 bits of the word (say the sign half) would show here
    kept, _ = keep_mask((4, 200_000), 0.5)
    by_lane = kept.view(-1, 4).double().mean(0)  # consecutive elements share a draw
    sigma = math.sqrt(0.25 / 200_000)
    assert (by_lane - 0.5).abs().max().item() < 5 * sigma


def test_keep_mask_is_reproduced_by_the_seed_and_rejects_bad_probabilities():
    torch.manual_seed(7)
    first, _ = keep_mask((3, 5, 7), 0.3)
    torch.manual_seed(7)
    again, _ = keep_mask((3, 5, 7), 0.3)
    assert torch.equal(first, again)
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\)"):
            keep_mask((4,), bad)


def test_packed_dropout_zeroes_the_mask_and_scales_the_rest_in_value_and_gradient():
    x = torch.randn(6, 33, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    kept, scale = keep_mask(x.shape, 0.25)
    torch.manual_seed(3)
    out = packed_dropout(x, 0.25)
    expected = torch.where(kept, x * scale, torch.zeros_like(x))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    weights = torch.randn_like(x)
    (out * weights).sum().backward()
    torch.testing.assert_close(x.grad, torch.where(kept, weights * scale, 0.0), rtol=0, atol=1e-15)
    assert torch.autograd.gradcheck(
        lambda t: packed._KeepAndScale.apply(t, kept, scale), (x.detach().requires_grad_(),)
    )


def test_packed_dropout_is_the_identity_in_eval_or_at_zero_and_unbiased_in_training():
    x = torch.randn(5, 7)
    assert packed_dropout(x, 0.3, training=False) is x
    assert packed_dropout(x, 0.0) is x
    layer = PackedDropout(0.3)
    assert layer.eval()(x) is x
    ones = torch.ones(1_000_000, dtype=torch.float64)
    mean = layer.train()(ones).mean().item()
    assert abs(mean - 1.0) < 5 * math.sqrt(0.3 / 0.7 / 1_000_000)
    assert (
        type(dropout_layer(0.1, packed=False)) is nn.Dropout and type(dropout_layer(0.1, packed=True)) is PackedDropout
    )


def test_packed_dropout_leaves_other_devices_to_torch(monkeypatch):
    def no_packing(*args, **kwargs):
        raise AssertionError("packed masks drawn off the CPU")

    monkeypatch.setattr(packed, "keep_mask", no_packing)
    out = packed_dropout(torch.empty(4, 4, device="meta"), 0.5)
    assert out.device.type == "meta"


def _qkv(batch=2, heads=3, length=9, dim=8):
    return [torch.randn(batch, heads, length, dim, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def _grads(out, tensors):
    weights = torch.randn_like(out, generator=torch.Generator().manual_seed(0))
    return torch.autograd.grad((out * weights).sum(), tensors)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_math_path_equals_sdpa_when_nothing_is_dropped(causal):
    q, k, v = _qkv()
    key_mask = None if causal else torch.tensor([[1] * 9, [1] * 5 + [0] * 4], dtype=torch.bool)[:, None, None, :]
    # p below 1/131072 rounds to no drop at all, so the packed math path must be SDPA exactly
    ours = attention(q, k, v, attn_mask=key_mask, is_causal=causal, dropout_p=1e-6, packed_masks=True)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=causal)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    for a, b in zip(_grads(ours, (q, k, v)), _grads(reference, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_attention_drops_probabilities_with_the_packed_mask():
    q, k, v = _qkv()
    torch.manual_seed(11)
    kept, scale = keep_mask((2, 3, 9, 9), 0.2)
    probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1)
    expected = torch.where(kept, probs * scale, 0.0) @ v
    torch.manual_seed(11)
    ours = attention(q, k, v, dropout_p=0.2, packed_masks=True)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    for a, b in zip(_grads(ours, (q, k, v)), _grads(expected, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_attention_row_with_every_key_masked_gives_zeros_and_both_masks_are_refused():
    q, k, v = _qkv(batch=2)
    key_mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    key_mask[0] = False
    key_mask[1, ..., 6:] = False
    out = attention(q, k, v, attn_mask=key_mask, dropout_p=0.1, packed_masks=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().sum() > 0
    assert all(torch.isfinite(g).all() for g in _grads(out, (q, k, v)))
    with pytest.raises(ValueError, match="either attn_mask or is_causal"):
        attention(q, k, v, attn_mask=key_mask, is_causal=True, dropout_p=0.1, packed_masks=True)


def test_models_use_packed_dropout_by_default_and_compute_the_torch_dropout_model_outside_training():
    torch.manual_seed(0)
    options = dict(
        vocab_size=60,
        d_model=24,
        num_heads=2,
        d_ff=40,
        num_layers=2,
        max_len=12,
        dropout=0.1,
        layer_config=dict(rank=4, embedding_rank=4, min_features=8),
    )
    packed_model = SequenceClassifier(**options).double().eval()
    torch_dropout = SequenceClassifier(**options, packed_dropout=False).double().eval()
    torch_dropout.load_state_dict(packed_model.state_dict())
    ids = torch.randint(1, options["vocab_size"], (3, 10))
    torch.testing.assert_close(packed_model(ids), torch_dropout(ids), rtol=0, atol=0)
    assert sum(isinstance(m, PackedDropout) for m in packed_model.modules()) >= 3
    assert not any(isinstance(m, PackedDropout) for m in torch_dropout.modules())
    decoder = DecoderLM(vocab_size=50, d_model=16, num_heads=2, d_ff=32, num_layers=1, max_len=8, dropout=0.1)
    assert decoder.layers[0].attention.packed_dropout and isinstance(decoder.drop, PackedDropout)
