"""Rank gates, active masks, size accounting and physical truncation of tensor trains.

Every internal bond ``k`` of a train carries a gate vector ``d_k`` (fp32, initialised to 1) that scales
the trailing rank index of core ``k``. Slice ``j`` of bond ``k`` is *active* while ``|d_k[j]| > tau``;
once inactive it is masked (a persistent boolean mask, so a dead slice never revives through optimiser
momentum), and :func:`truncate_train` can remove it physically from ``G_k``, ``G_{k+1}`` and ``d_k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_THRESHOLD",
    "CoreSelection",
    "apply_gates",
    "bond_weights",
    "leading_share",
    "minimum_train_size",
    "refresh_mask",
    "select_rank_slices",
    "train_parameter_count",
    "truncate_train",
]

DEFAULT_THRESHOLD = 1e-2
"""The paper's ``tau``: a gate entry with ``|d| <= tau`` switches its rank slice off."""


def refresh_mask(gate: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """New mask of one bond: still active and ``|gate| > threshold``; never empty.

    A bond with no active slice would make the whole layer zero and its cores untrainable, so the
    slice with the largest ``|gate|`` among the previously active ones always survives.
    """
    magnitude = gate.detach().abs()
    new = mask & (magnitude > threshold)
    if not bool(new.any()):
        keep = torch.where(mask, magnitude, torch.full_like(magnitude, -1.0)).argmax()
        new = torch.zeros_like(mask)
        new[keep] = True
    return new


def leading_share(rank: int, keep: float) -> int:
    """How many leading slices of a bond of ``rank`` a ``keep`` share leaves: rounded, at least one."""
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"keep must be a share in [0, 1], got {keep}")
    return min(rank, max(1, round(keep * rank)))


def apply_gates(
    cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Cores with gate ``k`` (masked) multiplied into the trailing rank index of core ``k``."""
    gated = []
    for k, core in enumerate(cores):
        if k < len(gates):
            scale = (gates[k] * masks[k]).to(core.dtype)
            core = core * scale.reshape((1,) * (core.dim() - 1) + (-1,))
        gated.append(core)
    return gated


def train_parameter_count(mode_sizes: Sequence[int], ranks: Sequence[int]) -> int:
    """Parameters of a train: ``sum_k r_{k-1} * s_k * r_k`` (``s_k = v_k * e_k`` for a TTM core)."""
    return sum(ranks[k] * s * ranks[k + 1] for k, s in enumerate(mode_sizes))


def bond_weights(mode_sizes: Sequence[int], ranks: Sequence[int]) -> list[float]:
    """Parameters one slice of every internal bond holds: a trailing slice of core ``k`` (``r_{k-1} * s_k``)
    plus a leading slice of core ``k+1`` (``s_{k+1} * r_{k+1}``). The weighted rank penalty's bond weights."""
    r = list(ranks)
    return [float(r[k] * mode_sizes[k] + mode_sizes[k + 1] * r[k + 2]) for k in range(len(mode_sizes) - 1)]


def minimum_train_size(mode_sizes: Sequence[int]) -> int:
    """Size of a train whose every bond is down to rank 1: the floor of what rank adaptation reaches."""
    return int(sum(mode_sizes))


@dataclass(frozen=True)
class CoreSelection:
    """Which rank slices of one core survive a truncation: ``keep_first`` indexes dim 0 and
    ``keep_last`` dim -1 (None means all). Apply it to anything shaped like the core (the core itself,
    its gradient, its AdamW moments) with :func:`select_rank_slices`."""

    keep_first: torch.Tensor | None
    keep_last: torch.Tensor | None


def select_rank_slices(tensor: torch.Tensor, selection: CoreSelection) -> torch.Tensor:
    """``tensor`` (shaped like a core, or like a gate when 1-d) restricted to the kept rank slices."""
    if tensor.dim() == 1:
        return tensor if selection.keep_last is None else tensor.index_select(0, selection.keep_last)
    if selection.keep_first is not None:
        tensor = tensor.index_select(0, selection.keep_first.to(tensor.device))
    if selection.keep_last is not None:
        tensor = tensor.index_select(tensor.dim() - 1, selection.keep_last.to(tensor.device))
    return tensor.contiguous()


def truncate_train(masks: Sequence[torch.Tensor], num_cores: int) -> tuple[list[CoreSelection], list[CoreSelection]]:
    """Selections that drop every masked-off rank slice.

    Returns ``(core_selections, gate_selections)``: one per core and one per gate. The gated train
    computes exactly the same function before and after, because a masked slice contributes zero.
    """
    keeps = [torch.nonzero(mask, as_tuple=False).flatten() for mask in masks]
    core_selections = []
    for k in range(num_cores):
        first = keeps[k - 1] if k >= 1 else None
        last = keeps[k] if k < len(keeps) else None
        core_selections.append(CoreSelection(first, last))
    gate_selections = [CoreSelection(None, keep) for keep in keeps]
    return core_selections, gate_selections
