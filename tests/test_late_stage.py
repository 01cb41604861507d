"""The late stage: the size-target rule, the scheduled policy's functions and its bounded cuts in training."""

from __future__ import annotations

import math
import warnings
from itertools import pairwise

import pytest
import torch
from lightning.pytorch import Trainer
from tiny import TinyRegressor, regression_loader

from comera_lightning import TTLinear
from comera_lightning.callbacks import PaperLateStage, RankAdaptation, ScheduledLateStage
from comera_lightning.nn import size_report, tt_layers
from comera_lightning.rank_adaptation.late_stage import ramp_fraction_for
from comera_lightning.rank_adaptation.objectives import (
    compressible_target_size,
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
    with pytest.warns(UserWarning, match=r"below what rank 1 everywhere allows \(.*\); aiming for that floor"):
        _trainer(tmp_path, [callback], max_steps=4).fit(model, regression_loader())
    layers = [layer for _, layer in tt_layers(model)]
    other = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for layer in layers for p in [*layer.cores, *layer.gates]
    )
    assert callback.target_size == other + sum(minimum_train_size(layer.mode_sizes) for layer in layers)


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
    with pytest.raises(RuntimeError, match=r"no gradient saliency .* use importance='norm'"):
        ScheduledLateStage(ramp_steps=4)._importances([TTLinear(16, 16, 4, in_modes=[4, 4], out_modes=[4, 4])])
    with pytest.raises(ValueError, match="importance must be 'taylor' or 'norm'"):
        ScheduledLateStage(importance="random")
