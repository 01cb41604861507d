"""The late stage: the size-target rule, the scheduled policy's functions and its bounded cuts in training."""

from __future__ import annotations

import math
import re
import warnings
from itertools import pairwise

import pytest
import torch
from lightning.pytorch import Trainer
from tiny import TinyRegressor, regression_loader

from comera_lightning import TTLinear
from comera_lightning.callbacks import PaperLateStage, RankAdaptation, ScheduledLateStage
from comera_lightning.nn import size_report, tt_layers
from comera_lightning.rank_adaptation.late_stage import LateStagePolicy, late_stage_policy, ramp_fraction_for
from comera_lightning.rank_adaptation.objectives import (
    ObjectiveWeights,
    compressible_target_size,
    early_stage_weights,
    late_stage_weights,
    layer_removal_caps,
    plan_rank_cuts,
    scheduled_size,
    slice_importance,
)
from comera_lightning.tt import bond_weights, minimum_train_size


def _trainer(tmp_path, callbacks, max_steps=40) -> Trainer:
    return Trainer(
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
    )


# ---------------------------------------------------------------------------------------------- size target
def test_ratio_target_applies_to_the_compressible_part_only():
    # the six-encoder case of the first quality study: 754k dense parameters are 42 % of S,
    # 0.2 * S is below the rank-1 floor
    other, size, floor = 754_000, 1_789_000, 757_000
    assert 0.2 * size < floor
    target = compressible_target_size(size, other, 0.2)
    assert target == pytest.approx(other + 0.2 * (size - other))
    assert target > floor
    # nothing compressible left (the TT part already gone, or the count of other parameters above the size):
    # the target is the other parameters alone
    assert compressible_target_size(other, other, 0.2) == other
    assert compressible_target_size(500_000, other, 0.2) == other


def test_ratio_target_below_the_floor_warns_and_clamps(tmp_path):
    model = TinyRegressor()
    callback = RankAdaptation(
        late_start_step=2,
        target_size_ratio=1e-4,
        truncate_every_n_steps=None,
        late_stage=ScheduledLateStage(ramp_steps=4),
    )
    layers = [layer for _, layer in tt_layers(model)]
    other = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for layer in layers for p in [*layer.cores, *layer.gates]
    )
    floor = other + sum(minimum_train_size(layer.mode_sizes) for layer in layers)
    dense = other + sum(layer.dense_parameters for layer in layers)
    message = (
        f"RankAdaptation: the size target of {other + 1e-4 * (size_report(model).active_parameters - other):,.0f} "
        f"parameters is below what rank 1 everywhere allows ({floor:,}); aiming for that floor instead (compression "
        f"{dense / floor:.1f}x). Raise target_size / target_size_ratio or lower target_compression"
    )
    with pytest.warns(UserWarning, match=f"^{re.escape(message)}$"):
        _trainer(tmp_path, [callback], max_steps=4).fit(model, regression_loader())
    assert callback.target_size == floor


def test_reachable_ratio_target_does_not_warn(tmp_path):
    callback = RankAdaptation(
        late_start_step=2,
        target_size_ratio=0.5,
        truncate_every_n_steps=None,
        late_stage=ScheduledLateStage(ramp_steps=4),
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*rank 1 everywhere.*")
        _trainer(tmp_path, [callback], max_steps=4).fit(TinyRegressor(), regression_loader())
    assert callback.stage == 1


# ---------------------------------------------------------------------------------------------- functions
def test_scheduled_size_is_a_geometric_ramp():
    assert scheduled_size(100, 100, 50, 1000.0, 200.0) == 1000.0
    assert scheduled_size(50, 100, 50, 1000.0, 200.0) == 1000.0  # before the start
    assert scheduled_size(125, 100, 50, 1000.0, 200.0) == pytest.approx(math.sqrt(1000.0 * 200.0))
    assert scheduled_size(150, 100, 50, 1000.0, 200.0) == pytest.approx(200.0)
    # the same share of the remaining size goes in every step
    shares = [
        scheduled_size(t + 1, 100, 50, 1000.0, 200.0) / scheduled_size(t, 100, 50, 1000.0, 200.0)
        for t in range(100, 150)
    ]
    assert max(shares) - min(shares) < 1e-9
    assert scheduled_size(900, 100, 50, 1000.0, 200.0) == pytest.approx(200.0)
    values = [scheduled_size(t, 0, 40, 1000.0, 200.0) for t in range(41)]
    assert all(a >= b for a, b in pairwise(values))
    with pytest.raises(ValueError, match="ramp_steps must be >= 1"):
        scheduled_size(0, 0, 0, 1.0, 1.0)
    with pytest.raises(ValueError, match="sizes must be positive"):
        scheduled_size(0, 0, 5, 0.0, 1.0)
    with pytest.raises(ValueError, match="sizes must be positive"):
        scheduled_size(0, 0, 5, 1.0, 0.0)
    # any positive sizes, e.g. shares of the dense size below 1: halfway is the geometric mean
    assert scheduled_size(5, 0, 10, 0.5, 0.125) == pytest.approx(0.25)


def test_slice_importance_matches_hand_computation_and_ignores_gate_scaling():
    torch.manual_seed(0)
    layer = TTLinear(12, 10, 4, in_modes=[3, 4], out_modes=[2, 5]).double()
    importance = slice_importance(layer.gated_cores(), layer.rank_masks)
    assert len(importance) == layer.num_bonds
    for k, values in enumerate(importance):
        left, right = layer.cores[k].detach(), layer.cores[k + 1].detach()
        for j in range(values.numel()):
            expected = float(left[..., j].norm() * right[j].norm())
            assert float(values[j]) == pytest.approx(expected, rel=1e-6)
    # moving scale from a core slice into its gate leaves the slice's importance unchanged
    with torch.no_grad():
        layer.cores[1][..., 2] *= 8.0
        layer.gates[1][2] = 1.0 / 8.0
    after = slice_importance(layer.gated_cores(), layer.rank_masks)
    torch.testing.assert_close(after[1].double(), importance[1].double())
    layer.remove_slices_(0, [1])
    assert float(slice_importance(layer.gated_cores(), layer.rank_masks)[0][1]) == 0.0
    with pytest.raises(ValueError, match=r"^a train of 4 cores has 3 bonds, got 1 masks$"):
        slice_importance(layer.gated_cores(), layer.rank_masks[:1])


def test_plan_rank_cuts_takes_least_important_first_within_the_bound():
    importances = [torch.tensor([1.0, 0.1, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0]), torch.tensor([1.0, 0.2, 0.3])]
    masks = [torch.ones(10, dtype=torch.bool), torch.ones(3, dtype=torch.bool)]
    # bond 0 may lose max(1, floor(0.2 * 10)) = 2 slices, bond 1 max(1, floor(0.2 * 3)) = 1
    cuts = plan_rank_cuts(importances, masks, [10.0, 10.0], 1e9, 0.2)
    assert cuts == [[1, 4], [1]]
    # only as many as the parameters asked for, least important first
    assert plan_rank_cuts(importances, masks, [10.0, 10.0], 10.0, 0.2) == [[1], []]
    # importance per parameter freed: a slice holding 100 parameters at importance 0.5 goes before one
    # holding a single parameter at importance 0.2
    two = [torch.tensor([0.5, 1.0]), torch.tensor([0.2, 1.0])]
    assert plan_rank_cuts(two, [torch.ones(2, dtype=torch.bool)] * 2, [100.0, 1.0], 50.0, 1.0) == [[0], []]
    assert plan_rank_cuts(importances, masks, [10.0, 10.0], 0.0, 0.2) == [[], []]
    # masked slices are never candidates, and a bond always keeps one active slice
    single = [torch.tensor([0.0, 0.5, 0.0])]
    assert plan_rank_cuts(single, [torch.tensor([False, True, False])], [1.0], 1e9, 1.0) == [[]]
    assert plan_rank_cuts([torch.tensor([1.0, 2.0])], [torch.ones(2, dtype=torch.bool)], [1.0], 1e9, 1.0) == [[0]]
    with pytest.raises(ValueError, match=r"max_cut_fraction must be in \(0, 1\]"):
        plan_rank_cuts(importances, masks, [1.0, 1.0], 1.0, 0.0)
    with pytest.raises(ValueError, match=r"max_cut_fraction must be in \(0, 1\]"):
        plan_rank_cuts(importances, masks, [1.0, 1.0], 1.0, 1.5)
    with pytest.raises(ValueError, match=r"^importances, masks and slice_parameters must have one entry per bond$"):
        plan_rank_cuts(importances, masks[:1], [1.0, 1.0], 1.0, 0.5)
    # a bond down to one slice gives nothing, and the bonds after it are still candidates
    at_rank_one = [torch.tensor([1.0]), torch.tensor([0.3, 0.1, 0.2])]
    at_rank_one_masks = [torch.ones(1, dtype=torch.bool), torch.ones(3, dtype=torch.bool)]
    assert plan_rank_cuts(at_rank_one, at_rank_one_masks, [1.0, 1.0], 1e9, 1.0) == [[], [1, 2]]
    # the ranking is per parameter, so the unit of the sizes does not matter (here thousands of parameters)
    assert plan_rank_cuts(two, [torch.ones(2, dtype=torch.bool)] * 2, [0.1, 0.001], 0.05, 1.0) == [[0], []]


def test_the_capped_pass_keeps_the_bound_stops_at_the_target_and_honours_fractional_caps():
    ones = torch.ones(8, dtype=torch.bool)
    # max(1, floor(0.25 * 8)) = 2 slices per call, however large the layer's cap
    assert plan_rank_cuts([torch.arange(8.0)], [ones], [1.0], 1e9, 0.25, groups=[0], group_caps=[1e9]) == [[0, 1]]
    # exactly the parameters asked for, then no more (caps wide open)
    assert plan_rank_cuts([torch.arange(8.0)], [ones], [10.0], 20.0, 1.0, groups=[0], group_caps=[1e9]) == [[0, 1]]
    # a layer below its cap, even by half a parameter, gives its cheapest slice (which overshoots the cap)
    importances = [torch.tensor([0.1, 0.2, 5.0]), torch.tensor([1.0, 2.0, 5.0])]
    masks = [torch.ones(3, dtype=torch.bool)] * 2
    cuts = plan_rank_cuts(importances, masks, [1.0, 1.0], 2.0, 1.0, groups=[0, 1], group_caps=[0.5, 100.0])
    assert cuts == [[0], [0]]


def test_layer_caps_keep_a_cheap_layer_from_being_emptied():
    # layer 0 (bond 0) holds big, cheap slices; layer 1 (bond 1) small, costly ones. Globally ranked, every
    # cut comes from layer 0 until it is down to one slice.
    importances = [torch.full((8,), 0.1), torch.full((8,), 1.0)]
    masks = [torch.ones(8, dtype=torch.bool)] * 2
    sizes_per_slice = [100.0, 10.0]
    global_cuts = plan_rank_cuts(importances, masks, sizes_per_slice, 700.0, 1.0)
    assert global_cuts == [list(range(7)), []]
    # with a floor of 1 each layer gives its uniform share: half of 880 parameters each
    layer_sizes = [800.0, 80.0]
    caps = layer_removal_caps(layer_sizes, layer_sizes, 440.0, 1.0)
    assert caps == pytest.approx([400.0, 40.0])
    capped = plan_rank_cuts(importances, masks, sizes_per_slice, 440.0, 1.0, groups=[0, 1], group_caps=caps)
    assert len(capped[0]) == 4 and len(capped[1]) == 4
    # a floor of 0 is the global ranking
    assert layer_removal_caps(layer_sizes, layer_sizes, 440.0, 0.0) == layer_sizes
    # what a capped layer cannot give comes from the others: layer 1 is already at one active slice
    masks_low = [torch.ones(8, dtype=torch.bool), torch.tensor([True] + [False] * 7)]
    caps = layer_removal_caps([800.0, 10.0], [800.0, 10.0], 405.0, 1.0)
    spill = plan_rank_cuts(importances, masks_low, sizes_per_slice, 405.0, 1.0, groups=[0, 1], group_caps=caps)
    assert spill == [[0, 1, 2, 3, 4], []]  # the capped pass took 0..3, the second pass adds 4 (no slice twice)
    with pytest.raises(
        ValueError,
        match=r"^groups and group_caps go together: pass both \(capped per layer\) or neither \(global\)$",
    ):
        plan_rank_cuts(importances, masks, sizes_per_slice, 1.0, 1.0, groups=[0, 1])
    with pytest.raises(ValueError, match="groups needs one layer index per bond: 1 for 2 bonds"):
        plan_rank_cuts(importances, masks, sizes_per_slice, 1.0, 1.0, groups=[0], group_caps=[1.0])
    with pytest.raises(ValueError, match=r"layer_floor must be in \[0, 1\]"):
        layer_removal_caps(layer_sizes, layer_sizes, 1.0, 1.5)
    with pytest.raises(ValueError, match="one reference size per layer: 1 for 2 layers"):
        layer_removal_caps(layer_sizes, [1.0], 1.0, 0.5)
    # the caps are in the unit of the sizes (here thousands of parameters)
    assert layer_removal_caps([0.8, 0.08], [0.8, 0.08], 0.44, 1.0) == pytest.approx([0.4, 0.04])
    # asked to remove everything, a layer may give all it holds; with no reference (nothing at the start) too
    assert layer_removal_caps(layer_sizes, layer_sizes, 1000.0, 1.0) == layer_sizes
    assert layer_removal_caps([5.0, 3.0], [0.0, 0.0], 2.0, 1.0) == [5.0, 3.0]
    with pytest.raises(ValueError, match=r"layer_floor must be in \[0, 1\]"):
        ScheduledLateStage(layer_floor=-0.1)


def test_layer_floor_stops_one_layer_collapsing_to_rank_one():
    # two layers of different shapes, equal Taylor saliency everywhere: per parameter the wide layer's slices
    # are the cheapest, so the global ranking takes them all first
    def run(layer_floor):
        torch.manual_seed(0)
        layers = [
            TTLinear(64, 256, 8, in_modes=[64], out_modes=[256]),
            TTLinear(16, 16, 8, in_modes=[16], out_modes=[16]),
        ]
        policy = ScheduledLateStage(ramp_steps=1, cut_every_n_steps=1, max_cut_fraction=1.0, layer_floor=layer_floor)
        for layer in layers:
            layer.gates[0].grad = torch.ones_like(layer.gates[0])
        policy.observe(layers)
        size = sum(layer.active_parameters() for layer in layers)
        policy.start(0, size, size / 2, None)
        policy.cut(1, 1.0, size, layers)
        return [layer.active_ranks[1] for layer in layers]

    assert run(0.0) == [3, 8]  # only the wide layer loses slices: the FFN-collapse pattern
    assert run(1.0) == [4, 4]  # each layer keeps its uniform share


def test_layer_floor_holds_over_many_small_cuts():
    # the floor is relative to the layers' sizes when the cuts began, not to their sizes before each cut: many
    # small cuts must not add up to a collapse that no single cut would make
    def run(layer_floor):
        torch.manual_seed(0)
        layers = [
            TTLinear(64, 256, 16, in_modes=[64], out_modes=[256]),
            TTLinear(16, 16, 16, in_modes=[16], out_modes=[16]),
        ]
        policy = ScheduledLateStage(
            ramp_steps=40, cut_every_n_steps=1, max_cut_fraction=0.25, loss_tolerance=1e9, layer_floor=layer_floor
        )
        size = sum(layer.active_parameters() for layer in layers)
        policy.start(0, size, size / 4, None)
        for step in range(1, 41):
            for layer in layers:
                layer.gates[0].grad = torch.ones_like(layer.gates[0])
            policy.observe(layers)
            policy.cut(step, 1.0, sum(layer.active_parameters() for layer in layers), layers)
        state = policy.state_dict()
        assert state["layer_sizes_at_start"] == [16 * 320, 16 * 32]
        return [layer.active_ranks[1] for layer in layers]

    assert run(0.0) == [2, 16]  # the global ranking takes every cut from the wide layer
    wide, narrow = run(1.0)
    assert narrow <= 5 and wide >= 3  # both shrink to about a quarter: 16 -> 4 each
    assert abs(wide - narrow) <= 1


def test_remove_slices_errors():
    layer = TTLinear(12, 10, 2, in_modes=[3, 4], out_modes=[2, 5])
    with pytest.raises(ValueError, match=r"bond must be in \[0, 3\), got 7"):
        layer.remove_slices_(7, [0])
    with pytest.raises(
        ValueError, match=r"slice indices \[5\] out of range for bond 0 of rank 2; indices must be in \[0, 2\)"
    ):
        layer.remove_slices_(0, [5])
    with pytest.raises(ValueError, match=r"would leave bond 1 without an active slice; keep at least one"):
        layer.remove_slices_(1, [0, 1])


# ---------------------------------------------------------------------------------------------- in training
class _CutLog(ScheduledLateStage):
    """Records, for every cut, each bond's active ranks before it and the number of slices removed."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.log: list[tuple[int, list[int], list[int]]] = []

    def cut(self, step, loss, size, layers):
        before = [r for layer in layers for r in layer.active_ranks[1:-1]]
        count = super().cut(step, loss, size, layers)
        after = [r for layer in layers for r in layer.active_ranks[1:-1]]
        if count:
            self.log.append((step, before, after))
        return count


@pytest.mark.slow
def test_scheduled_policy_bounds_each_cut_and_reaches_the_target(tmp_path):
    model = TinyRegressor()
    policy = _CutLog(ramp_steps=40, cut_every_n_steps=4, max_cut_fraction=0.25, loss_tolerance=1e9)
    callback = RankAdaptation(
        gamma=0.01,
        late_start_step=8,
        target_compression=6.0,
        late_stage=policy,
        threshold=0.0,
        truncate_every_n_steps=8,
        min_dead_fraction=0.1,
    )
    _trainer(tmp_path, [callback], max_steps=80).fit(model, regression_loader())
    assert policy.log, "no cut happened"
    steps = [step for step, _, _ in policy.log]
    assert steps[0] >= 8 + 4 and all(b - a >= 4 for a, b in pairwise(steps))
    for _, before, after in policy.log:
        for r0, r1 in zip(before, after, strict=True):
            assert r0 - r1 <= (0 if r0 <= 1 else max(1, math.floor(0.25 * r0))), (before, after)
            assert r1 >= 1
    assert size_report(model).compression_ratio >= 6.0 * 0.98
    assert callback.comera_metrics()["comera/slices_cut"] == policy.slices_cut > 0


def test_scheduled_policy_pauses_while_the_loss_recovers():
    layer = TTLinear(16, 16, 8, in_modes=[4, 4], out_modes=[4, 4])
    policy = ScheduledLateStage(
        ramp_steps=10,
        cut_every_n_steps=2,
        max_cut_fraction=0.25,
        loss_tolerance=0.05,
        max_pause_steps=6,
        importance="norm",
    )
    full = layer.active_parameters()
    policy.start(0, full, full / 4, None)
    assert policy.cut(2, 1.0, layer.active_parameters(), [layer]) > 0
    # loss 10 % above the one before the cut: wait, up to max_pause_steps after the cut
    assert policy.cut(4, 1.10, layer.active_parameters(), [layer]) == 0
    assert policy.cut(6, 1.10, layer.active_parameters(), [layer]) == 0
    assert policy.cut(8, 1.10, layer.active_parameters(), [layer]) > 0  # 6 steps since the cut: go anyway
    # recovered within the tolerance: cut at the next opportunity
    assert policy.cut(10, 1.12, layer.active_parameters(), [layer]) > 0


def test_scheduled_policy_needs_a_known_length():
    with pytest.raises(ValueError, match=r"run's length is unknown .* set ramp_steps"):
        ScheduledLateStage().start(10, 100.0, 50.0, None)
    with pytest.raises(ValueError, match=r"run's length is unknown .*; set ramp_steps"):
        ScheduledLateStage().start(10, 100.0, 50.0, float("inf"))
    policy = ScheduledLateStage()
    policy.start(10, 100.0, 50.0, 100)
    assert policy.ramp == round(0.6 * 90)


def test_deeper_cuts_get_longer_ramps_by_default():
    # 0.6 of the late stage up to a 5x cut, growing with log(cut) beyond, at most 0.9 (docs/results.md)
    assert ramp_fraction_for(100.0, 100.0) == ramp_fraction_for(100.0, 400.0) == 0.6
    assert ramp_fraction_for(100.0, 20.0) == pytest.approx(0.6)
    assert ramp_fraction_for(100.0, 12.5) == pytest.approx(0.6 * math.log(8) / math.log(5))
    assert ramp_fraction_for(100.0, 100.0 / 12.8) == 0.9  # the masked-LM's 50x: 3.9x at the switch
    with pytest.raises(ValueError, match="sizes must be positive"):
        ramp_fraction_for(0.0, 1.0)
    by_default, fixed = ScheduledLateStage(), ScheduledLateStage(ramp_fraction=0.6)
    by_default.start(480, 12.8e4, 1e4, 1200)
    fixed.start(480, 12.8e4, 1e4, 1200)
    assert (by_default.ramp, fixed.ramp) == (round(0.9 * 720), round(0.6 * 720))
    assert by_default.goal(480 + 648) == pytest.approx(1e4) and fixed.goal(480 + 648) == pytest.approx(1e4)
    assert by_default.goal(480 + 324) == pytest.approx(math.sqrt(12.8e4 * 1e4))  # still geometric, half-way


def test_switch_on_the_last_step_is_harmless(tmp_path):
    callback = RankAdaptation(late_start_step=4, target_compression=6.0)
    _trainer(tmp_path, [callback], max_steps=4).fit(TinyRegressor(), regression_loader())
    assert callback.stage == 1 and callback.late_stage.ramp == 1


def test_policy_state_round_trips_through_the_callback():
    callback = RankAdaptation(late_stage=ScheduledLateStage(ramp_steps=5))
    callback.late_stage.start(3, 100.0, 20.0, None)
    callback.late_stage.last_cut_step, callback.late_stage.slices_cut = 9, 4
    restored = RankAdaptation(late_stage=ScheduledLateStage(ramp_steps=5))
    restored.load_state_dict(callback.state_dict())
    assert restored.late_stage.state_dict() == callback.late_stage.state_dict()
    assert isinstance(RankAdaptation(late_stage="paper").late_stage, PaperLateStage)


def test_missing_the_size_target_is_reported(tmp_path):
    # two cuts of at most one slice per bond cannot take the model to 20x
    callback = RankAdaptation(
        late_start_step=2,
        target_compression=20.0,
        truncate_every_n_steps=None,
        late_stage=ScheduledLateStage(ramp_steps=4, cut_every_n_steps=4, max_cut_fraction=0.01),
    )
    with pytest.warns(UserWarning, match=r"training ended at .* above the late stage's target"):
        _trainer(tmp_path, [callback], max_steps=10).fit(TinyRegressor(), regression_loader())


def test_taylor_saliency_is_a_running_mean_of_gate_times_gradient_and_follows_truncation():
    torch.manual_seed(0)
    layer = TTLinear(16, 16, 8, in_modes=[4, 4], out_modes=[4, 4])
    policy = ScheduledLateStage(ramp_steps=10, saliency_smoothing=0.5)
    grads = []
    for _ in range(3):
        for gate in layer.gates:
            gate.grad = torch.randn_like(gate)
        grads.append([(g.detach() * g.grad).abs() for g in layer.gates])
        policy.observe([layer])
    for k in range(layer.num_bonds):
        expected = 0.25 * grads[0][k] + 0.25 * grads[1][k] + 0.5 * grads[2][k]
        torch.testing.assert_close(policy.saliency[f"0.{k}"], expected)
    # the slice with the lowest saliency per parameter it holds is cut first
    per_slice = bond_weights(layer.mode_sizes, layer.active_ranks)
    relative = {
        (k, j): float(v[j] / per_slice[k])
        for k in range(layer.num_bonds)
        for v in [policy.saliency[f"0.{k}"]]
        for j in range(v.numel())
    }
    bond, lowest = min(relative, key=relative.get)
    policy.start(0, layer.active_parameters(), layer.active_parameters() - 1, None)
    before = policy.saliency[f"0.{bond}"].clone()
    assert policy.cut(policy.cut_every_n_steps, 1.0, layer.active_parameters(), [layer]) == 1
    assert (
        not bool(layer.rank_masks[bond][lowest])
        and int(sum(m.sum() for m in layer.rank_masks)) == sum(layer.ranks[1:-1]) - 1
    )
    record = layer.truncate_()
    policy.after_truncation(record)
    kept = [j for j in range(before.numel()) if j != lowest]
    torch.testing.assert_close(policy.saliency[f"0.{bond}"], before[kept])
    # only the gates of the last observation are known: under FSDP2 a cut makes new parameter objects, and a
    # core that reused a replaced gate's id had the saliency of that gate sliced (an IndexError)
    replaced = TTLinear(16, 16, 8, in_modes=[4, 4], out_modes=[4, 4])
    for gate in replaced.gates:
        gate.grad = torch.ones_like(gate)
    policy.observe([replaced])
    for gate in layer.gates:
        gate.grad = torch.ones_like(gate)
    policy.observe([layer])
    stale = replaced.gates[bond]
    now = {key: value.clone() for key, value in policy.saliency.items()}
    policy.after_truncation([(stale, type(record[0][1])(None, torch.tensor([0])))])
    assert all(torch.equal(policy.saliency[key], value) for key, value in now.items())
    # without observations there is nothing to rank by: a clear error, not a silent fallback
    with pytest.raises(
        RuntimeError,
        match=r"^ScheduledLateStage has no gradient saliency for bond 0 of layer 0; observe\(\) must run before every "
        r"optimiser step \(RankAdaptation does this\), or use importance='norm'$",
    ):
        ScheduledLateStage(ramp_steps=4)._importances([TTLinear(16, 16, 4, in_modes=[4, 4], out_modes=[4, 4])])
    with pytest.raises(ValueError, match="importance must be 'taylor' or 'norm'"):
        ScheduledLateStage(importance="random")


# ---------------------------------------------------------------------------------------------- the policies' settings
def test_ramp_fraction_for_takes_any_positive_sizes_and_refuses_a_zero_target():
    # sizes in any unit, e.g. shares of the dense size below 1
    assert ramp_fraction_for(0.5, 0.25) == 0.6
    assert ramp_fraction_for(1.0, 0.1) == pytest.approx(0.6 * math.log(10) / math.log(5))
    for start, target in ((0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)):
        with pytest.raises(ValueError, match=rf"^sizes must be positive, got start {start} and target {target}$"):
            ramp_fraction_for(start, target)


def test_the_base_policy_cuts_nothing():
    layer = TTLinear(16, 16, 4, in_modes=[4, 4], out_modes=[4, 4])
    assert LateStagePolicy().cut(100, 1.0, 1e9, [layer]) == 0
    assert all(bool(mask.all()) for mask in layer.rank_masks)


def test_paper_late_stage_checks_its_bases_and_passes_them_to_the_scalarisation():
    # loss at its target, size twice its target: push the size (lam = 1); the reverse: push the loss (lam = 0)
    push_size, push_loss = (1.0, 100.0, 1.0, 50.0), (2.0, 100.0, 1.0, 100.0)
    assert PaperLateStage().weights(*push_size, gamma=0.5) == late_stage_weights(*push_size, 1.1, 0.01)
    assert PaperLateStage().weights(*push_loss, gamma=0.5) == ObjectiveWeights(task=1.1, penalty=0.01, lam=0.0)
    policy = PaperLateStage(task_weight_base=2.0, penalty_weight_base=0.5)
    assert policy.weights(*push_size, gamma=0.01) == ObjectiveWeights(task=1.0, penalty=1.5, lam=1.0)
    assert policy.weights(*push_loss, gamma=0.01) == ObjectiveWeights(task=2.0, penalty=0.5, lam=0.0)
    PaperLateStage(task_weight_base=1.0001, penalty_weight_base=0.0)  # both ends of the ranges
    for bad in (1.0, math.inf, math.nan):
        with pytest.raises(
            ValueError,
            match=r"^task_weight_base must be > 1 so the task loss keeps a positive weight \(task_weight_base - 1\) "
            rf"while the late stage pushes the size, got {bad}$",
        ):
            PaperLateStage(task_weight_base=bad)
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match=rf"^penalty_weight_base must be >= 0 and finite, got {bad}$"):
            PaperLateStage(penalty_weight_base=bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ramp_fraction": 0.0}, "ramp_fraction must be in (0, 1] or None, got 0.0"),
        ({"ramp_fraction": 1.5}, "ramp_fraction must be in (0, 1] or None, got 1.5"),
        ({"ramp_steps": 0}, "ramp_steps must be >= 1 or None, got 0"),
        ({"cut_every_n_steps": 0}, "cut_every_n_steps must be >= 1, got 0"),
        ({"max_cut_fraction": 0.0}, "max_cut_fraction must be in (0, 1], got 0.0"),
        ({"max_cut_fraction": 1.5}, "max_cut_fraction must be in (0, 1], got 1.5"),
        ({"loss_tolerance": -0.1}, "loss_tolerance must be >= 0 and finite, got -0.1"),
        ({"loss_tolerance": math.inf}, "loss_tolerance must be >= 0 and finite, got inf"),
        ({"penalty_weight": -0.1}, "penalty_weight must be >= 0 and finite or None, got -0.1"),
        ({"penalty_weight": math.inf}, "penalty_weight must be >= 0 and finite or None, got inf"),
        ({"saliency_smoothing": 1.0}, "saliency_smoothing must be in [0, 1), got 1.0"),
        ({"saliency_smoothing": -0.1}, "saliency_smoothing must be in [0, 1), got -0.1"),
        ({"layer_floor": -0.1}, "layer_floor must be in [0, 1], got -0.1"),
        ({"layer_floor": 1.5}, "layer_floor must be in [0, 1], got 1.5"),
        ({"importance": "random"}, "importance must be 'taylor' or 'norm', got 'random'"),
        (
            {"cut_every_n_steps": 5, "max_pause_steps": 4},
            "max_pause_steps (4) must be >= cut_every_n_steps (5) or None",
        ),
    ],
)
def test_scheduled_late_stage_refuses_each_setting_outside_its_range(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ScheduledLateStage(**kwargs)


def test_scheduled_late_stage_accepts_both_ends_of_its_ranges_and_has_documented_defaults():
    policy = ScheduledLateStage(
        ramp_fraction=1.0,
        ramp_steps=1,
        cut_every_n_steps=1,
        max_cut_fraction=1.0,
        loss_tolerance=0.0,
        max_pause_steps=1,
        penalty_weight=0.0,
        saliency_smoothing=0.0,
        layer_floor=1.0,
    )
    assert (policy.max_cut_fraction, policy.max_pause_steps, policy.layer_floor) == (1.0, 1, 1.0)
    ScheduledLateStage(penalty_weight=0.5, layer_floor=0.0)
    default = ScheduledLateStage()
    assert (default.ramp_fraction, default.ramp_steps, default.cut_every_n_steps) == (None, None, 25)
    assert (default.max_cut_fraction, default.loss_tolerance, default.max_pause_steps) == (0.1, 0.02, 100)
    assert (default.penalty_weight, default.importance, default.saliency_smoothing, default.layer_floor) == (
        None,
        "taylor",
        0.95,
        0.0,
    )
    assert ScheduledLateStage(cut_every_n_steps=7).max_pause_steps == 28
    # a fresh policy has no schedule yet: nothing started, nothing cut, no goal
    assert default.state_dict() == {
        "start_step": None,
        "start_size": None,
        "target_size": None,
        "ramp": None,
        "last_cut_step": None,
        "loss_before_last_cut": None,
        "slices_cut": 0,
        "layer_sizes_at_start": None,
        "saliency": {},
    }
    metrics = default.metrics()
    assert metrics.keys() == {"comera/size_goal", "comera/slices_cut"} and math.isnan(metrics["comera/size_goal"])
    assert metrics["comera/slices_cut"] == 0.0


def test_late_stage_policy_by_name_or_instance():
    assert isinstance(late_stage_policy("paper"), PaperLateStage)
    assert isinstance(late_stage_policy("scheduled"), ScheduledLateStage)
    policy = PaperLateStage(task_weight_base=3.0)
    assert late_stage_policy(policy) is policy
    with pytest.raises(
        ValueError,
        match=r"^unknown late-stage policy 'fast'; use one of \['paper', 'scheduled'\] or a LateStagePolicy instance$",
    ):
        late_stage_policy("fast")


def test_scheduled_late_stage_keeps_the_early_objective_with_its_own_penalty_weight():
    args = (2.0, 100.0, 1.0, 50.0)
    assert ScheduledLateStage().weights(*args, gamma=0.05) == early_stage_weights(0.05)
    assert ScheduledLateStage(penalty_weight=0.3).weights(*args, gamma=0.05) == early_stage_weights(0.3)
    assert ScheduledLateStage(penalty_weight=0.0).weights(*args, gamma=0.05) == early_stage_weights(0.0)


def test_the_schedule_must_be_started_before_it_is_read():
    with pytest.raises(
        ValueError,
        match=r"^ScheduledLateStage cannot size its schedule: the run's length is unknown \(no max_steps / "
        r"max_epochs, e.g. max_time only\); set ramp_steps$",
    ):
        ScheduledLateStage().start(0, 100.0, 50.0, None)
    with pytest.raises(AssertionError, match=r"^start\(\) was not called$"):
        ScheduledLateStage().goal(5)
    # a partly restored schedule is refused, not read with a missing value
    for state in (
        {"start_step": 3},
        {"ramp": 5},
        {"start_step": 3, "start_size": 100.0, "target_size": 50.0},
        {"start_step": 3, "ramp": 5, "start_size": 100.0},
    ):
        policy = ScheduledLateStage()
        policy.load_state_dict(state)
        with pytest.raises(AssertionError, match=r"^start\(\) was not called$"):
            policy.goal(5)


# ---------------------------------------------------------------------------------------------- the policy's cuts
def _one_bond_layer(scale: float, weak: int | None = None) -> TTLinear:
    """A rank-4 layer of two cores whose slices are equally important, but slice ``weak`` 10x less."""
    layer = TTLinear(16, 16, 4, in_modes=[16], out_modes=[16])
    with torch.no_grad():
        for core in layer.cores:
            core.fill_(scale)
        if weak is not None:
            layer.cores[0][..., weak] *= 0.1
    return layer


def test_norm_importance_ranks_each_slice_relative_to_its_bonds_mean():
    # layer 0 is tiny in absolute terms (norms far below 1) but uniform; layer 1 is large with one weak slice:
    # relative to their bonds' means, the weak slice of layer 1 is the least important of all
    layers = [_one_bond_layer(1e-3), _one_bond_layer(10.0, weak=2)]
    policy = ScheduledLateStage(ramp_steps=1, cut_every_n_steps=1, importance="norm")
    size = sum(layer.active_parameters() for layer in layers)
    policy.start(0, size, size - 1, None)
    assert policy.cut(1, 1.0, size, layers) == 1
    assert layers[0].active_ranks[1] == 4
    assert not bool(layers[1].rank_masks[0][2]) and layers[1].active_ranks[1] == 3


def test_layer_floor_zero_ranks_every_slice_globally_even_when_one_layer_gives_more_than_its_size():
    # a four-core layer with cheap slices everywhere: cutting three bonds at once counts more parameters than the
    # layer holds (a slice of each bond counts the core they share), and still the global ranking takes only its
    # slices while they last, never one of the other layer's
    torch.manual_seed(0)
    cheap, costly = TTLinear(16, 16, 8, in_modes=[4, 4], out_modes=[4, 4]), _one_bond_layer(1.0)
    counted = sum(k * n for k, n in zip(cheap.slice_parameters(), [3, 7, 3], strict=True))
    assert cheap.active_parameters() == 288 and counted > 288
    for layer, grad in ((cheap, 0.01), (costly, 1.0)):
        for gate in layer.gates:
            gate.grad = torch.full_like(gate, grad)
    policy = ScheduledLateStage(ramp_steps=1, cut_every_n_steps=1, max_cut_fraction=1.0, layer_floor=0.0)
    policy.observe([cheap, costly])
    size = cheap.active_parameters() + costly.active_parameters()
    policy.start(0, size, size - 400, None)
    assert policy.cut(1, 1.0, size, [cheap, costly]) > 0
    assert costly.active_ranks[1] == 4 and min(cheap.active_ranks[1:-1]) < 4


def test_cut_returns_and_counts_the_slices_it_masks_and_reports_its_goal():
    torch.manual_seed(0)
    layers = [TTLinear(16, 16, 8, in_modes=[4, 4], out_modes=[4, 4]) for _ in range(2)]
    policy = ScheduledLateStage(ramp_steps=4, cut_every_n_steps=2, max_cut_fraction=0.5, importance="norm")
    size = sum(layer.active_parameters() for layer in layers)
    assert policy.cut(5, 1.0, size, layers) == 0  # not started: nothing to do
    policy.start(0, size, size / 4, None)
    before = policy.state_dict()
    assert policy.cut(1, 1.0, size, layers) == 0  # too soon after the switch
    assert policy.state_dict() == before

    def active() -> int:
        return sum(int(mask.sum()) for layer in layers for mask in layer.rank_masks)

    total, counts = active(), []
    for step in (2, 4):
        masked = active()
        counts.append(policy.cut(step, 1.0, sum(layer.active_parameters() for layer in layers), layers))
        assert counts[-1] == masked - active() > 1  # several bonds cut at once, every slice counted
        assert policy.metrics() == {"comera/size_goal": policy.goal(step), "comera/slices_cut": float(sum(counts))}
    assert policy.slices_cut == sum(counts) == total - active()


def test_a_cut_at_the_goal_changes_nothing():
    layer = TTLinear(16, 16, 8, in_modes=[4, 4], out_modes=[4, 4])
    policy = ScheduledLateStage(ramp_steps=1, cut_every_n_steps=1, importance="norm", layer_floor=0.5)
    size = layer.active_parameters()
    policy.start(0, size, size, None)
    before = policy.state_dict()
    assert policy.cut(3, 1.0, size, [layer]) == 0
    assert policy.state_dict() == before and layer.active_ranks == layer.ranks


def test_a_loss_exactly_at_the_tolerance_has_recovered():
    layer = TTLinear(16, 16, 8, in_modes=[4, 4], out_modes=[4, 4])
    policy = ScheduledLateStage(
        ramp_steps=10, cut_every_n_steps=2, max_cut_fraction=0.25, loss_tolerance=0.0, importance="norm"
    )
    policy.start(0, layer.active_parameters(), layer.active_parameters() / 4, None)
    assert policy.cut(2, 1.5, layer.active_parameters(), [layer]) > 0
    assert policy.cut(4, 1.5, layer.active_parameters(), [layer]) > 0  # the same loss: no wait


def test_scheduled_policy_state_keeps_the_saliency_and_an_empty_state_is_a_fresh_policy():
    torch.manual_seed(0)
    layer = TTLinear(16, 16, 8, in_modes=[4, 4], out_modes=[4, 4])
    policy = ScheduledLateStage(ramp_steps=5)
    for gate in layer.gates:
        gate.grad = torch.randn_like(gate)
    policy.observe([layer])
    policy.start(3, 100.0, 20.0, None)
    policy.slices_cut = 4
    restored = ScheduledLateStage(ramp_steps=5)
    restored.load_state_dict(policy.state_dict())
    assert restored.saliency.keys() == policy.saliency.keys() == {f"0.{k}" for k in range(layer.num_bonds)}
    for key, value in policy.saliency.items():
        torch.testing.assert_close(restored.saliency[key], value)
    assert (restored.start_step, restored.ramp, restored.slices_cut) == (3, 5, 4)
    fresh = ScheduledLateStage(ramp_steps=5)
    fresh.load_state_dict({})
    assert (fresh.start_step, fresh.slices_cut, fresh.saliency) == (None, 0, {})
