"""Contraction plans of ``y = x W`` for a CoMERA train: values and gradients against float64 dense
references (tensorly), gradcheck, bf16 autocast, the planner and its cost model."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tt_reference import (
    F64,
    FULL_RANK,
    MODE_CONFIGS,
    MODE_IDS,
    dense_reference,
    gate_by_hand,
    random_gates,
    random_train,
)

from comera_lightning.tt import (
    PLANS,
    apply_gates,
    chain_merge,
    plan_costs,
    plan_tt_linear,
    tt_linear,
)
from comera_lightning.tt.contract import TTLinearFunction

RANKS = [1, FULL_RANK]
RANK_IDS = ["rank1", "full"]


def test_plans_are_the_documented_five():
    assert set(PLANS) == {"half_merge", "sweep", "merge_in_sweep_out", "sweep_in_merge_out", "dense"}


# --- values and gradients against the dense reference -----------------------------------------------------
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("rank", RANKS, ids=RANK_IDS)
@pytest.mark.parametrize("in_modes, out_modes", MODE_CONFIGS, ids=MODE_IDS)
def test_plan_matches_dense_reference_values_and_grads(plan, rank, in_modes, out_modes):
    cores, ranks = random_train(in_modes, out_modes, rank)
    gates, masks = random_gates(ranks)
    M, N, p = math.prod(in_modes), math.prod(out_modes), len(in_modes)
    x = torch.randn(2, 3, M, dtype=F64, requires_grad=True)  # several leading dims
    bias = torch.randn(N, dtype=F64, requires_grad=True)
    upstream = torch.randn(2, 3, N, dtype=F64)
    params = [x, bias, *cores, *gates]

    y = tt_linear(x, apply_gates(cores, gates, masks), in_modes, plan=plan, bias=bias)
    assert y.shape == (2, 3, N) and y.dtype == F64
    grads = torch.autograd.grad((y * upstream).sum(), params)

    weight = dense_reference(gate_by_hand(cores, gates, masks), p)
    assert weight.shape == (M, N)
    y_ref = x @ weight + bias
    grads_ref = torch.autograd.grad((y_ref * upstream).sum(), params)

    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    names = ["x", "bias"] + [f"core{k}" for k in range(len(cores))] + [f"gate{k}" for k in range(len(gates))]
    for name, g, g_ref in zip(names, grads, grads_ref, strict=True):
        assert g.shape == g_ref.shape, name
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
    # masked slices receive no gate gradient
    for gate_grad, mask in zip(grads[2 + len(cores) :], masks, strict=True):
        assert torch.all(gate_grad[~mask] == 0)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("rank", RANKS, ids=RANK_IDS)
@pytest.mark.parametrize("in_modes, out_modes", MODE_CONFIGS, ids=MODE_IDS)
def test_plan_gradcheck(plan, rank, in_modes, out_modes):
    cores, ranks = random_train(in_modes, out_modes, rank)
    gates, masks = random_gates(ranks)
    x = torch.randn(3, math.prod(in_modes), dtype=F64, requires_grad=True)
    num_cores = len(cores)
    inputs = (x, *cores, *gates)
    # element-wise (slow) gradcheck on small trains; a random-projection check on the largest ones
    fast = sum(t.numel() for t in inputs) > 120

    def fn(x, *params):
        return tt_linear(x, apply_gates(list(params[:num_cores]), list(params[num_cores:]), masks), in_modes, plan)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=fast)


@pytest.mark.parametrize("plan", PLANS)
def test_function_without_input_grad(plan):
    """Weights-only gradients (frozen input, e.g. the first layer) must match the reference too."""
    in_modes, out_modes = [2, 3, 2], [3, 2]
    cores, _ = random_train(in_modes, out_modes, 3)
    x = torch.randn(5, 12, dtype=F64)
    y = tt_linear(x, cores, in_modes, plan)
    grads = torch.autograd.grad(y.pow(2).sum(), cores)
    y_ref = x @ dense_reference(cores, 3)
    grads_ref = torch.autograd.grad(y_ref.pow(2).sum(), cores)
    torch.testing.assert_close(y, y_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("loss", ["sum", "transposed", "one_column"])
def test_unusual_upstream_gradients(plan, loss):
    """Expanded (stride-0), transposed and mostly-zero output gradients reach the same results."""
    cores, _ = random_train([2, 3], [3, 2], 3)
    x = torch.randn(4, 6, dtype=F64, requires_grad=True)
    weights = torch.arange(24.0, dtype=F64).reshape(6, 4)
    losses = {
        "sum": lambda y: y.sum(),
        "transposed": lambda y: (y.t() * weights).sum(),
        "one_column": lambda y: y[:, 1].sum(),
    }
    grads = torch.autograd.grad(losses[loss](tt_linear(x, cores, [2, 3], plan)), [x, *cores])
    grads_ref = torch.autograd.grad(losses[loss](x @ dense_reference(cores, 2)), [x, *cores])
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)
    # every core's gradient in its core's layout: DDP copies any other layout into its bucket at every step
    assert [g.stride() for g in grads[1:]] == [c.stride() for c in cores]


@pytest.mark.parametrize("plan", PLANS)
def test_non_contiguous_input(plan):
    cores, _ = random_train([2, 3], [4, 2], 3)
    x = torch.randn(6, 5, dtype=F64).t()  # (5, 6), transposed storage
    assert not x.is_contiguous()
    torch.testing.assert_close(tt_linear(x, cores, [2, 3], plan), x @ dense_reference(cores, 2))


@pytest.mark.parametrize("plan", PLANS)
def test_one_dimensional_input(plan):
    cores, _ = random_train([2, 3], [4], 2)
    x = torch.randn(6, dtype=F64)
    y = tt_linear(x, cores, [2, 3], plan)
    assert y.shape == (4,)
    torch.testing.assert_close(y, x @ dense_reference(cores, 2))


def test_all_plans_agree_and_planner_choice_is_valid():
    in_modes, out_modes = [4, 3, 2], [2, 5]
    cores, _ = random_train(in_modes, out_modes, 4, requires_grad=False)
    x = torch.randn(7, 24, dtype=F64)
    outs = {plan: tt_linear(x, cores, in_modes, plan) for plan in PLANS}
    auto = tt_linear(x, cores, in_modes)
    for plan, y in outs.items():
        torch.testing.assert_close(y, outs["dense"], msg=plan)
    torch.testing.assert_close(auto, outs["dense"])


@pytest.mark.parametrize("plan", [*PLANS, None])
def test_empty_batch(plan):
    """Zero rows (an empty micro-batch) gives an empty output and zero core gradients, like nn.Linear."""
    in_modes, out_modes = [2, 3], [3, 2]
    cores, _ = random_train(in_modes, out_modes, 2)
    for shape in [(0, 6), (2, 0, 6)]:
        x = torch.randn(*shape, dtype=F64, requires_grad=True)
        y = tt_linear(x, cores, in_modes, plan)
        assert y.shape == (*shape[:-1], 6)
        grads = torch.autograd.grad(y.sum(), cores, allow_unused=True)
        assert all(g is None or torch.all(g == 0) for g in grads)


def test_unknown_plan_name():
    cores, _ = random_train([2, 3], [4], 2)
    with pytest.raises(ValueError, match=r"unknown contraction plan 'fast'; choose one of \(.*\) or None"):
        tt_linear(torch.randn(2, 6, dtype=F64), cores, [2, 3], plan="fast")


def test_wrong_input_size():
    cores, _ = random_train([2, 3], [4], 2)
    with pytest.raises(ValueError, match=r"expected input with last dimension 6, got shape \(2, 5\)"):
        tt_linear(torch.randn(2, 5, dtype=F64), cores, [2, 3])


def test_fp32_input_with_fp64_cores_and_vice_versa():
    in_modes, out_modes = [3, 4], [2, 3]
    cores, _ = random_train(in_modes, out_modes, 3, requires_grad=False)
    x = torch.randn(4, 12, dtype=F64)
    ref = x @ dense_reference(cores, 2)
    for plan in PLANS:
        y32 = tt_linear(x.float(), cores, in_modes, plan)  # batch GEMMs in fp32, merges in fp64
        assert y32.dtype == torch.float32
        torch.testing.assert_close(y32.double(), ref, rtol=1e-4, atol=1e-4)


# --- bf16 autocast on CPU -----------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", [*PLANS, None])
def test_bf16_autocast(plan):
    in_modes, out_modes = [4, 4, 4], [4, 8]
    cores, ranks = random_train(in_modes, out_modes, 4, dtype=torch.float32)
    gates, masks = random_gates(ranks, dtype=torch.float32)
    x = torch.randn(2, 5, 64)
    bias = torch.randn(32, requires_grad=True)
    upstream = torch.randn(2, 5, 32)
    params = [bias, *cores, *gates]

    y32 = tt_linear(x, apply_gates(cores, gates, masks), in_modes, plan, bias)
    grads32 = torch.autograd.grad((y32 * upstream).sum(), params)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = tt_linear(x, apply_gates(cores, gates, masks), in_modes, plan, bias)
    assert y16.dtype == torch.bfloat16
    grads16 = torch.autograd.grad((y16.float() * upstream).sum(), params)

    scale = y32.abs().max()
    assert (y16.float() - y32).abs().max() <= 3e-2 * scale
    for g16, g32, param in zip(grads16, grads32, params, strict=True):
        assert g16.dtype == torch.float32 == param.dtype
        assert torch.isfinite(g16).all()
        assert (g16 - g32).norm() <= 5e-2 * g32.norm()


def test_bf16_autocast_input_gradient_dtype():
    cores, _ = random_train([4, 4], [8], 4, dtype=torch.float32)
    x = torch.randn(3, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tt_linear(x, cores, [4, 4], "half_merge")
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()


# --- chain_merge ----------------------------------------------------------------------------------------------
def test_chain_merge_prefixes():
    sizes = [2, 3, 4]
    ranks = [1, 2, 3, 2]
    cores = [torch.randn(ranks[k], s, ranks[k + 1], dtype=F64) for k, s in enumerate(sizes)]
    prefixes = chain_merge(cores)
    assert [tuple(p.shape) for p in prefixes] == [(2, 2), (6, 3), (24, 2)]
    expected = torch.einsum("aib,bjc,ckd->aijkd", *cores).reshape(24, 2)
    torch.testing.assert_close(prefixes[-1], expected)
    start = torch.randn(5, 1, dtype=F64)
    swept = chain_merge(cores, start=start)
    assert tuple(swept[-1].shape) == (5 * 24, 2)
    torch.testing.assert_close(swept[-1].reshape(5, 24, 2), start[:, 0, None, None] * expected)


# --- planner and cost model ---------------------------------------------------------------------------------
PAPER_IN, PAPER_OUT, PAPER_RANKS = [12, 8, 8], [12, 16, 16], [1, 12, 30, 30, 30, 16, 1]


@pytest.mark.parametrize(
    "in_modes, out_modes, ranks",
    [
        (PAPER_IN, PAPER_OUT, PAPER_RANKS),
        ([12, 8, 8], [8, 8, 12], [1, 12, 30, 30, 30, 12, 1]),
        ([4], [2, 2, 2], [1, 4, 4, 2, 1]),
        ([2, 2], [3], [1, 2, 3, 1]),
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 64, 4096])
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_planner_returns_a_plan(in_modes, out_modes, ranks, rows, device_type):
    plan = plan_tt_linear(in_modes, out_modes, ranks, rows, device_type)
    assert plan in PLANS
    costs = {c.plan: c for c in plan_costs(in_modes, out_modes, ranks, rows, device_type)}
    assert set(costs) == set(PLANS)
    assert costs[plan].seconds == min(c.seconds for c in costs.values())


def test_planner_prefers_half_merge_at_training_batch():
    assert plan_tt_linear(PAPER_IN, PAPER_OUT, PAPER_RANKS, 4096) == "half_merge"
    assert plan_tt_linear(PAPER_IN, PAPER_OUT, PAPER_RANKS, 4096, "cuda", 2) == "half_merge"


def test_planner_avoids_merging_for_one_row():
    # one row: merging a side costs far more than sweeping the single row through its cores
    assert plan_tt_linear(PAPER_IN, PAPER_OUT, PAPER_RANKS, 1) == "sweep"


def test_planner_costs_each_shape_rows_device_and_dtype_size_once(monkeypatch):
    from comera_lightning.tt import contract

    costed = []

    def counting_plan_costs(*args):
        costed.append(args)
        return plan_costs(*args)

    monkeypatch.setattr(contract, "plan_costs", counting_plan_costs)
    contract._cached_plan.cache_clear()
    try:
        first = plan_tt_linear(PAPER_IN, PAPER_OUT, PAPER_RANKS, 4096)  # lists
        again = plan_tt_linear(tuple(PAPER_IN), tuple(PAPER_OUT), tuple(PAPER_RANKS), 4096)  # the same key as tuples
        assert first == again == "half_merge" and len(costed) == 1
        # every part of the key gets its own entry, so a cached choice is never reused for another shape
        assert plan_tt_linear(PAPER_IN, PAPER_OUT, PAPER_RANKS, 1) == "sweep" and len(costed) == 2
        plan_tt_linear(PAPER_IN, PAPER_OUT, PAPER_RANKS, 4096, "cuda")
        plan_tt_linear(PAPER_IN, PAPER_OUT, PAPER_RANKS, 4096, "cpu", 2)
        plan_tt_linear(PAPER_IN, PAPER_OUT, [1, 12, 30, 20, 30, 16, 1], 4096)
        assert len(costed) == 5
        assert [args[3:] for args in costed[2:4]] == [(4096, "cuda", 4), (4096, "cpu", 2)]
        plan_tt_linear(PAPER_IN, PAPER_OUT, PAPER_RANKS, 1)
        assert len(costed) == 5
    finally:
        contract._cached_plan.cache_clear()  # no choice costed by the counting stand-in outlives the test


def test_half_merge_flops_batch_part_matches_hand_formula():
    M, N, r = 768, 3072, 30
    by_rows = {}
    for rows in (1, 1000, 4096):
        by_rows[rows] = {c.plan: c for c in plan_costs(PAPER_IN, PAPER_OUT, PAPER_RANKS, rows)}["half_merge"]
    # forward x(B,M) @ L(M,r) then (B,r) @ R(r,N): 2*B*M*r + 2*B*r*N; backward doubles it (3x in total)
    per_row = 3 * (2 * M * r + 2 * r * N)
    assert per_row == 691200
    assert by_rows[4096].flops - by_rows[1000].flops == 3096 * per_row
    assert by_rows[1000].flops - by_rows[1].flops == 999 * per_row
    # the rest (merging L and R, forward + backward) does not depend on the rows and is positive
    setup = by_rows[4096].flops - 4096 * per_row
    assert setup > 0
    # hand count of the merges: L = G1 G2 G3 (12x12 @ 12x240, then 96x30 @ 30x240),
    # R = G4 G5 G6 (360x30 @ 30x256... as (r3*12, 30) @ (30, 16*16), then (5760, 16) @ (16, 16))
    merge_l = 2 * 12 * 12 * (8 * 30) + 2 * 96 * 30 * (8 * 30)
    merge_r = 2 * 360 * 30 * (16 * 16) + 2 * 5760 * 16 * 16
    assert setup == 3 * (merge_l + merge_r)


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("in_modes, out_modes", MODE_CONFIGS, ids=MODE_IDS)
def test_modelled_flops_are_the_flops_each_plan_runs_forward_and_backward(monkeypatch, in_modes, out_modes, rows):
    """The cost model against torch's FlopCounterMode over the plan's own forward and backward. The CPU's zero padding
    of half_merge's bottleneck is a speed choice of the BLAS (bottleneck_padding), not counted: off here."""
    from torch.utils.flop_counter import FlopCounterMode

    from comera_lightning.tt import contract

    monkeypatch.setattr(contract, "bottleneck_padding", lambda rank, device_type: 0)
    torch.manual_seed(0)
    cores, ranks = random_train(in_modes, out_modes, 3, requires_grad=True)
    modelled = {c.plan: c.flops for c in plan_costs(in_modes, out_modes, ranks, rows)}
    for plan in PLANS:
        x = torch.randn(rows, math.prod(in_modes), dtype=F64, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            y = tt_linear(x, cores, in_modes, plan)
            y.backward(torch.ones_like(y))
        assert counter.get_total_flops() == modelled[plan], plan


@pytest.mark.parametrize("padding", [0, 5])
def test_half_merge_copies_the_merged_halves_only_to_pad_them(monkeypatch, padding):
    """Without padding, ``L`` and ``R`` are the merges themselves: the backward keeps the hidden state and the merge
    prefixes, no copy of either half (a copy costs the memory of both halves on every call, on a GPU always)."""
    from comera_lightning.tt import contract

    monkeypatch.setattr(contract, "bottleneck_padding", lambda rank, device_type: padding)
    in_modes, out_modes, rows = [2, 3], [2, 2], 5
    cores, ranks = random_train(in_modes, out_modes, 3)
    x = torch.randn(rows, 6, dtype=F64, requires_grad=True)
    inputs = {t.untyped_storage().data_ptr() for t in [x, *cores]}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            kept[t.untyped_storage().data_ptr()] = t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = tt_linear(x, cores, in_modes, "half_merge")
    r = ranks[2]
    hidden_and_prefixes = [rows * (r + padding), 2 * 3 * r, r * 2 * 2]  # a side's first prefix is a view of its core
    copies = [6 * (r + padding), (r + padding) * 4] if padding else []
    assert sorted(kept.values()) == sorted(hidden_and_prefixes + copies)
    y.sum().backward()
    assert x.grad is not None


def test_dense_plan_cost_counts_full_gemm():
    costs = {c.plan: c for c in plan_costs([4, 4], [4, 4], [1, 4, 16, 4, 1], 10)}
    # the dense plan does a B x M x N GEMM forward and two backward
    assert costs["dense"].flops >= 3 * 2 * 10 * 16 * 16


def test_plan_costs_are_positive():
    for cost in plan_costs(PAPER_IN, PAPER_OUT, PAPER_RANKS, 128):
        assert cost.flops > 0 and cost.bytes_moved > 0 and cost.kernels > 0 and cost.seconds > 0


@pytest.mark.parametrize("plan", PLANS)
def test_bias_gradcheck(plan):
    in_modes, out_modes = [2, 3], [2, 2]
    cores, _ = random_train(in_modes, out_modes, 2)
    x = torch.randn(3, 6, dtype=F64, requires_grad=True)
    bias = torch.randn(4, dtype=F64, requires_grad=True)
    fn = lambda x, b, *c: tt_linear(x, list(c), in_modes, plan, b)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, bias, *cores))


def test_tt_linear_function_direct_apply():
    """TTLinearFunction takes a 2-d input, an optional bias, the plan name and the input modes, then the cores."""
    cores, _ = random_train([3, 2], [2, 2], 2)
    x = torch.randn(4, 6, dtype=F64, requires_grad=True)
    bias = torch.randn(4, dtype=F64)
    for plan in PLANS:
        weight = dense_reference(cores, 2)
        torch.testing.assert_close(TTLinearFunction.apply(x, None, plan, (3, 2), *cores), x @ weight)
        torch.testing.assert_close(TTLinearFunction.apply(x, bias, plan, (3, 2), *cores), x @ weight + bias)


# --- the padded bottleneck of half_merge (a BLAS-friendly rank on the CPU) ----------------------------------
def test_bottleneck_padding_rule():
    from comera_lightning.tt.contract import bottleneck_padding

    assert [bottleneck_padding(r, "cpu") for r in (1, 2, 8, 11, 15, 16, 17, 24, 25, 26, 30, 31, 32, 46, 63)] == [
        0,
        14,
        8,
        5,
        1,
        0,
        0,
        0,
        0,
        6,
        2,
        1,
        0,
        2,
        1,
    ]
    assert bottleneck_padding(30, "cuda") == 0


@pytest.mark.parametrize("in_modes, out_modes, rank, padding", [((6, 8), (8, 6), 30, 2), ((4, 4), (4, 4), 5, 11)])
def test_padded_half_merge_matches_the_dense_reference_and_the_unpadded_path(
    monkeypatch, in_modes, out_modes, rank, padding
):
    import comera_lightning.tt.contract as contract

    cores, ranks = random_train(in_modes, out_modes, rank)
    assert ranks[len(in_modes)] == rank and contract.bottleneck_padding(rank, "cpu") == padding
    gates, masks = random_gates(ranks)
    M, N = math.prod(in_modes), math.prod(out_modes)
    x = torch.randn(5, M, dtype=F64, requires_grad=True)
    bias = torch.randn(N, dtype=F64, requires_grad=True)
    upstream = torch.randn(5, N, dtype=F64)
    params = [x, bias, *cores, *gates]

    def run():
        y = tt_linear(x, apply_gates(cores, gates, masks), in_modes, plan="half_merge", bias=bias)
        return y, torch.autograd.grad((y * upstream).sum(), params)

    y, grads = run()
    weight = dense_reference(gate_by_hand(cores, gates, masks), len(in_modes))
    y_ref = x @ weight + bias
    grads_ref = torch.autograd.grad((y_ref * upstream).sum(), params)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.shape == g_ref.shape
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)

    monkeypatch.setattr(contract, "bottleneck_padding", lambda rank, device_type: 0)
    y_unpadded, grads_unpadded = run()
    torch.testing.assert_close(y, y_unpadded, rtol=1e-13, atol=1e-13)
    for g, g_unpadded in zip(grads, grads_unpadded, strict=True):
        torch.testing.assert_close(g, g_unpadded, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("bias_grad", [True, False, None])
def test_bias_in_a_padded_slice_gives_the_reference_with_and_without_its_gradient(bias_grad):
    # rank 5 pads to 16 on a CPU: the bias rides in the first zero slice (a ones column of the hidden state)
    in_modes, out_modes = (4, 4), (4, 4)
    cores, _ = random_train(in_modes, out_modes, 5)
    x = torch.randn(7, 16, dtype=F64, requires_grad=True)
    bias = None if bias_grad is None else torch.randn(16, dtype=F64, requires_grad=bias_grad)
    y = tt_linear(x, cores, in_modes, plan="half_merge", bias=bias)
    weight = dense_reference(cores, 2)
    torch.testing.assert_close(y, x @ weight + (0 if bias is None else bias), rtol=1e-12, atol=1e-12)
    upstream = torch.randn(7, 16, dtype=F64)
    inputs = [x, *cores] + ([bias] if bias_grad else [])
    grads = torch.autograd.grad((y * upstream).sum(), inputs)
    torch.testing.assert_close(grads[0], upstream @ weight.T, rtol=1e-12, atol=1e-12)
    if bias_grad:
        torch.testing.assert_close(grads[-1], upstream.sum(0), rtol=1e-12, atol=1e-12)
    empty = tt_linear(x[:0], cores, in_modes, plan="half_merge", bias=bias)
    assert empty.shape == (0, 16)


def test_plan_costs_use_the_devices_own_model_and_the_cpus_for_an_unknown_device():
    shape = (PAPER_IN, PAPER_OUT, PAPER_RANKS, 4096)
    cpu, cuda, other = (plan_costs(*shape, device) for device in ("cpu", "cuda", "mps"))
    assert [c.seconds for c in other] == [c.seconds for c in cpu]
    assert all(g.seconds < c.seconds for g, c in zip(cuda, cpu, strict=True))  # a GPU model, far faster per FLOP
    assert [c.flops for c in cuda] == [c.flops for c in cpu]  # the work is the device's to pay, not to change


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_modelled_seconds_are_the_device_models_price_of_the_counted_work(device_type):
    from comera_lightning.tt.contract import _DEVICE_MODELS

    model = _DEVICE_MODELS[device_type]
    for element_bytes in (2, 4):
        costs = plan_costs(PAPER_IN, PAPER_OUT, PAPER_RANKS, 64, device_type, element_bytes)
        for c in costs:
            price = (
                c.flops / model.flops_per_s + c.bytes_moved / model.bytes_per_s + c.kernels * model.seconds_per_kernel
            )
            assert c.seconds == pytest.approx(price, rel=1e-12), c.plan
    # half the bytes per element halves the memory traffic and leaves the rest
    halves = zip(
        plan_costs(PAPER_IN, PAPER_OUT, PAPER_RANKS, 64, device_type, 2),
        plan_costs(PAPER_IN, PAPER_OUT, PAPER_RANKS, 64, device_type, 4),
        strict=True,
    )
    for half, full in halves:
        assert 2 * half.bytes_moved == full.bytes_moved and (half.flops, half.kernels) == (full.flops, full.kernels)


def test_plan_costs_price_float32_by_default():
    assert plan_costs(PAPER_IN, PAPER_OUT, PAPER_RANKS, 64) == plan_costs(
        PAPER_IN, PAPER_OUT, PAPER_RANKS, 64, "cpu", 4
    )


# --- what runs: the planner's question, which inputs get gradients, and the kernels a call costs ------------
def test_the_planner_is_asked_about_this_calls_modes_ranks_rows_device_and_element_size(monkeypatch):
    """With no plan given, the plan is chosen for the call's own shapes: both sides' modes, every bond's rank (the
    boundary ones included), the rows after flattening the leading dimensions, the device and the compute dtype's
    size (bf16 under autocast)."""
    import inspect

    from comera_lightning.tt import contract

    asked = []

    def recording_planner(*args, **kwargs):
        bound = inspect.signature(plan_tt_linear).bind(*args, **kwargs)
        bound.apply_defaults()
        asked.append({name: tuple(v) if isinstance(v, list | tuple) else v for name, v in bound.arguments.items()})
        return plan_tt_linear(*args, **kwargs)

    monkeypatch.setattr(contract, "plan_tt_linear", recording_planner)
    # modes, ranks and rows all differ, so a mode read as a rank (or rows as features) shows
    cores, ranks = random_train([3, 4], [5, 2], [2, 7, 2])
    assert ranks == [1, 2, 7, 2, 1]
    for dtype, size in [(F64, 8), (torch.float32, 4)]:
        x = torch.randn(2, 3, 12, dtype=dtype)
        y = tt_linear(x, [c.to(dtype) for c in cores], [3, 4])
        torch.testing.assert_close(y, x @ dense_reference(cores, 2).to(dtype))
        assert asked.pop() == {
            "in_modes": (3, 4),
            "out_modes": (5, 2),
            "ranks": (1, 2, 7, 2, 1),
            "rows": 6,
            "device_type": "cpu",
            "element_bytes": size,
        }
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tt_linear(torch.randn(6, 12), [c.float() for c in cores], [3, 4])
    assert asked.pop()["element_bytes"] == 2
    assert not asked


@pytest.mark.parametrize("trainable", ["input", "bias", "cores"])
@pytest.mark.parametrize("plan", [*PLANS, None])
def test_whichever_single_input_is_trainable_gets_its_gradient(plan, trainable):
    """Only the input (a frozen layer inside a network), only the bias (bias tuning) or only the cores (the first
    layer, fed data) requires grad: the call records the plan's own backward (TTLinearFunction, not autograd of the
    forward's ops, which keeps more) and that one input gets the reference gradient."""
    torch.manual_seed(0)
    in_modes = [2, 3]
    cores, _ = random_train(in_modes, [2, 2], 2, requires_grad=trainable == "cores")
    x = torch.randn(5, 6, dtype=F64, requires_grad=trainable == "input")
    bias = torch.randn(4, dtype=F64, requires_grad=trainable == "bias")
    leaves = {"input": [x], "bias": [bias], "cores": cores}[trainable]
    upstream = torch.randn(5, 4, dtype=F64)

    y = tt_linear(x, cores, in_modes, plan, bias)
    assert "TTLinearFunctionBackward" in _graph_nodes(y)
    grads = torch.autograd.grad((y * upstream).sum(), leaves)
    y_ref = x @ dense_reference(cores, 2) + bias
    grads_ref = torch.autograd.grad((y_ref * upstream).sum(), leaves)
    torch.testing.assert_close(y, y_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref)


def _graph_nodes(y):
    """The names of the autograd nodes behind ``y``."""
    names, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node.name() not in names:
            names.add(node.name())
            todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def _aten_ops(fn):
    """The aten ops ``fn()`` runs, as (name, input shapes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ran = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            ran.append((func.overloadpacket.__name__, shapes))
            return func(*args, **(kwargs or {}))

    with Recorder():
        fn()
    return ran


@pytest.mark.parametrize("rank, padded", [(5, 16), (15, 16), (16, 16), (1, 1)])
def test_half_merge_on_a_cpu_runs_its_bottleneck_gemms_at_the_padded_rank(rank, padded):
    """On a CPU the hidden state of half_merge is ``bottleneck_padding`` wider (ranks 2-15 run at 16)."""
    in_modes = (4, 4)
    cores, _ = random_train(in_modes, (4, 4), [4, rank, 4])
    x = torch.randn(7, 16, dtype=F64, requires_grad=True)
    ran = _aten_ops(lambda: tt_linear(x, cores, in_modes, "half_merge"))
    assert ("mm", ((7, 16), (16, padded))) in ran  # x @ L
    assert ("mm", ((7, padded), (padded, 16))) in ran  # (x L) @ R


@pytest.mark.parametrize("rank", [5, 15])  # padded by 11 and by exactly 1
@pytest.mark.parametrize("bias_grad", [True, False])
def test_a_bias_in_the_padding_slot_costs_no_kernel_of_its_own(rank, bias_grad):
    """With a padded bottleneck the bias rides in the first zero slice: the GEMM adds it (no addmm, whose broadcast
    copies the bias into the output) and the backward's GEMM for R sums its gradient (no separate reduction)."""
    torch.manual_seed(0)
    in_modes = (4, 4)
    cores, _ = random_train(in_modes, (4, 4), [4, rank, 4])
    x = torch.randn(7, 16, dtype=F64, requires_grad=True)
    bias = torch.randn(16, dtype=F64, requires_grad=bias_grad)
    upstream = torch.randn(7, 16, dtype=F64)
    leaves = [x, *cores] + ([bias] if bias_grad else [])
    out = {}

    def step():
        out["y"] = y = tt_linear(x, cores, in_modes, "half_merge", bias)
        out["grads"] = torch.autograd.grad(y, leaves, upstream)  # no loss reduction of our own

    ran = {name for name, _ in _aten_ops(step)}
    assert "addmm" not in ran and "sum" not in ran
    weight = dense_reference(cores, 2)
    torch.testing.assert_close(out["y"], x @ weight + bias, rtol=1e-12, atol=1e-12)
    grads_ref = torch.autograd.grad(((x @ weight + bias) * upstream).sum(), leaves)
    for g, g_ref in zip(out["grads"], grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("plan", PLANS)
def test_a_frozen_input_costs_no_input_gradient_gemm(plan):
    """The first layer's input is data: its backward skips the GEMM that would give the input's gradient."""
    in_modes = [2, 3]
    cores, _ = random_train(in_modes, [2, 2], 2)
    data = torch.randn(5, 6, dtype=F64)

    def gemms(x):
        y = tt_linear(x, cores, in_modes, plan)
        leaves = [x, *cores] if x.requires_grad else cores
        ran = _aten_ops(lambda: torch.autograd.grad(y.sum(), leaves))
        return sum(name in ("mm", "addmm", "bmm") for name, _ in ran)

    assert gemms(data) == gemms(data.clone().requires_grad_()) - 1


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_without_grad_a_two_core_train_compiles_whole(no_grad):
    """Without grad no autograd Function runs, even for inputs that require grad: torch.compile traces the
    contraction of a two-core train (a low-rank head) whole, where it cannot trace the Function."""
    torch._dynamo.reset()
    cores, _ = random_train([6], [5], 3)
    x = torch.randn(4, 6, dtype=F64, requires_grad=True)
    with no_grad():
        y = torch.compile(lambda x: tt_linear(x, cores, [6], "half_merge"), backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(y, x.detach() @ dense_reference(cores, 1))
