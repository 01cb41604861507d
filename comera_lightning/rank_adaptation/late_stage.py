"""Late-stage policies of :class:`RankAdaptation`: how the model is brought down to its size target.

Once the late stage starts, the callback knows a size target ``S0`` and a loss target ``L0``. A policy
decides two things every optimiser step: the weights of task loss and rank penalty
(:meth:`LateStagePolicy.weights`), and whether to remove rank slices now (:meth:`LateStagePolicy.cut`).

* :class:`PaperLateStage` is the research code's rule: ``lam`` in {0, 1} switches the step between pushing
  the loss and pushing the size, and slices die when their gate falls below the threshold. With ``lam = 1``
  every gate is driven down at the optimiser's full step size at once, so many slices cross the threshold
  together and accuracy crashes (measured in docs/results.md).
* :class:`ScheduledLateStage` keeps the early stage's objective (so the penalty keeps sorting slices by
  usefulness) and removes slices itself: the size follows a geometric schedule down to ``S0``, every
  ``cut_every_n_steps`` the least important slices are cut, at most ``max_cut_fraction`` of a bond's active
  slices per cut, and a cut waits while the loss has not recovered from the previous one.

A new policy is a new subclass; pass an instance as ``RankAdaptation(late_stage=...)`` (in YAML, a
``class_path``), or the name ``"paper"`` / ``"scheduled"``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ..nn.base import TruncationRecord, TTLayer
from ..nn.distributed import full_tensor
from .objectives import (
    ObjectiveWeights,
    early_stage_weights,
    late_stage_weights,
    layer_removal_caps,
    plan_rank_cuts,
    scheduled_size,
    slice_importance,
)

__all__ = ["LateStagePolicy", "PaperLateStage", "ScheduledLateStage", "late_stage_policy", "ramp_fraction_for"]

# The scheduled ramp's length by default (docs/results.md, "Late-stage ramp length"): a share of the late stage for
# a cut of up to REFERENCE_CUT in size, longer in proportion to log(cut) beyond it, and never past MAX_RAMP_FRACTION
# so the last steps train at the final size. Masked-LM at 50x (a 13x cut): 0.9 instead of 0.6 ended 0.6-1.7 points
# higher with its worst dip 0.2-1.5 points instead of 2.8-3.0; at 5x-20x 0.9 was no better than 0.6.
BASE_RAMP_FRACTION, REFERENCE_CUT, MAX_RAMP_FRACTION = 0.6, 5.0, 0.9


def ramp_fraction_for(start_size: float, target_size: float) -> float:
    """The default share of the late stage the size schedule takes to go from ``start_size`` to ``target_size``:
    0.6 for a cut of up to 5x, growing with ``log(start / target)`` beyond, at most 0.9."""
    if not (start_size > 0 and target_size > 0):
        raise ValueError(f"sizes must be positive, got start {start_size} and target {target_size}")
    depth = math.log(max(start_size / target_size, 1.0)) / math.log(REFERENCE_CUT)
    return min(MAX_RAMP_FRACTION, BASE_RAMP_FRACTION * max(1.0, depth))


class LateStagePolicy:
    """Base class: the paper's weights, no cuts. Override :meth:`weights` and/or :meth:`cut`."""

    def start(self, step: int, size: float, target_size: float, total_steps: int | None) -> None:
        """Called once when the late stage begins (``total_steps``: the run's planned optimiser steps, if known)."""

    def weights(
        self, loss: float, size: float, target_loss: float, target_size: float, gamma: float
    ) -> ObjectiveWeights:
        """Coefficients of task loss and rank penalty for the coming step."""
        raise NotImplementedError

    def observe(self, layers: Sequence[TTLayer]) -> None:
        """Called before every optimiser step with the task's gradients in place (no penalty added yet)."""

    def cut(self, step: int, loss: float, size: float, layers: Sequence[TTLayer]) -> int:
        """Mask rank slices after an optimiser step; returns how many were cut (no physical resize here)."""
        return 0

    def after_truncation(self, record: TruncationRecord) -> None:
        """Called after slices were physically removed (``record`` says which survived)."""

    def metrics(self) -> dict[str, float]:
        """Scalars for RankMonitor."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class PaperLateStage(LateStagePolicy):
    """The research code's achievement scalarisation ``(task_weight_base - lam) L + (penalty_weight_base + lam) R``.

    Args:
        task_weight_base: must exceed 1 so the task keeps a positive weight while ``lam = 1``.
        penalty_weight_base: the penalty's weight while ``lam = 0``.
    """

    def __init__(self, task_weight_base: float = 1.1, penalty_weight_base: float = 0.01) -> None:
        if not (math.isfinite(task_weight_base) and task_weight_base > 1.0):
            raise ValueError(
                f"task_weight_base must be > 1 so the task loss keeps a positive weight (task_weight_base - 1) "
                f"while the late stage pushes the size, got {task_weight_base}"
            )
        if not (math.isfinite(penalty_weight_base) and penalty_weight_base >= 0):
            raise ValueError(f"penalty_weight_base must be >= 0 and finite, got {penalty_weight_base}")
        self.task_weight_base = task_weight_base
        self.penalty_weight_base = penalty_weight_base

    def weights(
        self, loss: float, size: float, target_loss: float, target_size: float, gamma: float
    ) -> ObjectiveWeights:
        return late_stage_weights(loss, size, target_loss, target_size, self.task_weight_base, self.penalty_weight_base)


class ScheduledLateStage(LateStagePolicy):
    """Reach the size target on a schedule, cutting the least important slices a bounded share at a time.

    Args:
        ramp_fraction: the schedule reaches the target after this share of the steps left at the switch. None:
            :func:`ramp_fraction_for` the cut at the switch (0.6 up to a 5x cut, longer for deeper cuts, at most 0.9).
        ramp_steps: the same as a step count (takes precedence; needed when the run's length is unknown).
        cut_every_n_steps: steps between cuts (the recovery time a cut gets at least).
        max_cut_fraction: a cut removes at most this share of a bond's active slices (at least one slice
            while the bond has two or more).
        loss_tolerance: a cut waits while the smoothed loss exceeds the one before the previous cut by
            more than this relative amount...
        max_pause_steps: ...but not longer than this many steps (None: 4 x ``cut_every_n_steps``), so the
            target is still reached.
        penalty_weight: weight of the rank penalty in the late stage; None keeps the early stage's ``gamma``.
        importance: how slices are ranked for a cut. ``"taylor"``: a running mean of ``|d_j * dL/dd_j|``,
            the first-order change of the loss if gate ``d_j`` went to zero (the gate is a multiplicative
            mask on its slice, so this is exactly what removing the slice costs to first order), averaged
            over ``saliency_smoothing``; ``"norm"``: the product of the slice's core norms
            (:func:`~comera_lightning.rank_adaptation.objectives.slice_importance`) relative to its bond's mean,
            which needs no gradients. Either way a cut takes the slices with the least importance per parameter freed.
        saliency_smoothing: EMA factor of the Taylor saliency.
        layer_floor: allocation across layers, in [0, 1]. When the cuts have left the TT layers a fraction
            ``keep`` of their size at the switch, no layer is cut below ``layer_floor * keep`` of its own size
            at the switch (as long as other layers can still give;
            :func:`~comera_lightning.rank_adaptation.objectives.layer_removal_caps`). ``0`` ranks every slice
            globally, which starves whole layer kinds (the masked-LM's FFNs ended at rank 1); ``1`` shrinks every
            layer by the same factor.
    """

    def __init__(
        self,
        ramp_fraction: float | None = None,
        ramp_steps: int | None = None,
        cut_every_n_steps: int = 25,
        max_cut_fraction: float = 0.1,
        loss_tolerance: float = 0.02,
        max_pause_steps: int | None = None,
        penalty_weight: float | None = None,
        importance: str = "taylor",
        saliency_smoothing: float = 0.95,
        layer_floor: float = 0.0,
    ) -> None:
        for name, value, ok, rule in (
            ("ramp_fraction", ramp_fraction, ramp_fraction is None or 0.0 < ramp_fraction <= 1.0, "in (0, 1] or None"),
            ("ramp_steps", ramp_steps, ramp_steps is None or ramp_steps >= 1, ">= 1 or None"),
            ("cut_every_n_steps", cut_every_n_steps, cut_every_n_steps >= 1, ">= 1"),
            ("max_cut_fraction", max_cut_fraction, 0.0 < max_cut_fraction <= 1.0, "in (0, 1]"),
            (
                "loss_tolerance",
                loss_tolerance,
                math.isfinite(loss_tolerance) and loss_tolerance >= 0,
                ">= 0 and finite",
            ),
            (
                "penalty_weight",
                penalty_weight,
                penalty_weight is None or (math.isfinite(penalty_weight) and penalty_weight >= 0),
                ">= 0 and finite or None",
            ),
            ("importance", repr(importance), importance in ("taylor", "norm"), "'taylor' or 'norm'"),
            ("saliency_smoothing", saliency_smoothing, 0.0 <= saliency_smoothing < 1.0, "in [0, 1)"),
            ("layer_floor", layer_floor, 0.0 <= layer_floor <= 1.0, "in [0, 1]"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {value}")
        if max_pause_steps is not None and max_pause_steps < cut_every_n_steps:
            raise ValueError(
                f"max_pause_steps ({max_pause_steps}) must be >= cut_every_n_steps ({cut_every_n_steps}) or None"
            )
        self.ramp_fraction, self.ramp_steps, self.cut_every_n_steps = ramp_fraction, ramp_steps, cut_every_n_steps
        self.max_cut_fraction, self.loss_tolerance, self.penalty_weight = (
            max_cut_fraction,
            loss_tolerance,
            penalty_weight,
        )
        self.max_pause_steps = 4 * cut_every_n_steps if max_pause_steps is None else max_pause_steps
        self.importance, self.saliency_smoothing, self.layer_floor = importance, saliency_smoothing, layer_floor
        # state (checkpointed)
        self.start_step: int | None = None
        self.start_size: float | None = None
        self.target_size: float | None = None
        self.ramp: int | None = None
        self.last_cut_step: int | None = None
        self.loss_before_last_cut: float | None = None
        self.slices_cut = 0
        self.layer_sizes_at_start: list[int] | None = None  # active parameters per layer at the first cut
        self.saliency: dict[str, torch.Tensor] = {}  # "<layer index>.<bond>" -> running |d * dL/dd|
        self._gate_keys: dict[int, str] = {}
        self._goal = float("nan")

    def start(self, step: int, size: float, target_size: float, total_steps: int | None) -> None:
        if self.ramp_steps is not None:
            ramp = self.ramp_steps
        elif total_steps is not None and math.isfinite(total_steps):
            # a switch at the very end leaves nothing to schedule: one step, which never comes
            share = ramp_fraction_for(size, target_size) if self.ramp_fraction is None else self.ramp_fraction
            ramp = max(1, round(share * (total_steps - step)))
        else:
            raise ValueError(
                "ScheduledLateStage cannot size its schedule: the run's length is unknown (no max_steps / "
                "max_epochs, e.g. max_time only); set ramp_steps"
            )
        self.start_step, self.start_size, self.target_size, self.ramp = step, float(size), float(target_size), ramp

    def goal(self, step: int) -> float:
        """The size the schedule asks for at ``step``."""
        assert self.start_step is not None and self.ramp is not None, "start() was not called"
        assert self.start_size is not None and self.target_size is not None, "start() was not called"
        return scheduled_size(step, self.start_step, self.ramp, self.start_size, self.target_size)

    def weights(
        self, loss: float, size: float, target_loss: float, target_size: float, gamma: float
    ) -> ObjectiveWeights:
        return early_stage_weights(gamma if self.penalty_weight is None else self.penalty_weight)

    @torch.no_grad()
    def observe(self, layers: Sequence[TTLayer]) -> None:
        if self.importance != "taylor":
            return
        a = self.saliency_smoothing
        # ids of the gates alive now only: a cut under FSDP2 replaces parameter objects, and a freed id is reused
        self._gate_keys = {id(gate): f"{i}.{k}" for i, layer in enumerate(layers) for k, gate in enumerate(layer.gates)}
        for i, layer in enumerate(layers):
            for k, gate in enumerate(layer.gates):
                if gate.grad is None:
                    continue
                key = f"{i}.{k}"
                value = (full_tensor(gate.detach()) * full_tensor(gate.grad)).abs().float()
                previous = self.saliency.get(key)
                if previous is None or previous.shape != value.shape:
                    self.saliency[key] = value.clone()
                else:
                    previous.mul_(a).add_(value, alpha=1.0 - a)

    def after_truncation(self, record: TruncationRecord) -> None:
        for param, selection in record:
            key = self._gate_keys.get(id(param))
            if key in self.saliency and selection.keep_last is not None:
                self.saliency[key] = self.saliency[key].index_select(
                    0, selection.keep_last.to(self.saliency[key].device)
                )

    def _importances(self, layers: Sequence[TTLayer]) -> list[torch.Tensor]:
        out = []
        for i, layer in enumerate(layers):
            if self.importance == "norm":
                # norms of different layers are not comparable: each slice relative to its bond's mean
                with torch.no_grad():
                    for value, mask in zip(
                        slice_importance(layer.gated_cores(), layer.rank_masks), layer.rank_masks, strict=True
                    ):
                        out.append(value / value[mask].mean().clamp_min(1e-30))
                continue
            for k, mask in enumerate(layer.rank_masks):
                saliency = self.saliency.get(f"{i}.{k}")
                if saliency is None or saliency.shape != mask.shape:
                    raise RuntimeError(
                        f"ScheduledLateStage has no gradient saliency for bond {k} of layer {i}; observe() must "
                        "run before every optimiser step (RankAdaptation does this), or use importance='norm'"
                    )
                out.append(saliency * mask.to(saliency.dtype))
        return out

    def cut(self, step: int, loss: float, size: float, layers: Sequence[TTLayer]) -> int:
        if self.start_step is None:
            return 0
        self._goal = self.goal(step)
        since = step - (self.start_step if self.last_cut_step is None else self.last_cut_step)
        if since < self.cut_every_n_steps or size <= self._goal:
            return 0
        recovering = self.loss_before_last_cut is not None and loss > self.loss_before_last_cut * (
            1.0 + self.loss_tolerance
        )
        if recovering and since < self.max_pause_steps:
            return 0
        importances = self._importances(layers)
        masks, slice_params, owners = [], [], []
        for layer in layers:
            masks += layer.rank_masks
            slice_params += layer.slice_parameters()
            owners += [(layer, k) for k in range(layer.num_bonds)]
        groups = caps = None
        sizes = [layer.active_parameters() for layer in layers]
        if self.layer_sizes_at_start is None or len(self.layer_sizes_at_start) != len(sizes):
            self.layer_sizes_at_start = sizes
        if self.layer_floor > 0:
            groups = [i for i, layer in enumerate(layers) for _ in range(layer.num_bonds)]
            caps = layer_removal_caps(sizes, self.layer_sizes_at_start, size - self._goal, self.layer_floor)
        cuts = plan_rank_cuts(importances, masks, slice_params, size - self._goal, self.max_cut_fraction, groups, caps)
        count = 0
        for (layer, k), indices in zip(owners, cuts, strict=True):
            if indices:
                layer.remove_slices_(k, indices)
                count += len(indices)
        if count:
            self.last_cut_step, self.loss_before_last_cut = step, loss
            self.slices_cut += count
        return count

    def metrics(self) -> dict[str, float]:
        return {"comera/size_goal": self._goal, "comera/slices_cut": float(self.slices_cut)}

    # what a checkpoint keeps of the schedule, besides the saliency tensors
    _STATE: ClassVar[tuple[str, ...]] = (
        "start_step",
        "start_size",
        "target_size",
        "ramp",
        "last_cut_step",
        "loss_before_last_cut",
        "slices_cut",
        "layer_sizes_at_start",
    )

    def state_dict(self) -> dict[str, Any]:
        return {
            **{key: getattr(self, key) for key in self._STATE},
            "saliency": {k: v.clone() for k, v in self.saliency.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key in self._STATE:
            setattr(self, key, state_dict.get(key))
        self.slices_cut = int(state_dict.get("slices_cut", 0))
        self.saliency = {k: v.clone() for k, v in state_dict.get("saliency", {}).items()}


_BY_NAME = {"paper": PaperLateStage, "scheduled": ScheduledLateStage}


def late_stage_policy(policy: str | LateStagePolicy) -> LateStagePolicy:
    """A policy instance from a name (``"paper"``, ``"scheduled"``) or an instance."""
    if isinstance(policy, LateStagePolicy):
        return policy
    if policy not in _BY_NAME:
        raise ValueError(
            f"unknown late-stage policy {policy!r}; use one of {sorted(_BY_NAME)} or a LateStagePolicy instance"
        )
    return _BY_NAME[policy]()
