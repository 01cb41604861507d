"""RankAdaptation and ContractionPlanner on a plain LightningModule that tensorizes its own MLP."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny import TinyRegressor, regression_loader

from comera_lightning.callbacks import ContractionPlanner, RankAdaptation, ScheduledLateStage
from comera_lightning.nn import TTLinear, size_report, tt_layers
from comera_lightning.nn.base import TruncationRecord
from comera_lightning.rank_adaptation import callback as rank_adaptation_callback
from comera_lightning.rank_adaptation.cuts import cut_sharded_, slice_optimizer_state, truncate_sharded
from comera_lightning.rank_adaptation.objectives import rank_penalty, truncate_dead_slices_
from comera_lightning.tt import bond_weights


def _trainer(tmp_path, callbacks, max_steps=40, **kwargs) -> Trainer:
    options = dict(
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
    )
    options.update(kwargs)
    return Trainer(callbacks=callbacks, **options)


def test_penalty_gradient_added_to_gates_once_per_step():
    model = TinyRegressor()
    callback = RankAdaptation(gamma=0.5)
    optimizer = model.configure_optimizers()
    layers = [layer for _, layer in tt_layers(model)]
    for layer in layers:
        layer.gates[0].data[:2] = 0.5  # make gates differ from 1
    callback._other_parameters = 96
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    callback.on_before_optimizer_step(None, model, optimizer)
    # independent computation: d(weighted mean |d|)/dd = w_k * sign(d) / sum_k w_k * r_k
    weights = [bond_weights(layer.mode_sizes, layer.active_ranks) for layer in layers]
    normaliser = sum(
        wk * gate.numel()
        for w, layer in zip(weights, layers, strict=True)
        for wk, gate in zip(w, layer.gates, strict=True)
    )
    for w, layer in zip(weights, layers, strict=True):
        for wk, gate in zip(w, layer.gates, strict=True):
            torch.testing.assert_close(gate.grad, torch.full_like(gate, 0.5 * wk / normaliser))
    # the cores' gradients are untouched in the early stage
    assert all(float(layer.cores[0].grad.abs().sum()) == 0.0 for layer in layers)


def test_gates_shrink_and_compression_rises(tmp_path):
    model = TinyRegressor()
    before = size_report(model).compression_ratio
    callback = RankAdaptation(gamma=0.3, truncate_every_n_steps=None)
    _trainer(tmp_path, [callback], max_steps=48).fit(model, regression_loader())
    after = size_report(model)
    assert after.compression_ratio > 1.5 * before
    assert all(layer.active_ranks[1:-1] != layer.ranks[1:-1] for _, layer in tt_layers(model))
    assert callback.stage == 0
    assert math.isfinite(callback.comera_metrics()["comera/penalty"])


@pytest.mark.parametrize("policy", ["paper", "scheduled"])
def test_late_stage_reaches_target_and_truncation_keeps_training(tmp_path, policy):
    model = TinyRegressor()
    dense = size_report(model).dense_equivalent_parameters
    late_stage = "paper" if policy == "paper" else ScheduledLateStage(cut_every_n_steps=4, max_cut_fraction=0.25)
    callback = RankAdaptation(
        gamma=0.01,
        late_start_step=8,
        target_compression=8.0,
        late_stage=late_stage,
        truncate_every_n_steps=8,
        min_dead_fraction=0.1,
    )
    planner = ContractionPlanner()
    _trainer(tmp_path, [callback, planner], max_steps=96).fit(model, regression_loader())
    report = size_report(model)
    assert callback.stage == 1 and callback.switch_step == 8
    assert report.active_parameters <= dense / 8.0
    assert callback.truncations >= 1
    # physically truncated: allocated equals active, and the optimizer state follows the new shapes
    for _, layer in tt_layers(model):
        assert layer.ranks == layer.active_ranks
    optimizer = model.trainer.optimizers[0]
    for p in model.parameters():
        for value in optimizer.state[p].values():
            if torch.is_tensor(value) and value.dim():
                assert value.shape == p.shape
    # training went on after the truncations: the loss keeps falling at the end of the run
    assert sum(model.losses[-8:]) < sum(model.losses[-24:-16])
    assert planner.plans and all(
        entry["ranks"] == layer.ranks
        for name, entry in planner.plans.items()
        for n, layer in tt_layers(model)
        if n == name
    )


@pytest.mark.parametrize(
    ("limits", "switch"),
    [({"max_steps": 40}, 10), ({"max_steps": -1, "max_epochs": 2}, 4), ({"max_steps": 100, "max_epochs": 2}, 4)],
)
def test_late_start_fraction_is_a_share_of_the_planned_steps(tmp_path, limits, switch):
    # regression_loader has 8 batches: 2 epochs are 16 steps, whose quarter is step 4; with both limits set the
    # run ends at whichever comes first (here the epochs, long before step 100)
    callback = RankAdaptation(late_start_fraction=0.25, target_compression=2.0, truncate_every_n_steps=None)
    _trainer(tmp_path, [callback], **limits).fit(TinyRegressor(), regression_loader())
    assert callback.stage == 1 and callback.switch_step == switch


@pytest.mark.filterwarnings("ignore:RankAdaptation. training ended:UserWarning")  # 12 steps reach no target
def test_the_smoothed_loss_is_an_ema_of_the_step_losses_and_the_loss_switch_reads_it(tmp_path):
    # raw step losses cross 0.62 at step 4, their EMA (factor 0.5) only at step 9
    model = TinyRegressor()
    callback = RankAdaptation(late_start_loss=0.62, loss_smoothing=0.5, truncate_every_n_steps=None)
    _trainer(tmp_path, [callback], max_steps=12).fit(model, regression_loader())
    emas = [model.losses[0]]
    for loss in model.losses[1:]:
        emas.append(0.5 * emas[-1] + 0.5 * loss)
    assert len(model.losses) == 12
    switch = next(step for step, ema in enumerate(emas, start=1) if ema <= 0.62)
    assert min(model.losses[: switch - 1]) <= 0.62, "the raw loss must cross first, or the test shows nothing"
    assert callback.switch_step == switch and callback.target_loss == pytest.approx(emas[switch - 1], rel=1e-9)
    assert callback.loss_ema == pytest.approx(emas[-1], rel=1e-9)  # still tracked in the late stage
    assert callback.comera_metrics()["comera/loss_ema"] == callback.loss_ema


def test_late_start_fraction_needs_a_run_of_known_length(tmp_path):
    with pytest.raises(ValueError, match=r"late_start_fraction must be in \[0, 1\)"):
        RankAdaptation(late_start_fraction=1.0)
    callback = RankAdaptation(late_start_fraction=0.5)
    trainer = _trainer(tmp_path, [callback], max_steps=-1, max_epochs=-1, max_time={"seconds": 30})
    with pytest.raises(ValueError, match=r"needs the run's length.*set trainer\.max_steps"):
        trainer.fit(TinyRegressor(), regression_loader())


def test_accumulation_adds_penalty_once_per_optimizer_step(tmp_path):
    added = []  # per optimiser step and gate: (gradient the callback added, gamma * dR/dd)

    class Recording(RankAdaptation):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            layers = [layer for _, layer in tt_layers(pl_module)]
            gates = [g for layer in layers for g in layer.gates]
            masks = [m for layer in layers for m in layer.rank_masks]
            weights = [w for layer in layers for w in layer.slice_parameters()]
            task = [g.grad.clone() for g in gates]  # the task's gradient, accumulated over both micro-batches
            with torch.enable_grad():
                expected = torch.autograd.grad(rank_penalty(gates, masks, weights), gates)
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
            added.append([(g.grad - t, 0.3 * e) for g, t, e in zip(gates, task, expected, strict=True)])

    loader = regression_loader()
    micro_batches = []

    class Counting(TinyRegressor):
        def training_step(self, batch, batch_idx):
            micro_batches.append(batch_idx)
            return super().training_step(batch, batch_idx)

    trainer = _trainer(
        tmp_path, [Recording(gamma=0.3, truncate_every_n_steps=4)], max_steps=6, accumulate_grad_batches=2
    )
    trainer.fit(Counting(), loader)
    assert len(micro_batches) == 12 and trainer.global_step == 6
    assert len(added) == 6  # once per optimiser step, not per micro-batch ...
    for step in added:  # ... and once in size: exactly gamma * dR/dd on top of the task's gradient
        for got, want in step:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)


def test_bf16_mixed_runs_without_nans(tmp_path):
    model = TinyRegressor()
    callback = RankAdaptation(gamma=0.3, truncate_every_n_steps=8, min_dead_fraction=0.1)
    _trainer(tmp_path, [callback], max_steps=32, precision="bf16-mixed").fit(model, regression_loader())
    assert all(math.isfinite(v) for v in model.losses)
    for _, layer in tt_layers(model):
        assert all(torch.isfinite(p).all() for p in [*layer.cores, *layer.gates])
        assert layer.gates[0].dtype == torch.float32


class _Snapshot(Callback):
    def __init__(self, path):
        self.path = path

    def on_fit_end(self, trainer, pl_module):
        state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        torch.save(state, self.path / f"rank{trainer.global_rank}.pt")


@pytest.mark.slow
def test_ddp_two_processes_agree_on_ranks_and_parameters(tmp_path):
    callback = RankAdaptation(
        gamma=0.3, late_start_step=10, target_compression=6.0, truncate_every_n_steps=6, min_dead_fraction=0.1
    )
    trainer = _trainer(tmp_path, [callback, _Snapshot(tmp_path)], max_steps=24, strategy="ddp_spawn", devices=2)
    trainer.fit(TinyRegressor(), regression_loader())
    first, second = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert first.keys() == second.keys()
    for key in first:
        assert first[key].shape == second[key].shape, key
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=0)
    cores = [k for k in first if ".cores." in k]
    shrunk = TinyRegressor()
    assert any(first[k].shape != shrunk.state_dict()[k].shape for k in cores), "no truncation happened"


def test_resume_after_truncation_matches_uninterrupted_run(tmp_path):
    def callbacks():
        return [
            RankAdaptation(
                gamma=1.0, late_start_step=16, target_compression=6.0, truncate_every_n_steps=4, min_dead_fraction=0.1
            )
        ]

    # one batch per epoch: every step sees the same data, so the comparison is about the restored
    # model/optimiser/callback state and not about where Lightning restarts a plain DataLoader
    full = TinyRegressor()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    _trainer(tmp_path, [*callbacks(), checkpoint], max_steps=40, enable_checkpointing=True).fit(
        full, regression_loader(n=32)
    )
    path = tmp_path / "ckpt" / "epoch=23-step=24.ckpt"
    saved = torch.load(path, weights_only=True)  # tensors and primitives only
    original = TinyRegressor().state_dict()
    assert any(v.shape != original[k].shape for k, v in saved["state_dict"].items()), "no truncation by step 24"

    resumed = TinyRegressor()  # built with the original, larger ranks
    resumed_callbacks = callbacks()
    _trainer(tmp_path, resumed_callbacks, max_steps=40).fit(resumed, regression_loader(n=32), ckpt_path=path)
    assert [layer.ranks for _, layer in tt_layers(resumed)] == [layer.ranks for _, layer in tt_layers(full)]
    assert resumed_callbacks[0].stage == 1
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses[24:]), rtol=1e-4, atol=1e-6)
    for (key, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=key)


def test_truncated_checkpoint_loads_into_original_ranks(tmp_path):
    model = TinyRegressor()
    trainer = _trainer(
        tmp_path, [RankAdaptation(gamma=0.5, truncate_every_n_steps=8, min_dead_fraction=0.1)], max_steps=32
    )
    trainer.fit(model, regression_loader())
    path = tmp_path / "final.ckpt"
    trainer.save_checkpoint(path)
    loaded = TinyRegressor.load_from_checkpoint(path)
    assert [layer.ranks for _, layer in tt_layers(loaded)] == [layer.ranks for _, layer in tt_layers(model)]
    assert any(layer.ranks != TinyRegressor().net[0].ranks for _, layer in tt_layers(loaded))
    x = torch.randn(5, 32)
    torch.testing.assert_close(loaded(x), model(x))


def test_bad_configuration_errors(tmp_path):
    with pytest.raises(ValueError, match=r"target_compression must be > 1 \(dense / compressed\) and finite, got 0.5"):
        RankAdaptation(target_compression=0.5)
    with pytest.raises(ValueError, match="penalty must be 'weighted' or 'mean', got 'l2'"):
        RankAdaptation(penalty="l2")
    with pytest.raises(ValueError, match=r"threshold must be in \[0, 1\) \(gates start at 1\), got 1.5"):
        RankAdaptation(threshold=1.5)
    with pytest.raises(ValueError, match="truncate_every_n_steps must be >= 1 or None, got 0"):
        RankAdaptation(truncate_every_n_steps=0)
    with pytest.raises(
        ValueError, match=r"is impossible: .*at most 21.8x\); lower target_compression / raise target_size"
    ):
        _trainer(tmp_path, [RankAdaptation(target_compression=1000.0)], max_steps=1).fit(
            TinyRegressor(), regression_loader()
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"penalty": "l2"}, "penalty must be 'weighted' or 'mean', got 'l2'"),
        ({"gamma": -0.1}, "gamma must be >= 0 and finite, got -0.1"),
        ({"gamma": math.inf}, "gamma must be >= 0 and finite, got inf"),
        ({"target_compression": 1.0}, "target_compression must be > 1 (dense / compressed) and finite, got 1.0"),
        ({"target_compression": math.inf}, "target_compression must be > 1 (dense / compressed) and finite, got inf"),
        ({"late_start_epoch": -1}, "late_start_epoch must be >= 0 or None, got -1"),
        ({"late_start_step": -1}, "late_start_step must be >= 0 or None, got -1"),
        ({"late_start_loss": math.nan}, "late_start_loss must be a finite number or None, got nan"),
        (
            {"late_start_fraction": -0.1},
            "late_start_fraction must be in [0, 1) (a share of the run's optimiser steps) or None, got -0.1",
        ),
        (
            {"late_start_fraction": 1.0},
            "late_start_fraction must be in [0, 1) (a share of the run's optimiser steps) or None, got 1.0",
        ),
        ({"target_loss": math.inf}, "target_loss must be a finite number or None, got inf"),
        ({"target_size": 0}, "target_size must be a positive parameter count, got 0"),
        ({"target_size_ratio": 0.0}, "target_size_ratio must be in (0, 1), got 0.0"),
        ({"target_size_ratio": 1.0}, "target_size_ratio must be in (0, 1), got 1.0"),
        ({"threshold": -0.1}, "threshold must be in [0, 1) (gates start at 1), got -0.1"),
        ({"threshold": 1.0}, "threshold must be in [0, 1) (gates start at 1), got 1.0"),
        ({"mask_every_n_steps": 0}, "mask_every_n_steps must be >= 1, got 0"),
        ({"truncate_every_n_steps": 0}, "truncate_every_n_steps must be >= 1 or None, got 0"),
        ({"min_dead_fraction": 0.0}, "min_dead_fraction must be in (0, 1], got 0.0"),
        ({"min_dead_fraction": 1.5}, "min_dead_fraction must be in (0, 1], got 1.5"),
        ({"loss_smoothing": -0.1}, "loss_smoothing must be in [0, 1), got -0.1"),
        ({"loss_smoothing": 1.0}, "loss_smoothing must be in [0, 1), got 1.0"),
    ],
)
def test_each_setting_outside_its_range_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        RankAdaptation(**kwargs)


def test_both_ends_of_every_range_are_accepted_and_the_defaults_are_the_documented_ones():
    RankAdaptation(
        penalty="mean",
        gamma=0.0,
        late_start_epoch=0,
        late_start_step=0,
        late_start_loss=-1.0,
        late_start_fraction=0.0,
        target_compression=1.0001,
        target_size=1,
        target_size_ratio=0.999,
        target_loss=0.0,
        threshold=0.0,
        mask_every_n_steps=1,
        truncate_every_n_steps=1,
        min_dead_fraction=1.0,
        loss_smoothing=0.0,
    )
    RankAdaptation(threshold=0.999, target_size_ratio=0.001, loss_smoothing=0.999, min_dead_fraction=0.001)
    callback = RankAdaptation()
    assert (callback.penalty, callback.gamma, callback.threshold) == ("weighted", 0.01, None)
    assert (callback.late_start_epoch, callback.late_start_step, callback.late_start_loss) == (None, None, None)
    assert (callback.late_start_fraction, callback.target_compression, callback.target_size_arg) == (None, None, None)
    assert (callback.target_size_ratio, callback.target_loss_arg) == (0.2, None)
    assert (callback.mask_every_n_steps, callback.truncate_every_n_steps, callback.min_dead_fraction) == (1, 100, 0.25)
    assert (callback.loss_key, callback.loss_smoothing) == ("loss", 0.9)
    assert isinstance(callback.late_stage, ScheduledLateStage)
    assert callback.late_stage.cut_every_n_steps == 25  # the policy's own defaults


def _sizes(model) -> tuple[int, int]:
    """(dense-equivalent size, rank-1 floor) of ``model``, both counting its parameters outside the TT layers."""
    layers = [layer for _, layer in tt_layers(model)]
    tt_ids = {id(p) for layer in layers for p in [*layer.cores, *layer.gates]}
    other = sum(p.numel() for p in model.parameters() if id(p) not in tt_ids)
    dense = sum(layer.dense_parameters for layer in layers) + other
    return dense, sum(layer.minimum_parameters() for layer in layers) + other


def test_the_late_stage_takes_the_targets_asked_for_and_reports_them(tmp_path, rank_zero_said):
    model = TinyRegressor()
    dense, _ = _sizes(model)
    callback = RankAdaptation(
        gamma=0.05,
        late_start_step=2,
        target_compression=4.0,
        target_loss=0.5,
        truncate_every_n_steps=None,
        late_stage=ScheduledLateStage(ramp_steps=4),
    )
    early = callback.comera_metrics()
    assert early.keys() == {
        "comera/stage",
        "comera/penalty",
        "comera/lambda",
        "comera/task_weight",
        "comera/penalty_weight",
        "comera/truncations",
    }
    assert math.isnan(early["comera/penalty"])
    assert [early[k] for k in ("comera/stage", "comera/lambda", "comera/task_weight", "comera/truncations")] == [
        0.0,
        0.0,
        1.0,
        0.0,
    ]
    assert early["comera/penalty_weight"] == 0.05
    said = rank_zero_said(rank_adaptation_callback)
    with pytest.warns(UserWarning, match="training ended at"):  # 3 steps reach no target
        _trainer(tmp_path, [callback], max_steps=3).fit(model, regression_loader())
    assert callback.stage == 1 and callback.switch_step == 2
    assert callback.target_size == dense / 4.0 and callback.target_loss == 0.5
    assert re.search(
        rf"RankAdaptation: late stage from step 2: size [0-9,]+ -> target {dense / 4.0:,.0f} parameters, "
        r"loss target 0\.5",
        "\n".join(said),
    )
    late = callback.comera_metrics()
    assert late["comera/stage"] == 1.0 and late["comera/target_size"] == dense / 4.0
    assert late["comera/loss_ema"] == callback.loss_ema
    assert late["comera/size_goal"] == callback.late_stage.goal(3) and late["comera/slices_cut"] == 0.0


def test_a_size_target_exactly_at_the_floor_is_reachable(tmp_path):
    _, floor = _sizes(TinyRegressor())
    callback = RankAdaptation(
        late_start_step=2, target_size=floor, truncate_every_n_steps=None, late_stage=ScheduledLateStage(ramp_steps=4)
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*training ended at.*")
        warnings.filterwarnings("error", message=".*rank 1 everywhere.*")
        _trainer(tmp_path, [callback], max_steps=3).fit(TinyRegressor(), regression_loader())
    assert callback.stage == 1 and callback.target_size == floor


class _TwoProcesses:
    """A strategy's ``reduce`` as under DDP with a second process whose loss is ``other``: "mean" averages,
    "sum" (or None) adds, anything else is an error."""

    def __init__(self, other: float) -> None:
        self.other = other

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if reduce_op == "mean":
            return (tensor + self.other) / 2
        if reduce_op in (None, "sum"):
            return tensor + self.other
        raise ValueError(f"unsupported reduce_op {reduce_op!r}")


def test_the_smoothed_loss_is_the_mean_over_processes_of_a_tensor_or_a_dict_entry():
    class _Trainer:
        strategy = _TwoProcesses(other=3.0)

    callback = RankAdaptation(loss_smoothing=0.5, loss_key="objective")
    callback._update_loss(_Trainer(), torch.tensor(1.0))
    assert callback.loss_ema == 2.0
    callback._update_loss(_Trainer(), {"objective": torch.tensor(5.0), "loss": torch.tensor(100.0)})
    assert callback.loss_ema == 0.5 * 2.0 + 0.5 * 4.0
    callback._update_loss(_Trainer(), torch.tensor(float("nan")))  # left out
    assert callback.loss_ema == 3.0
    for outputs, kind in ((None, "NoneType"), ({"loss": torch.tensor(1.0)}, "dict")):
        with pytest.raises(
            ValueError,
            match=rf"^RankAdaptation needs the training loss but training_step returned {kind}; return the loss "
            r"tensor or a dict with key 'objective' \(set loss_key otherwise\)$",
        ):
            callback._update_loss(_Trainer(), outputs)


def test_errors_when_model_has_no_comera_layers_or_gates_not_optimised(tmp_path):
    class Dense(TinyRegressor):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 32))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(
        ValueError,
        match=r"no comera layers .*build the model with them or call comera_lightning.tensorize\(model\) first",
    ):
        _trainer(tmp_path, [RankAdaptation()], max_steps=1).fit(Dense(), regression_loader())

    class NoGates(TinyRegressor):
        def configure_optimizers(self):
            return torch.optim.SGD([p for n, p in self.named_parameters() if ".gates." not in n], lr=0.1)

    with pytest.raises(
        ValueError,
        match=r"gates are not in any optimiser, .*include all parameters \(or use .*comera_parameter_groups\)",
    ):
        _trainer(tmp_path, [RankAdaptation()], max_steps=1).fit(NoGates(), regression_loader())


def test_autotuned_planner_picks_a_timed_plan(tmp_path):
    planner = ContractionPlanner(autotune=True, candidates=2, repeats=1, verbose=False)
    model = TinyRegressor()
    _trainer(tmp_path, [planner], max_steps=2).fit(model, regression_loader())
    for name, layer in tt_layers(model):
        entry = planner.plans[name]
        assert entry["rows"] == 32 and entry["plan"] in entry["timed_seconds"]
        assert layer.contraction_plan == entry["plan"]


def test_rank_penalty_variants():
    gates = [torch.tensor([1.0, -0.5, 0.2]), torch.tensor([0.4, 0.0])]
    masks = [torch.tensor([True, True, False]), torch.tensor([True, True])]
    assert float(rank_penalty(gates, masks)) == pytest.approx((1 + 0.5 + 0.4 + 0) / 4)
    assert float(rank_penalty(gates, masks, [2.0, 1.0])) == pytest.approx((2 * 1.5 + 0.4) / (2 * 2 + 2))
    with pytest.raises(ValueError, match="gates, masks and weights must have one entry per bond"):
        rank_penalty(gates, masks[:1])


def test_truncate_skips_layers_without_internal_bonds():
    from comera_lightning import TTEmbedding

    class Single(TinyRegressor):
        def __init__(self):
            super().__init__()
            self.lookup = TTEmbedding(50, 8, rank=4, vocab_modes=[50], dim_modes=[8])  # one core, no bonds

    model = Single()
    callback = RankAdaptation(min_dead_fraction=0.1)
    for _, layer in tt_layers(model):
        if layer.num_bonds:
            layer.gates[0].data[1:] = 0.0
            layer.refresh_masks_()

    class _Trainer:  # truncate() only needs optimisers and the strategy
        optimizers = ()
        strategy = None

    record = callback.truncate(_Trainer(), model)
    assert record and all(p is not model.lookup.cores[0] for p, _ in record)
    assert model.lookup.ranks == [1, 1]


def test_a_sharding_strategy_makes_the_cuts_and_the_policy_and_count_follow_them():
    model = TinyRegressor()
    layers = [layer for _, layer in tt_layers(model)]
    calls, seen = [], []

    class Sharding:  # stands in for FSDP2Strategy: cuts the layers itself (here without sharding them)
        def truncate_layers_(self, layers, min_dead_fraction):
            calls.append((layers, min_dead_fraction))
            return truncate_dead_slices_(layers, min_dead_fraction)

    class _Trainer:
        strategy = Sharding()
        optimizers = ()  # after_truncation must not run: the strategy converts its own optimiser state

    class Seeing(ScheduledLateStage):
        def after_truncation(self, record):
            seen.append(record)

    callback = RankAdaptation(min_dead_fraction=0.1, late_stage=Seeing())
    assert callback.truncate(_Trainer(), model) == TruncationRecord() and callback.truncations == 0
    for round_ in (1, 2):
        layers[0].remove_slices_(0, [0])
        record = callback.truncate(_Trainer(), model)
        assert record and seen[-1] is record and callback.truncations == round_
        assert layers[0].ranks[1] == layers[0].active_ranks[1] == 8 - round_
    assert len(calls) == 3 and all(got == layers and fraction == 0.1 for got, fraction in calls)


def test_the_loss_is_read_only_where_a_decision_needs_it(tmp_path):
    callback = RankAdaptation(truncate_every_n_steps=None)  # no switch rule: the early stage never ends
    assert not callback.needs_loss()
    _trainer(tmp_path, [callback], max_steps=3).fit(TinyRegressor(), regression_loader())
    assert callback.loss_ema is None and callback.stage == 0
    assert callback.state_dict() == {
        "stage": 0,
        "target_size": None,
        "target_loss": None,
        "loss_ema": None,
        "switch_step": None,
        "truncations": 0,
        "late_stage": ScheduledLateStage().state_dict(),
    }
    for rule in ("late_start_epoch", "late_start_step", "late_start_loss", "late_start_fraction"):
        assert RankAdaptation(**{rule: 0}).needs_loss(), rule
    callback.load_state_dict({"stage": 1})  # a late stage restored from a checkpoint
    assert callback.needs_loss()


def test_each_switch_rule_fires_from_its_threshold_on():
    class At:  # what should_enter_late_stage reads of the trainer
        def __init__(self, step: int, epoch: int) -> None:
            self.global_step, self.current_epoch = step, epoch

    by_step, by_epoch = RankAdaptation(late_start_step=5), RankAdaptation(late_start_epoch=2)
    assert not by_step.should_enter_late_stage(At(4, 9)) and by_step.should_enter_late_stage(At(5, 0))
    assert not by_epoch.should_enter_late_stage(At(99, 1)) and by_epoch.should_enter_late_stage(At(0, 2))
    by_loss = RankAdaptation(late_start_loss=0.5)
    assert not by_loss.should_enter_late_stage(At(99, 9))  # no loss seen yet
    for loss_ema, fires in ((0.51, False), (0.5, True), (0.2, True)):
        by_loss.loss_ema = loss_ema
        assert by_loss.should_enter_late_stage(At(0, 0)) == fires, loss_ema
    assert not RankAdaptation().should_enter_late_stage(At(10**6, 10**3))


# ---------------------------------------------------------------------------------------------- cuts
def _masked_linear(dead: list[int]) -> TTLinear:
    """A float64 TT linear of ranks [1, 3, 4, 4, 1] whose bond 1 has the slices ``dead`` masked."""
    torch.manual_seed(0)
    layer = TTLinear(12, 10, 4, in_modes=[3, 4], out_modes=[2, 5]).double()
    layer.remove_slices_(1, dead)
    return layer


def _kept_on_bond_1(layer: TTLinear, values: list[torch.Tensor], keep: list[int]) -> list[torch.Tensor]:
    """``values`` (one per core, then one per gate, shaped as before the cut) with bond 1 kept at ``keep``: core 1's
    trailing rank index, core 2's leading one and gate 1."""
    cores, gates = values[: len(layer.cores)], values[len(layer.cores) :]
    keep_t = torch.tensor(keep)
    cores = [c[..., keep_t] if k == 1 else c[keep_t] if k == 2 else c for k, c in enumerate(cores)]
    gates = [g[keep_t] if k == 1 else g for k, g in enumerate(gates)]
    return [*cores, *gates]


def test_slice_optimizer_state_keeps_the_moments_of_the_kept_slices_only():
    layer = _masked_linear([0, 2])
    other = torch.nn.Linear(3, 3).double()
    params = [*layer.cores, *layer.gates]
    adam = torch.optim.AdamW([*params, *other.parameters()], lr=0.1)
    unused = torch.optim.AdamW(params, lr=0.1)  # never stepped: no state to slice
    gates_only = torch.optim.AdamW(layer.gates, lr=0.1)  # state for the gates, none for the cores listed before them
    (
        layer(torch.randn(5, 12, dtype=torch.float64)).pow(2).sum() + other(torch.ones(3, dtype=torch.float64)).sum()
    ).backward()
    adam.step()
    gates_only.step()
    moments = {key: [adam.state[p][key].clone() for p in params] for key in ("exp_avg", "exp_avg_sq")}
    gate_moments = [gates_only.state[g]["exp_avg"].clone() for g in layer.gates]
    other_moment = adam.state[other.weight]["exp_avg"].clone()
    steps = [adam.state[p]["step"].clone() for p in params]
    record = layer.truncate_()
    slice_optimizer_state([unused, gates_only, adam], record)
    assert not unused.state
    cores_before = moments["exp_avg"][: len(layer.cores)]  # (shaped as before; only the gates are compared)
    gates_kept = _kept_on_bond_1(layer, [*cores_before, *gate_moments], [1, 3])[len(layer.cores) :]
    for gate, kept in zip(layer.gates, gates_kept, strict=True):
        torch.testing.assert_close(gates_only.state[gate]["exp_avg"], kept, rtol=0, atol=0)
    for key, before in moments.items():
        for p, expected in zip(params, _kept_on_bond_1(layer, before, [1, 3]), strict=True):
            assert adam.state[p][key].shape == p.shape
            torch.testing.assert_close(adam.state[p][key], expected, rtol=0, atol=0)
    for p, step in zip(params, steps, strict=True):  # the step count is no per-slice tensor
        torch.testing.assert_close(adam.state[p]["step"], step, rtol=0, atol=0)
    torch.testing.assert_close(adam.state[other.weight]["exp_avg"], other_moment, rtol=0, atol=0)


def test_truncate_sharded_is_the_strategy_hook_when_it_has_one():
    class Sharding:
        def truncate_layers_(self, layers, min_dead_fraction):
            return TruncationRecord()

    class NotAHook:
        truncate_layers_ = "a plan, not a method"

    strategy = Sharding()
    assert truncate_sharded(strategy) == strategy.truncate_layers_
    assert truncate_sharded(NotAHook()) is None and truncate_sharded(object()) is None


def test_cut_sharded_hands_the_sliced_values_to_reshard_and_cuts_only_layers_with_enough_masked():
    cut, kept = _masked_linear([0, 2]), _masked_linear([1])  # half of bond 1 masked; a quarter
    x = torch.randn(5, 12, dtype=torch.float64)
    y, ranks = cut(x), cut.ranks
    params = [*cut.cores, *cut.gates]
    before = [p.detach().clone() for p in params]
    kept_state = {k: v.clone() for k, v in kept.state_dict().items()}
    calls = []

    def reshard(values, convert):  # what the strategy does: write the new full values, convert the moments
        calls.append((values, convert))
        for param, value in values.items():
            param.data = value

    record = cut_sharded_([cut, kept], 0.4, reshard)
    assert len(calls) == 1
    values, convert = calls[0]
    expected = _kept_on_bond_1(cut, before, [1, 3])
    assert [id(p) for p, _ in record] == [id(p) for p in params] == [id(p) for p in values]
    moments = [old + 1.0 for old in before]  # optimiser tensors shaped like the parameters were
    for param, new, moment, new_moment in zip(
        params, expected, moments, _kept_on_bond_1(cut, moments, [1, 3]), strict=True
    ):
        torch.testing.assert_close(param.detach(), new, rtol=0, atol=0)
        torch.testing.assert_close(convert(param, moment), new_moment, rtol=0, atol=0)
    assert cut.ranks == cut.active_ranks == [*ranks[:2], 2, *ranks[3:]]  # masks reset to the new ranks, all active
    torch.testing.assert_close(cut(x), y, rtol=1e-12, atol=1e-14)
    for key, value in kept.state_dict().items():  # a quarter masked is under 0.4: untouched
        torch.testing.assert_close(value, kept_state[key], rtol=0, atol=0)
    assert not cut_sharded_([kept], 0.4, reshard) and len(calls) == 1  # nothing to cut: no reshard
