"""TTLinear: forward vs tensorly dense reference, gradients, padding, plans, autocast, init, errors."""

from __future__ import annotations

import copy
import math

import pytest
import tensorly as tl
import torch
from helpers.nn_reference import F64, FULL_RANK, gate_by_hand, randomize_gates_, reference_linear_weight
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from comera_lightning.nn import TTLinear
from comera_lightning.tt import PLANS

# (in_features, out_features, in_modes, out_modes): exact, padded (37 is prime), and 1..4 modes per side
SHAPES = [
    (6, 5, [6], [5]),
    (12, 10, [4, 3], [2, 5]),
    (3, 8, [3], [2, 2, 2]),
    (37, 20, [5, 8], [3, 7]),  # both sides padded: 40 x 21
    (37, 20, None, None),  # default modes: [37] x [20]
    (16, 16, [2, 2, 2, 2], [2, 2, 2, 2]),
    (23, 12, [2, 3, 2, 2], [4, 3]),  # 24 >= 23
]
SHAPE_IDS = ["6x5", "12x10", "3x8", "37x20pad", "37x20auto", "16x16", "23x12pad"]


def make(in_f, out_f, in_modes, out_modes, rank, **kw):
    layer = TTLinear(in_f, out_f, rank, in_modes=in_modes, out_modes=out_modes, dtype=F64, **kw)
    randomize_gates_(layer)
    with torch.no_grad():
        if layer.bias is not None:
            layer.bias.normal_()
    return layer


def test_default_modes_and_ranks_paper_fc1():
    layer = TTLinear(768, 3072, 30, in_modes=[12, 8, 8], out_modes=[12, 16, 16], bias=False)
    assert layer.ranks == [1, 12, 30, 30, 30, 16, 1]
    assert layer.max_ranks == [1, 12, 96, 768, 256, 16, 1]
    assert [tuple(c.shape) for c in layer.cores] == [
        (1, 12, 12),
        (12, 8, 30),
        (30, 8, 30),
        (30, 12, 30),
        (30, 16, 16),
        (16, 16, 1),
    ]
    assert [g.dtype for g in layer.gates] == [torch.float32] * 5
    assert all(torch.all(g == 1) for g in layer.gates)
    assert layer.active_ranks == layer.ranks


def test_default_modes_are_chosen():
    layer = TTLinear(768, 3072, 8)
    assert layer.in_modes == [12, 8, 8] and math.prod(layer.out_modes) == 3072
    prime = TTLinear(37, 20, 3)
    assert math.prod(prime.in_modes) >= 37 and math.prod(prime.out_modes) >= 20


@pytest.mark.parametrize("plan", [None, *PLANS])
@pytest.mark.parametrize("rank", [1, FULL_RANK], ids=["rank1", "full"])
@pytest.mark.parametrize("in_f, out_f, in_modes, out_modes", SHAPES, ids=SHAPE_IDS)
def test_forward_and_grads_match_dense_reference(in_f, out_f, in_modes, out_modes, rank, plan):
    layer = make(in_f, out_f, in_modes, out_modes, rank)
    layer.set_contraction_plan(plan)
    with torch.no_grad():  # one dead slice on the first bond (when it has more than one)
        if layer.ranks[1] > 1:
            layer.gates[0][0] = 1e-3
    layer.refresh_masks_()
    x = torch.randn(2, 3, in_f, dtype=F64, requires_grad=True)
    upstream = torch.randn(2, 3, out_f, dtype=F64)
    params = [x, *layer.cores, *layer.gates, layer.bias]

    y = layer(x)
    assert y.shape == (2, 3, out_f) and y.dtype == F64
    grads = torch.autograd.grad((y * upstream).sum(), params)

    weight = reference_linear_weight(layer)
    y_ref = x @ weight.transpose(0, 1) + layer.bias
    grads_ref = torch.autograd.grad((y_ref * upstream).sum(), params)

    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(layer.weight_dense(), weight, rtol=1e-12, atol=1e-12)
    for k, (g, g_ref) in enumerate(zip(grads, grads_ref, strict=True)):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10, msg=lambda m, k=k: f"param {k}: {m}")


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize(
    "in_f, out_f, in_modes, out_modes", [SHAPES[1], SHAPES[3], SHAPES[6]], ids=["12x10", "37x20pad", "23x12pad"]
)
def test_module_gradcheck(in_f, out_f, in_modes, out_modes, plan):
    layer = make(in_f, out_f, in_modes, out_modes, 2)
    layer.set_contraction_plan(plan)
    names = [n for n, _ in layer.named_parameters()]
    x = torch.randn(2, in_f, dtype=F64, requires_grad=True)
    # gates are fp32 parameters; gradcheck needs float64 everywhere (apply_gates casts to the cores' dtype)
    tensors = [p.detach().clone().double().requires_grad_() for _, p in layer.named_parameters()]

    def fn(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values, strict=True)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *tensors), fast_mode=True)


def test_weight_dense_matches_tensorly_object():
    layer = make(12, 10, [4, 3], [2, 5], 3)
    tt = layer.to_tensorly()
    assert isinstance(tt, tl.tt_tensor.TTTensor)
    with tl.backend_context("pytorch"):
        full = tl.tt_to_tensor(tt)
    assert tuple(full.shape) == (4, 3, 2, 5)
    torch.testing.assert_close(layer.weight_dense(), full.reshape(12, 10).transpose(0, 1))


def test_padded_rows_and_columns_are_never_used():
    # in 35 -> modes [8, 5] (40): padded rows 35..39 are exactly in-mode-1 index 7;
    # out 18 -> modes [7, 3] (21): padded columns 18..20 are exactly out-mode-1 index 6
    layer = make(35, 18, [8, 5], [7, 3], 3)
    x = torch.randn(4, 35, dtype=F64)
    before = layer(x)
    assert layer.weight_dense().shape == (18, 35)
    with torch.no_grad():
        layer.cores[0][:, 7, :] += 100.0
        layer.cores[2][:, 6, :] -= 100.0
    torch.testing.assert_close(layer(x), before, rtol=1e-12, atol=1e-12)
    layer(x).pow(2).sum().backward()
    assert torch.all(layer.cores[0].grad[:, 7, :] == 0)
    assert torch.all(layer.cores[2].grad[:, 6, :] == 0)
    assert layer.cores[0].grad[:, :7, :].abs().sum() > 0


def test_one_dimensional_input_and_no_bias():
    layer = make(12, 10, [4, 3], [2, 5], 3, bias=False)
    assert layer.bias is None
    x = torch.randn(12, dtype=F64)
    y = layer(x)
    assert y.shape == (10,)
    torch.testing.assert_close(y, layer.weight_dense() @ x)


def test_one_dimensional_input_with_padded_bias():
    layer = make(35, 18, [8, 5], [7, 3], 3)
    x = torch.randn(35, dtype=F64)
    torch.testing.assert_close(layer(x), layer.weight_dense() @ x + layer.bias)


def test_numpy_integer_rank():
    np = pytest.importorskip("numpy")
    # ranks often come from configs / numpy arithmetic; an integral scalar means "one rank everywhere"
    layer = TTLinear(12, 10, np.int64(3), in_modes=[4, 3], out_modes=[2, 5])
    assert layer.ranks == [1, 3, 3, 3, 1]


def test_float32_layer_default_dtype():
    layer = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5])
    assert all(c.dtype == torch.float32 for c in layer.cores) and layer.bias.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in layer.gates)
    x = torch.randn(5, 12)
    torch.testing.assert_close(layer(x), x @ layer.weight_dense().T + layer.bias, rtol=1e-5, atol=1e-6)


def test_float64_layer_keeps_fp32_gates():
    layer = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5], dtype=F64)
    assert all(c.dtype == F64 for c in layer.cores) and layer.bias.dtype == F64
    assert all(g.dtype == torch.float32 for g in layer.gates)


@pytest.mark.parametrize("plan", [None, *PLANS])
def test_bf16_autocast(plan):
    layer = TTLinear(64, 32, 4, in_modes=[4, 4, 4], out_modes=[4, 8])
    randomize_gates_(layer)
    with torch.no_grad():
        layer.bias.normal_()
    layer.set_contraction_plan(plan)
    x = torch.randn(3, 5, 64)
    y32 = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = layer(x)
    assert y16.dtype == torch.bfloat16 and y16.shape == y32.shape
    assert (y16.float() - y32).abs().max() <= 3e-2 * y32.abs().max()
    y16.float().pow(2).mean().backward()
    for p in [*layer.cores, *layer.gates, layer.bias]:
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert torch.isfinite(p.grad).all()
    assert any(g.grad.abs().sum() > 0 for g in layer.gates)


# --- init -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "in_f, out_f, rank, kw, seeds",
    [
        (768, 3072, 30, {}, 1),
        (256, 128, 4, {}, 8),
        (37, 20, 3, {}, 8),
        (96, 80, 1, {"in_modes": [12, 8], "out_modes": [10, 8]}, 24),
        (64, 64, 16, {"in_modes": [4, 4, 4], "out_modes": [4, 4, 4]}, 8),
    ],
)
def test_init_std_default(in_f, out_f, rank, kw, seeds):
    target = math.sqrt(1.0 / (in_f + out_f))
    acc = 0.0
    for seed in range(seeds):
        torch.manual_seed(seed)
        with torch.no_grad():
            acc += TTLinear(in_f, out_f, rank, bias=False, **kw).weight_dense().double().pow(2).mean().item()
    measured = math.sqrt(acc / seeds)
    assert abs(measured / target - 1) < 0.2, (measured, target)


def test_init_std_explicit():
    acc = 0.0
    for seed in range(8):
        torch.manual_seed(seed)
        with torch.no_grad():
            acc += TTLinear(256, 128, 8, init_std=0.5).weight_dense().double().pow(2).mean().item()
    assert abs(math.sqrt(acc / 8) / 0.5 - 1) < 0.2


# --- from_linear ----------------------------------------------------------------------------------------------
def test_from_linear_full_rank_is_exact():
    linear = nn.Linear(12, 10).double()
    layer, error = TTLinear.from_linear(linear, FULL_RANK, in_modes=[4, 3], out_modes=[2, 5])
    assert error < 1e-10
    assert layer.cores[0].dtype == F64
    torch.testing.assert_close(layer.bias, linear.bias)
    x = torch.randn(3, 12, dtype=F64)
    torch.testing.assert_close(layer(x), linear(x))
    # the SVD may find smaller ranks than asked; the layer adopts them consistently
    assert layer.ranks == [1] + [int(c.shape[-1]) for c in layer.cores]
    assert len(layer.gates[1]) == layer.ranks[2]


def test_from_linear_low_rank_and_padding():
    linear = nn.Linear(37, 20, bias=False).double()
    layer, error = TTLinear.from_linear(linear, 2, in_modes=[5, 8], out_modes=[4, 5])
    assert layer.bias is None
    assert 0.0 < error <= 1.0
    measured = (layer.weight_dense() - linear.weight).norm() / linear.weight.norm()
    assert abs(measured.item() - error) < 1e-9


# --- errors ---------------------------------------------------------------------------------------------------
def test_rank_zero():
    with pytest.raises(ValueError, match="rank must be >= 1"):
        TTLinear(12, 10, 0, in_modes=[4, 3], out_modes=[2, 5])


def test_explicit_rank_above_bound():
    # modes [4,3,2,5]: bond 1 allows at most 4
    with pytest.raises(
        ValueError, match=r"allow at most 4 there .*lower it or pass a single int rank to clamp automatically"
    ):
        TTLinear(12, 10, [5, 3, 3], in_modes=[4, 3], out_modes=[2, 5])


def test_wrong_rank_list_length():
    with pytest.raises(ValueError, match=r"expected 3 internal ranks .*; pass a single int to use one rank everywhere"):
        TTLinear(12, 10, [3, 3], in_modes=[4, 3], out_modes=[2, 5])


def test_explicit_rank_list_is_used():
    layer = TTLinear(12, 10, [2, 7, 5], in_modes=[4, 3], out_modes=[2, 5])
    assert layer.ranks == [1, 2, 7, 5, 1]


@pytest.mark.parametrize("side", ["in_modes", "out_modes"])
def test_modes_product_mismatch(side):
    kw = {"in_modes": [4, 3], "out_modes": [2, 5]}
    kw[side] = [2, 2]
    with pytest.raises(ValueError, match=side):
        TTLinear(12, 10, 3, **kw)


@pytest.mark.parametrize("threshold", [-0.1, 1.0, 2.0])
def test_threshold_outside_unit_interval(threshold):
    with pytest.raises(ValueError, match=r"rank_threshold must be in \[0, 1\)"):
        TTLinear(12, 10, 3, rank_threshold=threshold)


def test_threshold_zero_is_allowed():
    assert TTLinear(12, 10, 3, rank_threshold=0.0).rank_threshold == 0.0


@pytest.mark.parametrize("shape", [(4, 11), (4, 13), (12, 4)])
def test_wrong_input_feature_size(shape):
    layer = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5])
    with pytest.raises(
        ValueError, match=rf"TTLinear expected inputs with last dimension 12, got shape \({shape[0]}, {shape[1]}\)"
    ):
        layer(torch.randn(*shape))


def test_padded_layer_rejects_padded_width():
    layer = TTLinear(37, 20, 3, in_modes=[5, 8], out_modes=[4, 5])
    with pytest.raises(ValueError, match=r"TTLinear expected inputs with last dimension 37, got shape \(2, 40\)"):
        layer(torch.randn(2, 40))


def test_unknown_plan_name():
    layer = TTLinear(12, 10, 3)
    with pytest.raises(ValueError, match=r"unknown contraction plan 'fastest'; choose one of .*'dense'\) or None"):
        layer.set_contraction_plan("fastest")
    layer.set_contraction_plan("sweep")
    assert layer.contraction_plan == "sweep"
    layer.set_contraction_plan(None)
    assert layer.contraction_plan is None


@pytest.mark.parametrize("in_f, out_f", [(0, 10), (10, 0), (-1, 4)])
def test_non_positive_features(in_f, out_f):
    with pytest.raises(ValueError, match=f"in_features and out_features must be >= 1, got {in_f}, {out_f}"):
        TTLinear(in_f, out_f, 3)


def test_extra_repr():
    text = repr(TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5]))
    assert "in_modes=[4, 3]" in text and "ranks=[1, 3, 3, 3, 1]" in text


@pytest.mark.parametrize("plan", [None, *PLANS])
def test_empty_batch(plan):
    layer = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5])
    layer.set_contraction_plan(plan)
    assert layer(torch.randn(0, 12)).shape == (0, 10)
    assert layer(torch.randn(4, 0, 12)).shape == (4, 0, 10)


# --- edge sizes, devices, dtypes --------------------------------------------------------------------------------
@pytest.mark.parametrize("in_f, out_f", [(1, 5), (5, 1), (1, 1)])
def test_single_feature_sides_build_and_match_dense(in_f, out_f):
    # one feature on a side is a valid nn.Linear shape (a scalar input or a scalar score head)
    layer = make(in_f, out_f, None, None, 3)
    x = torch.randn(4, in_f, dtype=F64)
    assert layer.weight_dense().shape == (out_f, in_f)
    torch.testing.assert_close(layer(x), x @ reference_linear_weight(layer).T + layer.bias, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("parameterization", ["standard", "mup"])
def test_dtype_and_device_reach_every_tensor(parameterization):
    layer = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5], dtype=F64, parameterization=parameterization)
    assert {c.dtype for c in layer.cores} == {F64} and layer.bias.dtype == F64
    meta = TTLinear(12, 10, 3, device="meta", dtype=F64, parameterization=parameterization)
    assert {t.device.type for t in [*meta.parameters(), *meta.buffers()]} == {"meta"}
    assert {c.dtype for c in meta.cores} == {F64} and meta.bias.dtype == F64


def test_modes_errors_name_the_argument():
    with pytest.raises(
        ValueError, match=r"^in_modes: the product of modes \[2, 2\] is 4 but must be at least 12; pass modes whose"
    ):
        TTLinear(12, 10, 3, in_modes=[2, 2], out_modes=[2, 5])
    with pytest.raises(
        ValueError, match=r"^out_modes: the product of modes \[3, 3\] is 9 but must be at least 10; pass modes whose"
    ):
        TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[3, 3])


def test_padded_outputs_without_bias():
    layer = make(35, 18, [8, 5], [7, 3], 3, bias=False)
    x = torch.randn(2, 4, 35, dtype=F64)
    y = layer(x)
    assert y.shape == (2, 4, 18)
    torch.testing.assert_close(y, x @ reference_linear_weight(layer).T, rtol=1e-12, atol=1e-12)


def test_forced_plan_decides_the_work():
    # batch 3, 64 -> 48: the planner picks a bottleneck order; "dense" builds W (64 x 48) and multiplies by it, so it
    # costs more than x @ W alone, "sweep" never forms W and costs less; both give the same outputs
    layer = make(64, 48, [8, 8], [6, 8], 4)
    x = torch.randn(3, 64, dtype=F64)
    gemm = 2 * 3 * 64 * 48
    flops, outputs = {}, {}
    for plan in ["dense", "sweep"]:
        layer.set_contraction_plan(plan)
        with FlopCounterMode(display=False) as counter:
            outputs[plan] = layer(x)
        flops[plan] = counter.get_total_flops()
    assert flops["dense"] > gemm > flops["sweep"], flops
    torch.testing.assert_close(outputs["dense"], outputs["sweep"], rtol=1e-12, atol=1e-12)


# --- bottleneck activation: bias-free, cached ---------------------------------------------------------------------
def _cola_reference(layer, x):
    """act(x L) R for one mode per side: L and R are the two gated cores."""
    cores = gate_by_hand(list(layer.cores), list(layer.gates), layer.rank_masks)
    left, right = cores[0][0], cores[1][..., 0]
    return torch.relu(x @ left[: layer.in_features]) @ right[:, : layer.out_features]


@pytest.mark.parametrize("bias", [False, True])
def test_activated_layer_with_and_without_bias(bias):
    layer = make(12, 10, [12], [10], 3, bias=bias, bottleneck_activation="relu")
    x = torch.randn(5, 12, dtype=F64)
    expected = _cola_reference(layer, x) + (layer.bias if bias else 0.0)
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    # the inference cache serves the same function (it must keep L and R apart, even when W would be smaller)
    layer.eval()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


def test_activated_layer_cached_when_dense_would_be_smaller():
    # 4 x 4 at rank 4: r (M + N) = 32 > M N = 16, so a linear layer would cache W; this one needs L and R
    layer = make(4, 4, [4], [4], 4, bottleneck_activation="relu").eval()
    x = torch.randn(3, 4, dtype=F64)
    expected = _cola_reference(layer, x) + layer.bias
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


def test_cached_forward_costs_one_gemm_when_the_dense_weight_is_smaller():
    # 6 x 5 at rank 5: r (M + N) = 55 >= M N = 30, so the cache keeps W and a call is x @ W^T
    layer = make(6, 5, [6], [5], 5).eval()
    x = torch.randn(7, 6, dtype=F64)
    with torch.no_grad():
        expected = x @ layer.weight_dense().T + layer.bias
        layer(x)
        with FlopCounterMode(display=False) as counter:
            y = layer(x)
    assert counter.get_total_flops() == 2 * 7 * 6 * 5
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_cached_forward_follows_input_dtype_and_autocast():
    # the same layer serves inputs of several dtypes, with and without autocast, in one eval session: each call
    # gives what an uncached call gives (dtype and values), whatever was cached before
    layer = make(12, 10, [4, 3], [2, 5], 3).eval()
    reference = copy.deepcopy(layer)
    reference.inference_cache = False
    x = torch.randn(4, 12, dtype=F64)
    cases = [(x, False), (x.float(), False), (x, True), (x.float(), True), (x, False)]
    with torch.no_grad():
        for inputs, autocast in cases:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                expected, y = reference(inputs), layer(inputs)
            assert y.dtype == expected.dtype, (inputs.dtype, autocast)
            torch.testing.assert_close(y, expected, rtol=1e-2, atol=1e-2)


def test_extra_repr_lists_bias_and_activation():
    plain = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5])
    assert plain.extra_repr() == (
        "in_features=12, out_features=10, in_modes=[4, 3], out_modes=[2, 5], bias=True, "
        "ranks=[1, 3, 3, 3, 1], active_ranks=[1, 3, 3, 3, 1], threshold=0.01"
    )
    activated = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5], bias=False, bottleneck_activation="relu")
    assert activated.extra_repr() == (
        "in_features=12, out_features=10, in_modes=[4, 3], out_modes=[2, 5], bias=False, "
        "bottleneck_activation=relu, ranks=[1, 3, 3, 3, 1], active_ranks=[1, 3, 3, 3, 1], threshold=0.01"
    )
