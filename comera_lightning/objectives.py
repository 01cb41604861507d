"""CoMERA's rank objective and its two-stage multi-objective schedule, as plain functions of tensors.

Training minimises two things: the task loss ``L`` and the model size ``S``. Ranks are made
differentiable by the gates: a gate entry at zero removes one rank slice, so a sparsity penalty ``R`` on
the gates is a surrogate of ``S``.

* :func:`rank_penalty` with ``weights=None`` is the research code's surrogate (mean ``|d|`` over active
  gate entries); with :func:`bond_weights` it is the faithful one: each entry weighted by the number of
  parameters its slice holds, which is ``dS/d|d|``.
* Early stage (:func:`early_stage_weights`): ``L + gamma * R``.
* Late stage (:func:`late_stage_weights`): achievement scalarisation towards targets ``L0`` and ``S0``;
  whichever objective is relatively further from its target gets the large weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "bond_weights",
    "rank_penalty",
    "minimum_train_size",
    "ObjectiveWeights",
    "early_stage_weights",
    "late_stage_weights",
]


def bond_weights(mode_sizes: Sequence[int], active_ranks: Sequence[int]) -> list[float]:
    """Parameters held by one slice of every internal bond of a train.

    A slice of bond ``k`` is one trailing slice of core ``k`` (``r_{k-1} * s_k`` entries) plus one
    leading slice of core ``k+1`` (``s_{k+1} * r_{k+1}`` entries), counted with active ranks.
    """
    r = list(active_ranks)
    return [float(r[k] * mode_sizes[k] + mode_sizes[k + 1] * r[k + 2]) for k in range(len(mode_sizes) - 1)]


def rank_penalty(
    gates: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], weights: Sequence[float] | None = None
) -> torch.Tensor:
    """Weighted mean of ``|gate|`` over active entries of all bonds (1.0 when every gate is 1).

    Args:
        gates: one gate vector per bond (any number of layers, concatenated).
        masks: boolean active masks, same shapes.
        weights: one weight per bond (:func:`bond_weights`), or None for the plain mean.
    """
    if len(gates) != len(masks) or (weights is not None and len(weights) != len(gates)):
        raise ValueError("gates, masks and weights must have one entry per bond")
    if not gates:
        raise ValueError("rank_penalty needs at least one gate; the model has no comera layers")
    total = gates[0].new_zeros(())
    normaliser = 0.0
    for k, (gate, mask) in enumerate(zip(gates, masks)):
        w = 1.0 if weights is None else float(weights[k])
        active = mask.to(gate.dtype)
        total = total + w * (gate.abs() * active).sum()
        normaliser += w * float(mask.sum())
    return total / max(normaliser, 1e-12)


def minimum_train_size(mode_sizes: Sequence[int]) -> int:
    """Size of a train whose every bond is down to rank 1: the floor of what rank adaptation reaches."""
    return int(sum(mode_sizes))


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
