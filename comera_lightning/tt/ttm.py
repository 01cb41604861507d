"""TT-matrix embedding lookups.

Row ``i`` of a TTM table is the chain ``F_1[:, v_1(i), :, :] ... F_K[:, v_K(i), :, :]`` where
``v_k(i)`` are the mixed-radix digits of ``i``. The *half-merge* lookup merges the first and the last
half of the cores once per call (batch-free), so each token costs one gather from each half plus one
``(E_left x r) @ (r x E_right)`` product, instead of ``K - 1`` products along the chain.
:func:`ttm_halves` is the merge alone and :func:`ttm_lookup_halves` the per-token part, so a caller that
looks up many times with unchanged cores (inference) can keep the halves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["merge_ttm", "split_point", "ttm_halves", "ttm_lookup", "ttm_lookup_chain", "ttm_lookup_halves"]


def split_point(num_cores: int) -> int:
    """Cores ``[0, split)`` form the left half of the half-merge lookup."""
    return (num_cores + 1) // 2


def merge_ttm(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge TTM cores ``(r, v, e, r')`` into one ``(r_first, V, E, r_last)`` block (rows/cols row-major)."""
    merged = cores[0]
    for core in cores[1:]:
        r0, rows, cols, _ = merged.shape
        _, v, e, r_next = core.shape
        merged = torch.einsum("avec,cwfd->avwefd", merged, core).reshape(r0, rows * v, cols * e, r_next)
    return merged


def ttm_halves(cores: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch-free part of the half-merge lookup: the merged left half ``(V_left, E_left, r)`` and right
    half ``(r, V_right, E_right)`` (ones ``(1, 1, 1)`` for a one-core train)."""
    split = split_point(len(cores))
    left = merge_ttm(cores[:split])[0]
    right = merge_ttm(cores[split:])[..., 0] if split < len(cores) else left.new_ones(1, 1, 1)
    return left, right


def ttm_lookup_halves(
    left: torch.Tensor, right: torch.Tensor, ids: torch.Tensor, deduplicate: bool = False
) -> torch.Tensor:
    """Rows ``ids`` (1-d, already validated) of the TTM table whose :func:`ttm_halves` are ``left``, ``right``:
    one gather from each half and one ``(E_left x r) @ (r x E_right)`` product per id.

    With ``deduplicate`` each distinct id is computed once and scattered back.
    """
    if deduplicate and ids.numel() > 1:
        unique, inverse = torch.unique(ids, return_inverse=True)
        return ttm_lookup_halves(left, right, unique).index_select(0, inverse)
    right_rows = right.shape[1]
    row_left, row_right = torch.div(ids, right_rows, rounding_mode="floor"), ids.remainder(right_rows)
    rows = torch.bmm(left.index_select(0, row_left), right.transpose(0, 1).index_select(0, row_right))
    return rows.reshape(ids.shape[0], left.shape[1] * right.shape[2])


def ttm_lookup(cores: Sequence[torch.Tensor], ids: torch.Tensor, deduplicate: bool = False) -> torch.Tensor:
    """Rows ``ids`` (1-d, already validated) of the TTM table, by the half-merge lookup.

    With ``deduplicate`` each distinct id is computed once and scattered back, which pays off when a
    batch repeats tokens (natural text, power-law categories).
    """
    return ttm_lookup_halves(*ttm_halves(cores), ids, deduplicate)


def ttm_lookup_chain(cores: Sequence[torch.Tensor], ids: torch.Tensor, row_modes: Sequence[int]) -> torch.Tensor:
    """Reference per-row lookup: gather one slice per core and multiply along the chain for every id."""
    digits = []
    remaining = ids
    for mode in reversed(row_modes):
        digits.append(remaining.remainder(mode))
        remaining = torch.div(remaining, mode, rounding_mode="floor")
    digits.reverse()
    state = cores[0][0].index_select(0, digits[0])  # (n, e_1, r_1)
    for core, digit in zip(cores[1:], digits[1:], strict=True):
        r_prev, _, e, r_next = core.shape
        sliced = core.index_select(1, digit).permute(1, 0, 2, 3).reshape(ids.shape[0], r_prev, e * r_next)
        state = torch.bmm(state, sliced).reshape(ids.shape[0], state.shape[1] * e, r_next)
    return state.reshape(ids.shape[0], math.prod(c.shape[2] for c in cores))
