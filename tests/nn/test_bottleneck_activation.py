"""TTLinear with a bottleneck activation (CoLA's ``B act(A x)`` on a tensor train) against a float64 reference."""

from __future__ import annotations

import pytest
import tensorly as tl
import torch
from helpers.nn_reference import F64, gate_by_hand, randomize_gates_

from comera_lightning.nn import TTLinear

# (in, out, in_modes, out_modes): one mode per side (CoLA), 2 + 2, padded sides, 3 + 1
SHAPES = [(12, 10, [12], [10]), (12, 10, [4, 3], [2, 5]), (37, 20, [5, 8], [3, 7]), (16, 6, [2, 2, 4], [6])]
IDS = ["cola", "2+2", "padded", "3+1"]
ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "relu": torch.relu,
    "tanh": torch.tanh,
}


def make(in_f, out_f, in_modes, out_modes, rank=3, activation="silu"):
    layer = TTLinear(
        in_f, out_f, rank, in_modes=in_modes, out_modes=out_modes, dtype=F64, bottleneck_activation=activation
    )
    randomize_gates_(layer)
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def reference_factors(layer):
    """(L: in x r, R: r x out) rebuilt with tensorly: each side closed into a full TT by an identity core."""
    cores = gate_by_hand(list(layer.cores), list(layer.gates), layer.rank_masks)
    num_in = len(layer.in_modes)
    rank = cores[num_in - 1].shape[-1]
    eye = torch.eye(rank, dtype=F64)
    with tl.backend_context("pytorch"):
        left = tl.tt_to_tensor([*cores[:num_in], eye.reshape(rank, rank, 1)]).reshape(-1, rank)
        right = tl.tt_to_tensor([eye.reshape(1, rank, rank), *cores[num_in:]]).reshape(rank, -1)
    return left[: layer.in_features], right[:, : layer.out_features]


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("in_f, out_f, in_modes, out_modes", SHAPES, ids=IDS)
def test_forward_and_grads_match_reference(in_f, out_f, in_modes, out_modes, activation):
    layer = make(in_f, out_f, in_modes, out_modes, activation=activation)
    x = torch.randn(2, 3, in_f, dtype=F64, requires_grad=True)
    upstream = torch.randn(2, 3, out_f, dtype=F64)
    params = [x, *layer.cores, *layer.gates, layer.bias]
    y = layer(x)
    grads = torch.autograd.grad((y * upstream).sum(), params)
    left, right = reference_factors(layer)
    y_ref = ACTIVATIONS[activation](x @ left) @ right + layer.bias
    grads_ref = torch.autograd.grad((y_ref * upstream).sum(), params)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for k, (g, g_ref) in enumerate(zip(grads, grads_ref, strict=True)):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10, msg=lambda m, k=k: f"param {k}: {m}")


def test_gradcheck():
    layer = make(12, 10, [4, 3], [2, 5])
    names = [n for n, _ in layer.named_parameters()]
    x = torch.randn(2, 12, dtype=F64, requires_grad=True)
    tensors = [p.detach().clone().double().requires_grad_() for _, p in layer.named_parameters()]

    def fn(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values, strict=True)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *tensors), fast_mode=True)


def test_the_activation_makes_it_non_linear():
    layer = make(12, 10, [4, 3], [2, 5])
    x = torch.randn(4, 12, dtype=F64)
    assert not torch.allclose(layer(2 * x) - layer.bias, 2 * (layer(x) - layer.bias))


@pytest.mark.parametrize("in_f, out_f, in_modes, out_modes", SHAPES, ids=IDS)
def test_inference_cache_matches_training_forward(in_f, out_f, in_modes, out_modes):
    layer = make(in_f, out_f, in_modes, out_modes)
    x = torch.randn(5, in_f, dtype=F64)
    expected = layer(x).detach()
    layer.eval()
    with torch.no_grad():
        first, second = layer(x), layer(x)
    assert layer._inference_entry is not None  # served from the kept factors
    torch.testing.assert_close(first, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(second, expected, rtol=1e-10, atol=1e-10)


def test_a_switched_off_bottleneck_slice_is_removed_exactly():
    layer = make(12, 10, [4, 3], [2, 5], rank=4)
    bond = len(layer.in_modes) - 1  # the middle bond, where the activation sits
    with torch.no_grad():
        layer.gates[bond][1] = 0.0
    layer.refresh_masks_()
    x = torch.randn(6, 12, dtype=F64)
    before = layer(x).detach()
    layer.truncate_()
    assert layer.ranks[bond + 1] == 3
    torch.testing.assert_close(layer(x), before, rtol=1e-12, atol=1e-12)


def test_bf16_autocast_stays_close():
    layer = TTLinear(64, 48, 8, in_modes=[8, 8], out_modes=[6, 8], bottleneck_activation="silu")
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), layer(x), rtol=0.05, atol=0.05)


def test_no_dense_weight_and_no_other_plan():
    layer = make(12, 10, [4, 3], [2, 5])
    with pytest.raises(
        ValueError, match=r"not a linear map .*keep it as a TT layer .*or train it with bottleneck_activation=None"
    ):
        layer.weight_dense()
    with pytest.raises(ValueError, match=r"always runs the bottleneck order .*plan 'sweep' would skip the activation"):
        layer.set_contraction_plan("sweep")
    layer.set_contraction_plan("half_merge")


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="bottleneck_activation must be None or one of"):
        TTLinear(12, 10, 3, bottleneck_activation="softmax")
