"""The per-step functions of the rank objective and the layers' format-dependent sizes, in float64."""

from __future__ import annotations

import copy

import pytest
import torch

from comera_lightning import TTEmbedding, TTLinear
from comera_lightning.rank_adaptation.objectives import (
    ObjectiveWeights,
    add_rank_objective_,
    all_finite,
    early_stage_weights,
    late_stage_weights,
    layers_to_truncate,
    rank_gates,
    rank_penalty,
    refresh_masks_,
    truncate_dead_slices_,
)
from comera_lightning.tt import bond_weights, minimum_train_size, train_parameter_count

F64 = torch.float64


def _layers() -> list:
    torch.manual_seed(0)
    linear = TTLinear(12, 10, 4, in_modes=[3, 4], out_modes=[2, 5]).to(F64)
    embedding = TTEmbedding(24, 6, rank=3, vocab_modes=[4, 6], dim_modes=[2, 3]).to(F64)
    with torch.no_grad():
        for layer in (linear, embedding):
            for gate in layer.gates:
                gate.uniform_(0.5, 1.5)
    return [linear, embedding]


def test_layer_sizes_follow_the_active_ranks():
    for layer in _layers():
        assert layer.slice_parameters() == bond_weights(layer.mode_sizes, layer.active_ranks)
        assert layer.minimum_parameters() == minimum_train_size(layer.mode_sizes)
        layer.remove_slices_(0, [0])
        # one slice of a bond holds what removing it frees
        ranks = layer.active_ranks
        before = train_parameter_count(layer.mode_sizes, [r + (k == 1) for k, r in enumerate(ranks)])
        assert before - layer.active_parameters() == layer.slice_parameters()[0]
        assert layer.minimum_parameters() == train_parameter_count(layer.mode_sizes, [1] * len(ranks))


def test_rank_gates_lists_every_bond_or_only_the_trainable_ones():
    layers = _layers()
    gates, masks, sizes = rank_gates(layers)
    assert [id(g) for g in gates] == [id(g) for layer in layers for g in layer.gates]
    assert [id(m) for m in masks] == [id(m) for layer in layers for m in layer.rank_masks]
    assert sizes == [w for layer in layers for w in layer.slice_parameters()]
    gates, _, sizes = rank_gates(layers, trainable=list(layers[1].parameters()))
    assert [id(g) for g in gates] == [id(g) for g in layers[1].gates]
    assert sizes == layers[1].slice_parameters()


def test_all_finite():
    assert all_finite([]) and all_finite([None])
    assert all_finite([torch.ones(3, dtype=F64), None, torch.zeros(2)])
    assert not all_finite([torch.ones(3, dtype=F64), torch.tensor([1.0, float("nan")], dtype=F64)])
    assert not all_finite([torch.tensor([float("inf")], dtype=F64)])


@pytest.mark.parametrize(
    "weights, weighted",
    [
        (ObjectiveWeights(1.0, 0.3), True),
        (ObjectiveWeights(2.0, 0.5), True),
        (ObjectiveWeights(0.1, 1.01, 1.0), True),
        (ObjectiveWeights(0.1, 1.01, 1.0), False),
    ],
)
def test_add_rank_objective_gives_the_gradient_of_the_weighted_sum(weights, weighted):
    layers = _layers()
    layers[0].remove_slices_(1, [2])
    x, ids = torch.randn(5, 12, dtype=F64), torch.tensor([0, 7, 23, 7])

    def task_loss(layers):
        return layers[0](x).pow(2).sum() + layers[1](ids).pow(2).sum()

    reference = copy.deepcopy(layers)
    task_loss(layers).backward()
    params = [p for layer in layers for p in layer.parameters()]
    gates, masks, sizes = rank_gates(layers)
    penalty = add_rank_objective_(params, gates, masks, weights, sizes if weighted else None)

    ref_gates, ref_masks, ref_sizes = rank_gates(reference)
    ref_penalty = rank_penalty(ref_gates, ref_masks, ref_sizes if weighted else None)
    (weights.task * task_loss(reference) + weights.penalty * ref_penalty).backward()
    assert penalty == pytest.approx(float(ref_penalty.detach()), rel=1e-12)
    for p, q in zip(params, [p for layer in reference for p in layer.parameters()], strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_rank_penalty_is_a_weighted_mean_over_active_entries_whatever_the_unit_of_the_weights():
    gates = [torch.tensor([0.5, -0.25, 1.0], dtype=F64), torch.tensor([0.4, 0.2], dtype=F64)]
    masks = [torch.tensor([True, True, False]), torch.tensor([True, True])]
    assert float(rank_penalty(gates[:1], masks[:1])) == pytest.approx(0.375, rel=1e-15)  # one bond: (0.5 + 0.25) / 2
    weighted = (2.0 * 0.75 + 1.0 * 0.6) / (2.0 * 2 + 1.0 * 2)
    for unit in (1.0, 1e-3, 1e3):  # weights are relative: parameters or thousands of parameters give one value
        assert float(rank_penalty(gates, masks, [2.0 * unit, 1.0 * unit])) == pytest.approx(weighted, rel=1e-12)


def test_rank_penalty_refuses_mismatched_or_empty_bonds_with_its_message():
    gate, mask = torch.ones(3, dtype=F64), torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^gates, masks and weights must have one entry per bond$"):
        rank_penalty([gate], [mask, mask])
    with pytest.raises(ValueError, match=r"^gates, masks and weights must have one entry per bond$"):
        rank_penalty([gate], [mask], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"^rank_penalty needs at least one gate; the model has no comera layers$"):
        rank_penalty([], [])


def test_early_stage_weights_are_the_loss_plus_gamma_times_the_penalty():
    assert early_stage_weights(0.3) == ObjectiveWeights(task=1.0, penalty=0.3, lam=0.0)


def test_late_stage_weights_push_whichever_objective_is_relatively_further_from_its_target():
    # the loss 5 % above its target, the size 50 % above its: push the size, (1.1 - 1) L + (0.01 + 1) R
    weights = late_stage_weights(loss=2.0, size=100.0, target_loss=1.9, target_size=50.0)
    assert (weights.task, weights.penalty, weights.lam) == pytest.approx((0.1, 1.01, 1.0))
    # the loss 50 % above its target, the size 10 %: push the loss, 1.1 L + 0.01 R
    weights = late_stage_weights(loss=2.0, size=100.0, target_loss=1.0, target_size=90.0)
    assert (weights.task, weights.penalty, weights.lam) == pytest.approx((1.1, 0.01, 0.0))
    # equally far (both 50 %): the size is not relatively further, so the loss is pushed
    assert late_stage_weights(2.0, 100.0, 1.0, 50.0).lam == 0.0
    weights = late_stage_weights(2.0, 100.0, 1.9, 50.0, task_base=3.0, penalty_base=0.5)
    assert (weights.task, weights.penalty, weights.lam) == pytest.approx((2.0, 1.5, 1.0))
    # the gaps are relative: the units of the loss and of the size (a count, a share of the dense size) do not
    # change the decision
    for loss_unit, size_unit in [(1e-3, 1.0), (1e3, 1.0), (1.0, 1e-4), (1.0, 1e4)]:
        assert late_stage_weights(2.0 * loss_unit, 100.0 * size_unit, 1.9 * loss_unit, 50.0 * size_unit).lam == 1.0
        assert late_stage_weights(2.0 * loss_unit, 100.0 * size_unit, 1.0 * loss_unit, 90.0 * size_unit).lam == 0.0


def test_add_rank_objective_fills_missing_gate_gradients():
    layers = _layers()
    gates, masks, sizes = rank_gates(layers)
    add_rank_objective_([], gates, masks, ObjectiveWeights(1.0, 2.0), sizes)
    normaliser = sum(w * float(m.sum()) for w, m in zip(sizes, masks, strict=True))
    for gate, mask, w in zip(gates, masks, sizes, strict=True):
        torch.testing.assert_close(gate.grad, 2.0 * w * torch.sign(gate.detach()) * mask / normaliser)


def test_refresh_masks_uses_the_given_or_each_layers_threshold():
    layers = _layers()
    with torch.no_grad():
        for layer in layers:
            layer.gates[0][:2] = torch.tensor([0.005, 0.2], dtype=F64)
    refresh_masks_(layers)  # the layers' own threshold, 1e-2
    assert [layer.rank_masks[0][:2].tolist() for layer in layers] == [[False, True]] * 2
    refresh_masks_(layers, threshold=0.3)
    assert [layer.rank_masks[0][:2].tolist() for layer in layers] == [[False, False]] * 2


def test_truncate_dead_slices_only_where_enough_died_and_keeps_the_function():
    linear, embedding = layers = _layers()
    linear.remove_slices_(1, [1, 3])  # half of bond 1 of rank 4
    embedding.remove_slices_(0, [2])  # a third of bond 0 of rank 3
    x, ids = torch.randn(5, 12, dtype=F64), torch.tensor([0, 7, 23])
    y, e = linear(x), embedding(ids)
    ranks = embedding.ranks
    record = truncate_dead_slices_(layers, min_dead_fraction=0.4)
    assert {id(p) for p, _ in record} == {id(p) for p in [*linear.cores, *linear.gates]}
    assert linear.ranks == linear.active_ranks and embedding.ranks == ranks
    torch.testing.assert_close(linear(x), y, rtol=1e-12, atol=1e-14)
    record = truncate_dead_slices_(layers, min_dead_fraction=0.3)
    assert embedding.ranks == embedding.active_ranks != ranks and linear.ranks == linear.active_ranks
    assert {id(p) for p, _ in record} == {id(p) for p in [*embedding.cores, *embedding.gates]}
    torch.testing.assert_close(embedding(ids), e, rtol=1e-12, atol=1e-14)
    assert not truncate_dead_slices_(layers, min_dead_fraction=0.01)


def test_layers_to_truncate_lists_the_layers_with_enough_of_one_bond_masked_and_never_one_without_bonds():
    linear, embedding = _layers()
    single = TTEmbedding(50, 8, rank=4, vocab_modes=[50], dim_modes=[8]).to(F64)  # one core, no internal bond
    assert single.num_bonds == 0
    linear.remove_slices_(1, [1, 3])  # half of bond 1 of rank 4
    assert layers_to_truncate([linear, embedding, single], 0.5) == [linear]
    assert layers_to_truncate([single], 1e-9) == [] and layers_to_truncate([embedding], 1e-9) == []


@pytest.mark.parametrize(
    "rank, dead, fraction",
    [(10, 1, 0.1), (4, 1, 0.25), (3, 2, 2 / 3), (10, 3, 0.3)],  # 1 - 9 / 10 is 0.09999999999999998 in floats
)
def test_a_bond_with_exactly_min_dead_fraction_of_its_slices_masked_is_truncated(rank, dead, fraction):
    torch.manual_seed(0)
    layer = TTLinear(20, 20, rank, in_modes=[4, 5], out_modes=[4, 5]).to(F64)
    assert layer.ranks[2] == rank
    layer.remove_slices_(1, list(range(dead)))
    x = torch.randn(3, 20, dtype=F64)
    y = layer(x)
    assert not truncate_dead_slices_([layer], min_dead_fraction=fraction + 1e-9)  # just above: nothing moves
    assert layer.ranks[2] == rank
    record = truncate_dead_slices_([layer], min_dead_fraction=fraction)  # exactly the fraction: "or more"
    assert record and layer.ranks[2] == rank - dead == layer.active_ranks[2]
    torch.testing.assert_close(layer(x), y, rtol=1e-12, atol=1e-14)
