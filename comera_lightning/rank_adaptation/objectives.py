"""CoMERA's rank objective and its two-stage multi-objective schedule, as plain functions of tensors.

Training minimises two things: the task loss ``L`` and the model size ``S``. Ranks are made
differentiable by the gates: a gate entry at zero removes one rank slice, so a sparsity penalty ``R`` on
the gates is a surrogate of ``S``.

* :func:`rank_penalty` with ``weights=None`` is the research code's surrogate (mean ``|d|`` over active
  gate entries); with the layers' slice sizes it is the faithful one: each entry weighted by the number of
  parameters its slice holds, which is ``dS/d|d|``.
* Early stage (:func:`early_stage_weights`): ``L + gamma * R``.
* Late stage, the paper's rule (:func:`late_stage_weights`): achievement scalarisation towards targets
  ``L0`` and ``S0``; whichever objective is relatively further from its target gets the large weight.
* Late stage, the scheduled rule: the size follows a geometric schedule from the size at the switch down
  to ``S0`` (:func:`scheduled_size`); every few steps the least important rank slices
  (:func:`slice_importance`) are cut, at most a bounded share of each bond at a time
  (:func:`plan_rank_cuts`), so the task can recover between cuts.

RankAdaptation's per-step work, for any training loop: :func:`rank_gates` and :func:`add_rank_objective_`
before ``optimizer.step()``, :func:`refresh_masks_` and now and then :func:`truncate_dead_slices_` after it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..nn.base import TruncationRecord, TTLayer
from ..nn.distributed import full_tensor

__all__ = [
    "ObjectiveWeights",
    "add_rank_objective_",
    "all_finite",
    "compressible_target_size",
    "early_stage_weights",
    "late_stage_weights",
    "layer_removal_caps",
    "layers_to_truncate",
    "plan_rank_cuts",
    "rank_gates",
    "rank_penalty",
    "refresh_masks_",
    "scheduled_size",
    "slice_importance",
    "truncate_dead_slices_",
]


def rank_penalty(
    gates: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], weights: Sequence[float] | None = None
) -> torch.Tensor:
    """Weighted mean of ``|gate|`` over active entries of all bonds (1.0 when every gate is 1).

    Args:
        gates: one gate vector per bond (any number of layers, concatenated).
        masks: boolean active masks, same shapes.
        weights: one weight per bond (:meth:`TTLayer.slice_parameters`), or None for the plain mean.
    """
    if len(gates) != len(masks) or (weights is not None and len(weights) != len(gates)):
        raise ValueError("gates, masks and weights must have one entry per bond")
    if not gates:
        raise ValueError("rank_penalty needs at least one gate; the model has no comera layers")
    total = full_tensor(gates[0]).new_zeros(())
    normaliser = 0.0
    for k, (gate, mask) in enumerate(zip(gates, masks, strict=True)):
        w = 1.0 if weights is None else float(weights[k])
        gate = full_tensor(gate)  # FSDP2-sharded gates: the full vector (gradients flow back to the shards)
        active = mask.to(gate.dtype)
        total = total + w * (gate.abs() * active).sum()
        normaliser += w * float(mask.sum())
    return total / max(normaliser, 1e-12)


def rank_gates(
    layers: Sequence[TTLayer], trainable: Iterable[torch.Tensor] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """Gate, active mask and slice size (:meth:`TTLayer.slice_parameters`) of every bond of ``layers`` whose
    gate is in ``trainable`` (e.g. an optimiser's parameters; None: every bond)."""
    keep = None if trainable is None else {id(p) for p in trainable}
    bonds = [
        (gate, mask, size)
        for layer in layers
        for gate, mask, size in zip(layer.gates, layer.rank_masks, layer.slice_parameters(), strict=True)
        if keep is None or id(gate) in keep
    ]
    return [b[0] for b in bonds], [b[1] for b in bonds], [b[2] for b in bonds]


def all_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    """True when every tensor (None entries skipped) is finite; a single host sync for all of them."""
    flags = [torch.isfinite(full_tensor(t)).all() for t in tensors if t is not None]
    return not flags or bool(torch.stack(flags).all())


@dataclass(frozen=True)
class ObjectiveWeights:
    """Coefficients of ``task * L + penalty * R`` for one step; ``lam`` is the late-stage switch (0/1)."""

    task: float
    penalty: float
    lam: float = 0.0


def early_stage_weights(gamma: float) -> ObjectiveWeights:
    """Scalarisation ``L + gamma * R``."""
    return ObjectiveWeights(task=1.0, penalty=float(gamma), lam=0.0)


def late_stage_weights(
    loss: float,
    size: float,
    target_loss: float,
    target_size: float,
    task_base: float = 1.1,
    penalty_base: float = 0.01,
) -> ObjectiveWeights:
    """Achievement scalarisation: ``(task_base - lam) L + (penalty_base + lam) R``.

    ``lam = 1`` (push size) when the loss is relatively closer to its target than the size is,
    ``(L - L0) / L < (S - S0) / S``; otherwise ``lam = 0`` (push loss).
    """
    loss_gap = (loss - target_loss) / max(abs(loss), 1e-12)
    size_gap = (size - target_size) / max(abs(size), 1e-12)
    lam = 1.0 if loss_gap < size_gap else 0.0
    return ObjectiveWeights(task=task_base - lam, penalty=penalty_base + lam, lam=lam)


def add_rank_objective_(
    params: Iterable[torch.Tensor],
    gates: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    weights: ObjectiveWeights,
    bond_weights: Sequence[float] | None = None,
) -> float:
    """Turn the task's gradients (of ``params``, final: all-reduced, unscaled) into those of
    ``weights.task * L + weights.penalty * R``, with ``R = rank_penalty(gates, masks, bond_weights)``; returns R."""
    with torch.enable_grad():
        penalty = rank_penalty(gates, masks, bond_weights)
        penalty_grads = torch.autograd.grad(penalty, gates)
    if weights.task != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(weights.task)
    for gate, grad in zip(gates, penalty_grads, strict=True):
        grad = grad * weights.penalty
        gate.grad = grad if gate.grad is None else gate.grad.add_(grad)
    return float(penalty.detach())


def refresh_masks_(layers: Sequence[TTLayer], threshold: float | None = None) -> None:
    """Mask every slice whose gate is at or below ``threshold`` (None: each layer's own); check
    :func:`all_finite` on the gates first, as masks refreshed from NaN gates keep one slice per bond."""
    for layer in layers:
        layer.refresh_masks_(threshold)


def truncate_dead_slices_(layers: Sequence[TTLayer], min_dead_fraction: float) -> TruncationRecord:
    """Physically remove the masked slices of every layer where some bond has ``min_dead_fraction`` or more of
    its slices masked; returns what was resized (for :func:`comera_lightning.optim.slice_optimizer_state`)."""
    record = TruncationRecord()
    for layer in layers_to_truncate(layers, min_dead_fraction):
        record.extend(layer.truncate_())
    return record


def layers_to_truncate(layers: Sequence[TTLayer], min_dead_fraction: float) -> list[TTLayer]:
    """The layers where some bond has ``min_dead_fraction`` or more of its slices masked."""

    def dead(layer: TTLayer) -> float:  # (r - a) / r, not 1 - a / r: one dead slice of 10 is exactly 0.1
        return max(((r - a) / r for a, r in zip(layer.active_ranks[1:-1], layer.ranks[1:-1], strict=True)), default=0.0)

    return [layer for layer in layers if dead(layer) >= min_dead_fraction]


def compressible_target_size(size: float, other_parameters: float, ratio: float) -> float:
    """``S0`` for a ``ratio`` of the current size: only the tensorised part shrinks, ``other + ratio * TT``.

    The research code takes ``ratio`` of the TT size. A ratio of the whole model (dense layers included)
    can fall below what rank 1 everywhere allows when the dense part is large.
    """
    return other_parameters + ratio * max(size - other_parameters, 0.0)


def scheduled_size(step: int, start_step: int, ramp_steps: int, start_size: float, target_size: float) -> float:
    """Size the scheduled late stage aims at by ``step``: a geometric ramp from ``start_size`` to ``target_size``.

    ``S(t) = S_start * (S0 / S_start)^p`` with ``p = (t - t0) / ramp_steps`` clipped to [0, 1]: every step
    removes the same share of what is left, so no stretch of the ramp cuts harder than another. (A cubic
    ramp, Zhu and Gupta's pruning schedule, removed 80 % of the way in the first 40 % of the ramp and
    crashed masked-LM accuracy by 4.5 points; docs/results.md.)
    """
    if ramp_steps < 1:
        raise ValueError(f"ramp_steps must be >= 1, got {ramp_steps}")
    if not (start_size > 0 and target_size > 0):
        raise ValueError(f"sizes must be positive, got start {start_size} and target {target_size}")
    progress = min(max((step - start_step) / ramp_steps, 0.0), 1.0)
    return start_size * (target_size / start_size) ** progress


def slice_importance(gated_cores: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """How much each rank slice of every internal bond carries: one ``(r_k,)`` tensor per bond.

    Slice ``j`` of bond ``k`` joins the trailing slice ``j`` of core ``k`` to the leading slice ``j`` of core
    ``k+1``; its importance is the product of their Frobenius norms, with the gate folded into core ``k``
    (pass :meth:`TTLayer.gated_cores`). Scaling a slice between the gate and the cores leaves it unchanged,
    so a small gate whose core grew to compensate is not mistaken for a dead slice. Masked slices get 0.
    """
    if len(gated_cores) != len(masks) + 1:
        raise ValueError(
            f"a train of {len(gated_cores)} cores has {len(gated_cores) - 1} bonds, got {len(masks)} masks"
        )
    out = []
    for k, mask in enumerate(masks):
        left = gated_cores[k].detach().float().flatten(0, -2).norm(dim=0)
        right = gated_cores[k + 1].detach().float().flatten(1).norm(dim=1)
        out.append(left * right * mask.to(left.dtype))
    return out


def plan_rank_cuts(
    importances: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    slice_parameters: Sequence[float],
    parameters_to_remove: float,
    max_cut_fraction: float,
    groups: Sequence[int] | None = None,
    group_caps: Sequence[float] | None = None,
) -> list[list[int]]:
    """Which active slices to cut so that about ``parameters_to_remove`` parameters go, cheapest first.

    A slice's cost is its importance per parameter it frees (``importance / slice_parameters``), so a
    greedy pass removes the least importance for the size it buys: slices of a small outer bond, which
    hold few parameters, go only when they carry little. Importances must be comparable across bonds
    (e.g. Taylor saliencies, in loss units). Each bond loses at most
    ``max(1, floor(max_cut_fraction * active))`` slices per call and always keeps one.

    With ``groups`` (the layer of each bond) and ``group_caps`` (per layer, the parameters it may give up in
    this call; :func:`layer_removal_caps`), the greedy pass takes a layer's slices only while that layer is
    under its cap (the last slice may overshoot it); what the capped layers cannot give is then taken
    cheapest first from every layer, so the target is still reached when a layer is down to rank 1.

    Args:
        importances: per bond, one non-negative value per slice (masked slices are ignored).
        masks: per bond, the boolean active mask.
        slice_parameters: per bond, the parameters one slice holds (:meth:`TTLayer.slice_parameters`).
        parameters_to_remove: how many parameters the cuts should free (<= 0: none).
        max_cut_fraction: the per-call bound on a bond's share of active slices, in (0, 1].
        groups: per bond, the index of its layer into ``group_caps`` (None: one global ranking).
        group_caps: per layer, the most parameters the first pass removes from it.

    Returns:
        per bond, the indices to cut (possibly empty).
    """
    if not len(importances) == len(masks) == len(slice_parameters):
        raise ValueError("importances, masks and slice_parameters must have one entry per bond")
    if not 0.0 < max_cut_fraction <= 1.0:
        raise ValueError(f"max_cut_fraction must be in (0, 1], got {max_cut_fraction}")
    if (groups is None) != (group_caps is None):
        raise ValueError("groups and group_caps go together: pass both (capped per layer) or neither (global)")
    if groups is not None and len(groups) != len(masks):
        raise ValueError(f"groups needs one layer index per bond: {len(groups)} for {len(masks)} bonds")
    cuts: list[list[int]] = [[] for _ in masks]
    if parameters_to_remove <= 0:
        return cuts
    candidates = []
    allowance = []
    for k, (importance, mask) in enumerate(zip(importances, masks, strict=True)):
        active = torch.nonzero(mask, as_tuple=False).flatten()
        n = int(active.numel())
        allowance.append(0 if n <= 1 else min(n - 1, max(1, math.floor(max_cut_fraction * n))))
        if n <= 1:
            continue
        cost = importance.detach().float()[active] / max(float(slice_parameters[k]), 1e-30)
        candidates += [(float(c), k, int(j)) for c, j in zip(cost, active, strict=True)]
    candidates.sort()
    freed = 0.0
    if groups is not None and group_caps is not None:  # both or neither (checked above)
        freed_by_group = [0.0] * len(group_caps)
        taken = set()
        for _, k, j in candidates:
            if freed >= parameters_to_remove:
                return cuts
            g = groups[k]
            if len(cuts[k]) < allowance[k] and freed_by_group[g] < group_caps[g]:
                cuts[k].append(j)
                taken.add((k, j))
                freed_by_group[g] += float(slice_parameters[k])
                freed += float(slice_parameters[k])
        candidates = [c for c in candidates if (c[1], c[2]) not in taken]
    for _, k, j in candidates:
        if freed >= parameters_to_remove:
            break
        if len(cuts[k]) < allowance[k]:
            cuts[k].append(j)
            freed += float(slice_parameters[k])
    return cuts


def layer_removal_caps(
    layer_sizes: Sequence[float], reference_sizes: Sequence[float], parameters_to_remove: float, layer_floor: float
) -> list[float]:
    """Per layer, the most parameters a cut may take so that no layer falls below ``layer_floor`` of a uniform share.

    After the cut the layers hold ``keep = (sum(layer_sizes) - parameters_to_remove) / sum(reference_sizes)`` of
    what they held at the reference (the late stage's start); a uniform allocation would leave layer ``i`` at
    ``keep * reference_sizes[i]``, and the capped pass of :func:`plan_rank_cuts` takes it down to
    ``layer_floor * keep * reference_sizes[i]`` and no further. ``layer_floor = 0`` leaves the global ranking
    alone; ``1`` makes every layer shrink by the same factor, the importances only choosing slices within a layer.

    The global ranking drives whole layer kinds to rank 1 (the FFNs of the masked-LM, whose slices hold the
    most parameters and so cost the least per parameter), which first-order saliencies misjudge: removing a
    layer's last slices costs far more than their sum of saliencies says.
    """
    if not 0.0 <= layer_floor <= 1.0:
        raise ValueError(f"layer_floor must be in [0, 1], got {layer_floor}")
    if len(layer_sizes) != len(reference_sizes):
        raise ValueError(f"one reference size per layer: {len(reference_sizes)} for {len(layer_sizes)} layers")
    reference = float(sum(reference_sizes))
    keep = max(float(sum(layer_sizes)) - parameters_to_remove, 0.0) / reference if reference > 0 else 1.0
    return [
        max(float(size) - layer_floor * keep * float(ref), 0.0)
        for size, ref in zip(layer_sizes, reference_sizes, strict=True)
    ]
