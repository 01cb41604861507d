"""Rank masks, physical truncation and checkpoints of TTLinear / TTEmbedding."""

from __future__ import annotations

import pytest
import torch
from helpers.nn_reference import F64, randomize_gates_, reference_embedding_table, reference_linear_weight
from torch import nn

from comera_lightning.nn import TruncationRecord, TTEmbedding, TTLinear
from comera_lightning.tt import PLANS, CoreSelection, select_rank_slices


def linear_layer(seed=0, **kw):
    torch.manual_seed(seed)
    layer = TTLinear(24, 12, 4, in_modes=[2, 3, 4], out_modes=[3, 4], dtype=F64, **kw)
    with torch.no_grad():
        layer.bias.normal_()
    return randomize_gates_(layer)


def embedding_layer(seed=0, **kw):
    torch.manual_seed(seed)
    layer = TTEmbedding(24, 8, 4, vocab_modes=[2, 3, 4], dim_modes=[2, 2, 2], dtype=F64, **kw)
    return randomize_gates_(layer)


def linear_input():
    return torch.randn(2, 3, 24, dtype=F64)


def embedding_input():
    return torch.tensor([[0, 5, 23, 7], [7, 7, 12, 1]])


KINDS = {
    "linear": (linear_layer, linear_input, reference_linear_weight),
    "embedding": (embedding_layer, embedding_input, reference_embedding_table),
}


def reference_output(kind, layer, inputs):
    if kind == "linear":
        return inputs @ reference_linear_weight(layer).T + layer.bias
    return reference_embedding_table(layer)[inputs]


def kill_(layer, bond, slices, value=5e-3):
    with torch.no_grad():
        for j in slices:
            layer.gates[bond][j] = value


@pytest.mark.parametrize("kind", KINDS)
def test_comera_parameters_lists_cores_then_gates(kind):
    layer = KINDS[kind][0]()
    pairs = list(layer.comera_parameters())
    assert [k for k, _ in pairs] == ["core"] * len(layer.cores) + ["gate"] * len(layer.gates)
    assert [id(p) for _, p in pairs] == [id(p) for p in [*layer.cores, *layer.gates]]
    assert len(layer.gates) == len(layer.cores) - 1 == layer.num_bonds


# --- masks ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_refresh_masks_switches_off_small_gates(kind):
    make, _, _ = KINDS[kind]
    layer = make()
    full_ranks = [1, 2, 4, 4, 4, 1] if kind == "linear" else [1, 4, 4, 1]
    assert layer.ranks == full_ranks
    kill_(layer, 1, [0, 3])
    with torch.no_grad():
        layer.gates[0][1] = -0.01  # exactly tau in magnitude: off
    active = layer.refresh_masks_()
    assert active == layer.active_ranks
    assert layer.rank_masks[1].tolist() == [False, True, True, False]
    assert layer.rank_masks[0][1].item() is False
    assert layer.ranks == full_ranks  # nothing removed yet
    # dead slices stay dead even when the gate grows back
    with torch.no_grad():
        layer.gates[1][0] = 1.0
    layer.refresh_masks_()
    assert layer.rank_masks[1][0].item() is False


def test_refresh_masks_explicit_threshold():
    layer = linear_layer()
    with torch.no_grad():
        layer.gates[1].copy_(torch.tensor([0.1, 0.3, 0.6, 0.9]))
    layer.refresh_masks_(threshold=0.5)
    assert layer.rank_masks[1].tolist() == [False, False, True, True]
    assert layer.rank_threshold == 1e-2  # unchanged


@pytest.mark.parametrize("kind", KINDS)
def test_masked_slices_do_not_contribute(kind):
    make, make_input, _ = KINDS[kind]
    layer = make()
    inputs = make_input()
    kill_(layer, 1, [2], value=0.0)  # gate exactly 0: output identical with or without the mask
    before = layer(inputs)
    with torch.no_grad():
        layer.gates[1][2] = 1e-3
    layer.refresh_masks_()
    torch.testing.assert_close(layer(inputs), before, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        layer.gates[1][2] = 50.0  # masked: the gate value no longer matters
    torch.testing.assert_close(layer(inputs), before, rtol=1e-12, atol=1e-12)


# --- truncation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, plan", [("embedding", None), *[("linear", plan) for plan in (None, *PLANS)]])
def test_truncate_keeps_the_function_and_shrinks(kind, plan):
    make, make_input, _ = KINDS[kind]
    layer = make()
    if plan is not None:
        layer.set_contraction_plan(plan)
    inputs = make_input()
    kill_(layer, 1, [0, 2])
    kill_(layer, len(layer.gates) - 1, [3])
    layer.refresh_masks_()
    old_ranks, old_active = layer.ranks, layer.active_ranks
    old_shapes = [tuple(c.shape) for c in layer.cores]
    masked_out = layer(inputs).detach()
    active_params = layer.active_parameters()
    assert layer.allocated_parameters() > active_params

    core_ids = [id(c) for c in layer.cores]
    record = layer.truncate_()

    assert isinstance(record, TruncationRecord)
    assert layer.ranks == old_active and layer.active_ranks == old_active
    assert layer.ranks != old_ranks
    assert [id(c) for c in layer.cores] == core_ids  # same Parameter objects (optimiser groups stay valid)
    for k, core in enumerate(layer.cores):
        assert core.shape[0] == old_active[k] and core.shape[-1] == old_active[k + 1]
        assert core.shape[1:-1] == old_shapes[k][1:-1]
    for k, (gate, mask) in enumerate(zip(layer.gates, layer.rank_masks, strict=True)):
        assert gate.numel() == mask.numel() == old_active[k + 1] and bool(mask.all())
    assert layer.allocated_parameters() == layer.active_parameters() == active_params
    torch.testing.assert_close(layer(inputs), masked_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer(inputs), reference_output(kind, layer, inputs), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_after_truncation(kind):
    make, make_input, _ = KINDS[kind]
    layer = make()
    inputs = make_input()
    kill_(layer, 0, [1]) if kind == "linear" else kill_(layer, 0, [1, 2])
    kill_(layer, 1, [0, 3])
    layer.refresh_masks_()
    upstream = torch.randn(*layer(inputs).shape, dtype=F64)

    # gradients of the masked layer, restricted to the surviving slices ...
    grads_masked = torch.autograd.grad((layer(inputs) * upstream).sum(), [*layer.cores, *layer.gates])
    keeps = [torch.nonzero(m).flatten() for m in layer.rank_masks]
    num = len(layer.cores)
    sels = [CoreSelection(keeps[k - 1] if k else None, keeps[k] if k < num - 1 else None) for k in range(num)]
    sels += [CoreSelection(None, keep) for keep in keeps]
    expected = [select_rank_slices(g, s) for g, s in zip(grads_masked, sels, strict=True)]

    layer.truncate_()
    params = [*layer.cores, *layer.gates]
    grads = torch.autograd.grad((layer(inputs) * upstream).sum(), params)
    grads_ref = torch.autograd.grad((reference_output(kind, layer, inputs) * upstream).sum(), params)
    for g, e, r in zip(grads, expected, grads_ref, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)  # ... equal the truncated layer's
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)  # and the dense reference's


def test_gradcheck_after_truncation():
    layer = linear_layer()
    kill_(layer, 1, [1, 2])
    layer.refresh_masks_()
    layer.truncate_()
    names = [n for n, _ in layer.named_parameters()]
    values = [p.detach().clone().double().requires_grad_() for _, p in layer.named_parameters()]
    x = torch.randn(2, 24, dtype=F64, requires_grad=True)
    for plan in PLANS:
        layer.set_contraction_plan(plan)
        fn = lambda x, *v: torch.func.functional_call(layer, dict(zip(names, v, strict=True)), (x,))  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, *values), fast_mode=True)


def test_truncate_slices_existing_grads_and_record():
    layer = linear_layer()
    layer(linear_input()).sum().backward()
    old_grads = [p.grad.clone() for p in [*layer.cores, *layer.gates]]
    fake_state = [torch.randn_like(p) for p in [*layer.cores, *layer.gates]]  # e.g. AdamW exp_avg
    kill_(layer, 1, [1])
    layer.refresh_masks_()
    record = layer.truncate_()
    params = [*layer.cores, *layer.gates]
    assert [id(p) for p, _ in record] == [id(p) for p in params]
    keep = torch.tensor([0, 2, 3])
    for (param, selection), old_grad, state in zip(record, old_grads, fake_state, strict=True):
        assert param.grad.shape == param.shape
        torch.testing.assert_close(param.grad, select_rank_slices(old_grad, selection))
        assert select_rank_slices(state, selection).shape == param.shape
    # bond 1 sits between cores 1 and 2 and is gate 1
    torch.testing.assert_close(layer.cores[1].grad, old_grads[1][..., keep])
    torch.testing.assert_close(layer.cores[2].grad, old_grads[2][keep])
    torch.testing.assert_close(layer.gates[1].grad, old_grads[len(layer.cores) + 1][keep])


@pytest.mark.parametrize("kind", KINDS)
def test_truncate_without_masked_slices_is_a_no_op(kind):
    layer = KINDS[kind][0]()
    ranks, cores = layer.ranks, [c.detach().clone() for c in layer.cores]
    assert layer.truncate_() == []
    assert layer.ranks == ranks
    assert all(torch.equal(a, b) for a, b in zip(cores, layer.cores, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_bond_whose_gates_all_die_keeps_one_slice(kind):
    make, make_input, _ = KINDS[kind]
    layer = make()
    with torch.no_grad():
        layer.gates[1].copy_(torch.tensor([1e-3, -8e-3, 2e-3, 5e-4]))
    active = layer.refresh_masks_()
    assert active[2] == 1
    assert layer.rank_masks[1].tolist() == [False, True, False, False]  # the largest |gate| survives
    inputs = make_input()
    before = layer(inputs).detach()
    assert before.abs().sum() > 0
    layer.truncate_()
    assert layer.ranks[2] == 1 and layer.gates[1].numel() == 1
    torch.testing.assert_close(layer.gates[1].detach(), torch.tensor([-8e-3]))
    torch.testing.assert_close(layer(inputs), before, rtol=1e-12, atol=1e-12)
    # and it stays: an even smaller gate still cannot empty the bond
    with torch.no_grad():
        layer.gates[1].zero_()
    assert layer.refresh_masks_()[2] == 1


def test_repeated_truncation():
    layer = linear_layer()
    x = linear_input()
    kill_(layer, 1, [0])
    layer.refresh_masks_()
    layer.truncate_()
    kill_(layer, 1, [1])  # index within the already truncated bond
    layer.refresh_masks_()
    expected = layer(x).detach()
    layer.truncate_()
    assert layer.ranks[2] == 2
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


# --- checkpoints ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_across_truncation(kind):
    make, make_input, _ = KINDS[kind]
    layer = make(seed=0)
    kill_(layer, 0, [1])
    kill_(layer, 1, [0, 3])
    layer.refresh_masks_()
    layer.truncate_()
    inputs = make_input()
    expected = layer(inputs)
    state = layer.state_dict()

    fresh = make(seed=1)  # full rank, different weights
    assert fresh.ranks != layer.ranks
    assert not torch.allclose(fresh(inputs), expected)
    fresh.load_state_dict(state)
    assert fresh.ranks == layer.ranks and fresh.active_ranks == layer.active_ranks
    assert [g.numel() for g in fresh.gates] == [g.numel() for g in layer.gates]
    torch.testing.assert_close(fresh(inputs), expected, rtol=0, atol=0)
    # the loaded layer trains: gradients have the truncated shapes
    fresh(inputs).sum().backward()
    assert all(p.grad.shape == p.shape for p in fresh.parameters())


def test_state_dict_round_trip_with_masks_but_no_truncation():
    layer = linear_layer(seed=0)
    kill_(layer, 1, [2])
    layer.refresh_masks_()
    fresh = linear_layer(seed=1)
    fresh.load_state_dict(layer.state_dict())
    assert fresh.rank_masks[1].tolist() == [True, True, False, True]
    x = linear_input()
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)


def test_truncated_layer_loads_full_rank_checkpoint():
    full = linear_layer(seed=0)
    state = {k: v.clone() for k, v in full.state_dict().items()}
    layer = linear_layer(seed=1)
    kill_(layer, 1, [0, 1])
    layer.refresh_masks_()
    layer.truncate_()
    layer.load_state_dict(state)
    assert layer.ranks == full.ranks
    x = linear_input()
    torch.testing.assert_close(layer(x), full(x), rtol=0, atol=0)


def test_round_trip_inside_a_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        TTEmbedding(24, 8, 4, vocab_modes=[2, 3, 4], dim_modes=[2, 2, 2], dtype=F64),
        TTLinear(8, 6, 3, in_modes=[2, 4], out_modes=[3, 2], dtype=F64),
    )
    for layer in model:
        randomize_gates_(layer)
        kill_(layer, 0, [0])
        layer.refresh_masks_()
        layer.truncate_()
    ids = embedding_input()
    torch.manual_seed(1)
    fresh = nn.Sequential(
        TTEmbedding(24, 8, 4, vocab_modes=[2, 3, 4], dim_modes=[2, 2, 2], dtype=F64),
        TTLinear(8, 6, 3, in_modes=[2, 4], out_modes=[3, 2], dtype=F64),
    )
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh(ids), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_with_wrong_modes(kind):
    if kind == "linear":
        source = TTLinear(24, 12, 3, in_modes=[4, 3, 2], out_modes=[3, 4])
        target = TTLinear(24, 12, 3, in_modes=[2, 3, 4], out_modes=[3, 4])
    else:
        source = TTEmbedding(24, 8, 3, vocab_modes=[4, 3, 2], dim_modes=[2, 2, 2])
        target = TTEmbedding(24, 8, 3, vocab_modes=[2, 3, 4], dim_modes=[2, 2, 2])
    with pytest.raises(ValueError, match=r"mode sizes.*build the model with the modes"):
        target.load_state_dict(source.state_dict())


def test_checkpoint_with_a_different_number_of_modes():
    source = TTLinear(24, 12, 3, in_modes=[4, 6], out_modes=[12])
    target = TTLinear(24, 12, 3, in_modes=[2, 3, 4], out_modes=[3, 4])
    with pytest.raises(
        ValueError, match="from a different architecture; build the layer with the modes it was trained with"
    ):
        target.load_state_dict(source.state_dict())
    with pytest.raises(
        ValueError, match="from a different architecture; build the layer with the modes it was trained with"
    ):
        source.load_state_dict(target.state_dict())


def test_checkpoint_with_ranks_above_the_bound():
    # modes [4, 3 | 2, 5] allow at most [1, 4, 10, 5, 1]; this checkpoint has 11 on bond 2
    layer = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5])
    assert layer.max_ranks == [1, 4, 10, 5, 1]
    ranks = [1, 4, 11, 5, 1]
    state = layer.state_dict()
    for k, s in enumerate([4, 3, 2, 5]):
        state[f"cores.{k}"] = torch.randn(ranks[k], s, ranks[k + 1])
    for k in range(3):
        state[f"gates.{k}"] = torch.ones(ranks[k + 1])
        state[f"rank_mask_{k}"] = torch.ones(ranks[k + 1], dtype=torch.bool)
    # no layer with these modes can hold rank 11 on bond 2, so the fix is about modes, not about ranks
    with pytest.raises(ValueError, match=r"(?s)exceed.*maximum.*modes"):
        layer.load_state_dict(state)


def test_checkpoint_with_inconsistent_ranks():
    layer = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5])
    state = layer.state_dict()
    state["cores.1"] = torch.randn(2, 3, 3)  # core 0 ends with rank 3
    with pytest.raises(ValueError, match=r"inconsistent ranks: .*; the checkpoint is damaged or was edited"):
        layer.load_state_dict(state)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_truncate_to_share_keeps_leading_slices_and_the_masked_function(kind):
    layer = linear_layer() if kind == "linear" else embedding_layer()
    before = list(layer.ranks)
    with torch.no_grad():  # the function the pruned layer must keep: trailing gates zeroed, nothing removed
        for gate in layer.gates:
            gate[max(1, round(0.5 * gate.numel())) :] = 0.0
    inputs = (linear_input if kind == "linear" else embedding_input)()
    expected = layer(inputs)
    kept_gates = [g[: max(1, round(0.5 * g.numel()))].clone() for g in layer.gates]
    record = layer.truncate_to_share_(0.5)
    assert layer.ranks == [1] + [max(1, round(0.5 * r)) for r in before[1:-1]] + [1]
    assert len(record) > 0
    for gate, kept in zip(layer.gates, kept_gates, strict=True):
        torch.testing.assert_close(gate.detach(), kept)
    torch.testing.assert_close(layer(inputs), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer(inputs), reference_output(kind, layer, inputs), rtol=1e-10, atol=1e-12)


def test_truncate_to_share_rounds_each_bond_to_the_nearest_slice():
    # ranks 2, 4, 4, 4: a share of 0.7 keeps 1.4 and 2.8 slices, rounded to 1 and 3 (a floor would keep 2 of 4);
    # 0.6 keeps 1.2 and 2.4, so 1 and 2
    for keep, kept in ((0.7, 3), (0.6, 2)):
        layer = linear_layer()
        assert layer.ranks == [1, 2, 4, 4, 4, 1]
        layer.truncate_to_share_(keep)
        assert layer.ranks == [1, 1, kept, kept, kept, 1] and layer.active_ranks == layer.ranks


def test_truncate_to_share_keeps_one_slice_and_refuses_bad_shares():
    layer = linear_layer()
    layer.truncate_to_share_(0.0)
    assert layer.ranks[1:-1] == [1] * (len(layer.ranks) - 2)
    with pytest.raises(ValueError, match=r"share in \[0, 1\]"):
        layer.truncate_to_share_(1.5)


def test_removed_slices_are_off_for_good_gate_zeroed_and_masked():
    # the mask keeps them out of the forward; the zeroed gate keeps them out of whatever reads the gates (a saved
    # checkpoint, the importance of a slice, masks rebuilt from the gates)
    torch.manual_seed(0)
    layer = TTLinear(16, 16, rank=4, in_modes=[4, 4], out_modes=[4, 4])
    before = layer.gates[1].detach().clone()
    layer.remove_slices_(1, [0, 2])
    assert layer.rank_masks[1].tolist() == [False, True, False, True]
    assert layer.gates[1].detach()[[0, 2]].tolist() == [0.0, 0.0]
    torch.testing.assert_close(layer.gates[1].detach()[[1, 3]], before[[1, 3]])
