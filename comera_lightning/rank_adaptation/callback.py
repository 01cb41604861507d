"""RankAdaptation: CoMERA's rank-adaptive training as a callback for any LightningModule.

The callback never touches the user's loss. Once per optimiser step, in ``on_before_optimizer_step``
(gradients already all-reduced by DDP, unscaled by AMP, accumulated over micro-batches), it adds the
gradient of ``penalty_weight * R(gates)`` to the gates and scales the task gradients by ``task_weight``
(see :mod:`comera_lightning.rank_adaptation.objectives` for the two stages). After each step it masks rank slices whose
gate fell below the threshold and, on a schedule, removes dead slices physically, slicing the optimiser
state and re-wrapping DDP (under FSDP2, :class:`~comera_lightning.strategies.FSDP2Strategy` reshards the resized
parameters and their optimiser state) so training continues exactly. Every decision depends only on gate values and
all-reduced losses, identical on every process.

A diverged step never reaches the ranks: a step whose gradients were dropped (``DivergenceGuard``) or whose
gate gradients are not finite gets no penalty, a non-finite loss is left out of the smoothed loss, and masks
are never refreshed from non-finite gates (which would switch off every slice but one).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from ..nn.base import TruncationRecord, TTLayer
from ..nn.tensorize import tt_layers
from .cuts import after_truncation, truncate_sharded
from .late_stage import LateStagePolicy, late_stage_policy
from .objectives import (
    ObjectiveWeights,
    add_rank_objective_,
    all_finite,
    compressible_target_size,
    early_stage_weights,
    rank_gates,
    refresh_masks_,
    truncate_dead_slices_,
)

__all__ = ["RankAdaptation"]

EARLY, LATE = 0, 1


def planned_steps(trainer: Trainer) -> int | None:
    """The run's optimiser steps: Lightning's estimate, the fewer of ``max_steps`` and what ``max_epochs`` of the
    training dataloader give (the run stops at whichever comes first); None when the run has no finite length."""
    total = trainer.estimated_stepping_batches  # -1 for an unsized dataloader without max_steps
    return int(total) if total is not None and math.isfinite(total) and total > 0 else None


def _at_least(value: float | None, low: float) -> bool:
    """``value`` is None or at least ``low``."""
    return value is None or value >= low


def _finite(value: float | None) -> bool:
    """``value`` is None or a finite number."""
    return value is None or math.isfinite(value)


class RankAdaptation(Callback):
    """Learn the ranks of every comera layer while training, towards a target model size.

    Args:
        penalty: ``"weighted"`` (each gate entry weighted by the parameters its slice holds, the paper's
            size objective) or ``"mean"`` (mean of active gates, the research code).
        gamma: weight of the penalty in the early stage.
        late_start_epoch: enter the late stage at this epoch.
        late_start_step: enter the late stage at this optimiser step.
        late_start_loss: enter the late stage once the smoothed training loss is at or below this.
        late_start_fraction: enter the late stage after this share of the run's planned optimiser steps
            (``trainer.max_steps``, else ``trainer.estimated_stepping_batches``), so the schedule keeps its shape
            when the run's length changes. With none of the four set, training stays in the early stage.
        target_compression: late-stage size target as a compression ratio (dense-equivalent / active).
        target_size: late-stage size target in parameters (takes precedence over the ratio).
        target_size_ratio: without either target, the tensorised part shrinks to this share of its size at
            the switch, ``S0 = other + ratio * (S - other)`` (the research code's 0.2 of the TT size).
        target_loss: late-stage loss target ``L0``; None keeps the smoothed loss at the switch.
        late_stage: how the late stage reaches the size target: ``"scheduled"`` (bounded cuts of the least
            important slices on a schedule, the default chosen by measurement), ``"paper"`` (the research
            code's switching rule) or a :class:`~comera_lightning.rank_adaptation.late_stage.LateStagePolicy`.
        threshold: gate magnitude at or below which a slice dies; None uses each layer's own.
        mask_every_n_steps: how often (optimiser steps) dead slices are masked.
        truncate_every_n_steps: how often layers are checked for physical truncation; None never truncates.
        min_dead_fraction: truncate a layer when some bond has at least this fraction of dead slices.
        loss_key: key of the loss in a dict returned by ``training_step``.
        loss_smoothing: EMA factor of the (all-reduced) training loss used for decisions.
    """

    def __init__(
        self,
        penalty: Literal["weighted", "mean"] = "weighted",
        gamma: float = 0.01,
        late_start_epoch: int | None = None,
        late_start_step: int | None = None,
        late_start_loss: float | None = None,
        late_start_fraction: float | None = None,
        target_compression: float | None = None,
        target_size: int | None = None,
        target_size_ratio: float = 0.2,
        target_loss: float | None = None,
        late_stage: str | LateStagePolicy = "scheduled",
        threshold: float | None = None,
        mask_every_n_steps: int = 1,
        truncate_every_n_steps: int | None = 100,
        min_dead_fraction: float = 0.25,
        loss_key: str = "loss",
        loss_smoothing: float = 0.9,
    ) -> None:
        self.penalty, self.gamma, self.threshold = penalty, gamma, threshold
        self.late_start_epoch, self.late_start_step = late_start_epoch, late_start_step
        self.late_start_loss, self.late_start_fraction = late_start_loss, late_start_fraction
        self.target_compression, self.target_size_arg = target_compression, target_size
        self.target_size_ratio, self.target_loss_arg = target_size_ratio, target_loss
        self.mask_every_n_steps, self.truncate_every_n_steps = mask_every_n_steps, truncate_every_n_steps
        self.min_dead_fraction, self.loss_key, self.loss_smoothing = min_dead_fraction, loss_key, loss_smoothing
        self._check_settings()
        self.late_stage = late_stage_policy(late_stage)
        # state (checkpointed)
        self.stage = EARLY
        self.target_size: float | None = None
        self.target_loss: float | None = None
        self.loss_ema: float | None = None
        self.switch_step: int | None = None
        self.truncations = 0
        self._last_weights = early_stage_weights(gamma)
        self._last_penalty = float("nan")
        self._last_step = -1
        self._other_parameters = 0
        self._floor = 0
        self._nonfinite_steps = 0  # optimiser steps whose gate gradients were not finite (penalty not added)
        self._warned_nonfinite = False
        self._late_start_from_fraction: int | None = None  # late_start_fraction in steps, known at train start

    def _check_settings(self) -> None:
        """Refuse a setting outside its range, naming it and the rule."""
        if self.penalty not in ("weighted", "mean"):
            raise ValueError(f"penalty must be 'weighted' or 'mean', got {self.penalty!r}")
        compression, fraction, every = self.target_compression, self.late_start_fraction, self.truncate_every_n_steps
        for name, value, ok, rule in (
            ("gamma", self.gamma, math.isfinite(self.gamma) and self.gamma >= 0, ">= 0 and finite"),
            (
                "target_compression",
                compression,
                compression is None or (math.isfinite(compression) and compression > 1.0),
                "> 1 (dense / compressed) and finite",
            ),
            ("late_start_epoch", self.late_start_epoch, _at_least(self.late_start_epoch, 0), ">= 0 or None"),
            ("late_start_step", self.late_start_step, _at_least(self.late_start_step, 0), ">= 0 or None"),
            ("late_start_loss", self.late_start_loss, _finite(self.late_start_loss), "a finite number or None"),
            (
                "late_start_fraction",
                fraction,
                fraction is None or 0.0 <= fraction < 1.0,
                "in [0, 1) (a share of the run's optimiser steps) or None",
            ),
            ("target_loss", self.target_loss_arg, _finite(self.target_loss_arg), "a finite number or None"),
            ("target_size", self.target_size_arg, _at_least(self.target_size_arg, 1), "a positive parameter count"),
            ("target_size_ratio", self.target_size_ratio, 0.0 < self.target_size_ratio < 1.0, "in (0, 1)"),
            (
                "threshold",
                self.threshold,
                self.threshold is None or 0.0 <= self.threshold < 1.0,
                "in [0, 1) (gates start at 1)",
            ),
            ("mask_every_n_steps", self.mask_every_n_steps, self.mask_every_n_steps >= 1, ">= 1"),
            ("truncate_every_n_steps", every, _at_least(every, 1), ">= 1 or None"),
            ("min_dead_fraction", self.min_dead_fraction, 0.0 < self.min_dead_fraction <= 1.0, "in (0, 1]"),
            ("loss_smoothing", self.loss_smoothing, 0.0 <= self.loss_smoothing < 1.0, "in [0, 1)"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {value}")

    # --- policy (override to change the schedule) ----------------------------------------------------
    def should_enter_late_stage(self, trainer: Trainer) -> bool:
        """True once the configured switch rule fires; evaluated after every optimiser step."""
        if self.late_start_step is not None and trainer.global_step >= self.late_start_step:
            return True
        if self.late_start_epoch is not None and trainer.current_epoch >= self.late_start_epoch:
            return True
        if self._late_start_from_fraction is not None and trainer.global_step >= self._late_start_from_fraction:
            return True
        return self.late_start_loss is not None and self.loss_ema is not None and self.loss_ema <= self.late_start_loss

    def needs_loss(self) -> bool:
        """Whether to track ``loss_ema`` after this step (a host sync and, under DDP, an all-reduce per step):
        in the late stage, and before it with a switch rule. Override it with :meth:`should_enter_late_stage`
        when a custom rule reads ``loss_ema``; otherwise the loss is first read at the switch."""
        switch_rule = (self.late_start_epoch, self.late_start_step, self.late_start_loss, self.late_start_fraction)
        return self.stage == LATE or any(v is not None for v in switch_rule)

    def objective_weights(self, size: float) -> ObjectiveWeights:
        """Coefficients of task loss and penalty for the coming step."""
        if self.stage == EARLY or self.loss_ema is None:
            return early_stage_weights(self.gamma)
        assert self.target_size is not None and self.target_loss is not None
        return self.late_stage.weights(self.loss_ema, size, self.target_loss, self.target_size, self.gamma)

    # --- sizes ---------------------------------------------------------------------------------------
    @staticmethod
    def _layers(pl_module: LightningModule) -> list[TTLayer]:
        return [layer for _, layer in tt_layers(pl_module)]

    def model_size(self, pl_module: LightningModule) -> int:
        """Active parameters: unmasked TT slices plus every other parameter."""
        return sum(layer.active_parameters() for layer in self._layers(pl_module)) + self._other_parameters

    # --- hooks ---------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        # FSDP1 and DeepSpeed flatten parameters into fixed-size buffers (DeepSpeed is a DDPStrategy subclass);
        # FSDP2 keeps them apart, and FSDP2Strategy reshards them after a cut
        resizable = (
            isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or truncate_sharded(strategy) is not None
        ) and not isinstance(strategy, DeepSpeedStrategy)
        if stage == "fit" and self.truncate_every_n_steps is not None and not resizable:
            fix = (
                "use comera_lightning.strategies.FSDP2Strategy, which reshards after a cut"
                if isinstance(strategy, ModelParallelStrategy)
                else "use a DDP strategy or comera_lightning.strategies.FSDP2Strategy (FSDP2)"
            )
            raise ValueError(
                f"physical rank truncation is not supported under {type(strategy).__name__} (a cut changes parameter "
                f"shapes, which this strategy cannot reshard); {fix}, or keep masking only with "
                f"RankAdaptation(truncate_every_n_steps=None)"
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        layers = self._layers(pl_module)
        if not layers:
            raise ValueError(
                "RankAdaptation found no comera layers (TTLinear/TTEmbedding) in the LightningModule; "
                "build the model with them or call comera_lightning.tensorize(model) first"
            )
        tt_ids = {id(p) for layer in layers for p in [*layer.cores, *layer.gates]}
        self._other_parameters = sum(p.numel() for p in pl_module.parameters() if id(p) not in tt_ids)
        gate_ids = {id(g) for layer in layers for g in layer.gates}
        optimised = {id(p) for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}
        if not gate_ids <= optimised:
            raise ValueError(
                "the rank gates are not in any optimiser, so ranks cannot adapt; include all parameters "
                "(or use comera_lightning.optim.comera_parameter_groups) in configure_optimizers"
            )
        self._floor = floor = sum(layer.minimum_parameters() for layer in layers) + self._other_parameters
        dense = sum(layer.dense_parameters for layer in layers) + self._other_parameters
        wanted = self._requested_target_size(dense)
        if wanted is not None and wanted < floor:
            raise ValueError(
                f"the target size of {wanted:,.0f} parameters (compression {dense / wanted:.1f}x) is impossible: "
                f"with every rank at 1 the model still has {floor:,} parameters (at most {dense / floor:.1f}x); "
                f"lower target_compression / raise target_size"
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # here, unlike at fit start, a resumed run's global_step is already restored
        self._last_step = trainer.global_step
        if self.late_start_fraction is not None:
            total = planned_steps(trainer)
            if total is None:
                raise ValueError(
                    "RankAdaptation(late_start_fraction=...) needs the run's length, but this run has no finite "
                    "number of optimiser steps; set trainer.max_steps (or max_epochs with a sized training "
                    "dataloader), or give late_start_step instead"
                )
            self._late_start_from_fraction = round(self.late_start_fraction * total)

    def _requested_target_size(self, dense: float) -> float | None:
        if self.target_size_arg is not None:
            return float(self.target_size_arg)
        if self.target_compression is not None:
            return dense / self.target_compression
        return None

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if all(p.grad is None for p in params):
            return  # the step was dropped (e.g. by DivergenceGuard): a penalty gradient alone would move the gates
        layers = self._layers(pl_module)
        gates, masks, slice_parameters = rank_gates(layers, params)
        if not gates:
            return
        if not all_finite(g.grad for g in gates):
            # a diverged step (dropped by DivergenceGuard or the AMP GradScaler, or poisoning the model anyway):
            # adding to or rescaling its gradients would change nothing useful
            self._nonfinite_steps += 1
            return
        if self.stage == LATE:
            self.late_stage.observe(layers)
        self._last_weights = weights = self.objective_weights(self.model_size(pl_module))
        self._last_penalty = add_rank_objective_(
            params, gates, masks, weights, slice_parameters if self.penalty == "weighted" else None
        )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:  # accumulating: no optimiser step happened
            return
        self._last_step = step
        if self.needs_loss():
            self._update_loss(trainer, outputs)
        layers = self._layers(pl_module)
        if not all_finite(g.detach() for layer in layers for g in layer.gates):
            # masks refreshed from NaN gates would kill every rank but one: leave masks and sizes alone
            if not self._warned_nonfinite:
                rank_zero_warn(
                    f"RankAdaptation: rank gates are not finite after step {step}; masks and truncation are "
                    "left unchanged. Training has diverged: add comera_lightning.callbacks.DivergenceGuard, "
                    "lower the learning rates or enable gradient clipping",
                    category=UserWarning,
                )
                self._warned_nonfinite = True
            return
        if step % self.mask_every_n_steps == 0:
            refresh_masks_(layers, self.threshold)
        if self.stage == EARLY and self.should_enter_late_stage(trainer):
            if self.loss_ema is None:
                self._update_loss(trainer, outputs)  # a switch rule that did not ask for the loss before
            self._enter_late_stage(trainer, pl_module)
        elif self.stage == LATE and self.loss_ema is not None:
            self.late_stage.cut(step, self.loss_ema, self.model_size(pl_module), layers)
        if self.truncate_every_n_steps is not None and step % self.truncate_every_n_steps == 0:
            self.truncate(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.stage != LATE or self.target_size is None:
            return
        size = self.model_size(pl_module)
        if size > 1.02 * self.target_size:
            rank_zero_warn(
                f"RankAdaptation: training ended at {size:,} active parameters, above the late stage's target of "
                f"{self.target_size:,.0f} ({size / self.target_size:.2f}x); start the late stage earlier, train "
                "longer, or let the late stage cut faster (ScheduledLateStage: ramp_fraction, max_cut_fraction)",
                category=UserWarning,
            )

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.stage == EARLY and self.late_start_epoch is not None and trainer.current_epoch >= self.late_start_epoch:
            self._enter_late_stage(trainer, pl_module)

    # --- actions -------------------------------------------------------------------------------------
    def _update_loss(self, trainer: Trainer, outputs: Any) -> None:
        loss = outputs.get(self.loss_key) if isinstance(outputs, dict) else outputs
        if not torch.is_tensor(loss):
            raise ValueError(
                f"RankAdaptation needs the training loss but training_step returned {type(outputs).__name__}; "
                f"return the loss tensor or a dict with key {self.loss_key!r} (set loss_key otherwise)"
            )
        value = float(trainer.strategy.reduce(loss.detach().float(), reduce_op="mean"))
        if not math.isfinite(value):
            return  # a non-finite loss must not poison the decisions
        a = self.loss_smoothing
        self.loss_ema = value if self.loss_ema is None else a * self.loss_ema + (1 - a) * value

    def _enter_late_stage(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.loss_ema is None:
            return  # no loss seen yet; try again after the next step
        layers = self._layers(pl_module)
        dense = sum(layer.dense_parameters for layer in layers) + self._other_parameters
        size = self.model_size(pl_module)
        requested = self._requested_target_size(dense)
        if requested is None:
            requested = compressible_target_size(size, self._other_parameters, self.target_size_ratio)
        if requested < self._floor:
            rank_zero_warn(
                f"RankAdaptation: the size target of {requested:,.0f} parameters is below what rank 1 everywhere "
                f"allows ({self._floor:,}); aiming for that floor instead (compression {dense / self._floor:.1f}x). "
                "Raise target_size / target_size_ratio or lower target_compression",
                category=UserWarning,
            )
        self.target_size = max(requested, float(self._floor))
        self.target_loss = self.target_loss_arg if self.target_loss_arg is not None else self.loss_ema
        self.stage = LATE
        self.switch_step = trainer.global_step
        self.late_stage.start(trainer.global_step, size, self.target_size, planned_steps(trainer))
        rank_zero_info(
            f"RankAdaptation: late stage from step {trainer.global_step}: size {size:,} -> target "
            f"{self.target_size:,.0f} parameters, loss target {self.target_loss:.4g}"
        )

    def truncate(self, trainer: Trainer, pl_module: LightningModule) -> TruncationRecord:
        """Physically remove dead slices from every layer with enough of them; returns what changed."""
        layers = self._layers(pl_module)
        sharded = truncate_sharded(trainer.strategy)
        if sharded is not None:
            record = sharded(layers, self.min_dead_fraction)
        else:
            record = truncate_dead_slices_(layers, self.min_dead_fraction)
            after_truncation(trainer, record)
        if record:
            self.late_stage.after_truncation(record)
            self.truncations += 1
        return record

    # --- reporting and state -------------------------------------------------------------------------
    def comera_metrics(self) -> dict[str, float]:
        """Scalars for RankMonitor: stage, last penalty value and objective weights, targets."""
        metrics = {
            "comera/stage": float(self.stage),
            "comera/penalty": self._last_penalty,
            "comera/lambda": self._last_weights.lam,
            "comera/task_weight": self._last_weights.task,
            "comera/penalty_weight": self._last_weights.penalty,
            "comera/truncations": float(self.truncations),
        }
        if self.target_size is not None:
            metrics["comera/target_size"] = float(self.target_size)
        if self.stage == LATE:
            metrics.update(self.late_stage.metrics())
        if self.loss_ema is not None:
            metrics["comera/loss_ema"] = self.loss_ema
        return metrics

    # what a checkpoint keeps of the run, besides the late-stage policy's own state
    _STATE: ClassVar[tuple[str, ...]] = (
        "stage",
        "target_size",
        "target_loss",
        "loss_ema",
        "switch_step",
        "truncations",
    )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**{key: getattr(self, key) for key in self._STATE}, "late_stage": self.late_stage.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in self._STATE:
            setattr(self, key, state_dict.get(key))
        self.stage = int(state_dict.get("stage", EARLY))
        self.truncations = int(state_dict.get("truncations", 0))
        self.late_stage.load_state_dict(state_dict.get("late_stage", {}))
