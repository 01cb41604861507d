"""Shared helpers for the tensor-train math tests (float64 references built with tensorly)."""

from __future__ import annotations

import math

import torch

from comera_lightning.tt import resolve_ranks, tt_to_dense

F64 = torch.float64
FULL_RANK = 10**6  # an int rank is clamped to what the modes allow, so this means "full rank"

# (in_modes, out_modes): 1..4 modes per side, including different counts per side and size-1 modes
MODE_CONFIGS = [
    ([6], [5]),
    ([2, 3], [4]),
    ([3], [2, 2, 2]),
    ([2, 3], [3, 2]),
    ([2, 2, 2], [3, 2]),
    ([2, 1, 3, 2], [2, 2]),
    ([2, 2], [2, 3, 1, 2]),
    ([2, 2, 2, 2], [2, 2, 2, 2]),
]
MODE_IDS = ["x".join("".join(map(str, side)) for side in cfg) for cfg in MODE_CONFIGS]


def random_train(in_modes, out_modes, rank, dtype=F64, requires_grad=True):
    """Random CoMERA TT cores (r_{k-1}, s_k, r_k) scaled so the dense weight has entries of order 1."""
    sizes = list(in_modes) + list(out_modes)
    ranks = resolve_ranks(sizes, rank)
    cores = []
    for k, s in enumerate(sizes):
        core = torch.randn(ranks[k], s, ranks[k + 1], dtype=dtype) / math.sqrt(ranks[k])
        cores.append(core.requires_grad_(requires_grad))
    return cores, ranks


def random_gates(ranks, dtype=F64, dead=True, requires_grad=True):
    """Gate vectors in [0.5, 1.5) and masks with (where the bond allows it) one dead slice."""
    gates, masks = [], []
    for r in ranks[1:-1]:
        gates.append((torch.rand(r, dtype=dtype) + 0.5).requires_grad_(requires_grad))
        mask = torch.ones(r, dtype=torch.bool)
        if dead and r > 1:
            mask[r // 2] = False
        masks.append(mask)
    return gates, masks


def gate_by_hand(cores, gates, masks):
    """Independent of comera_lightning.tt.apply_gates: core k times (gate_k * mask_k) on its last index."""
    out = []
    for k, core in enumerate(cores):
        if k < len(gates):
            core = core * (gates[k] * masks[k].to(gates[k].dtype)).to(core.dtype)[None, None, :]
        out.append(core)
    return out


def dense_reference(cores, num_in):
    """(M, N) weight reconstructed with tensorly (tl.tt_to_tensor through the package helper)."""
    return tt_to_dense(cores, num_in)


def einsum_dense(cores, num_in):
    """(M, N) weight by an explicit left-to-right contraction, independent of tensorly."""
    full = cores[0]  # (1, s1, r1)
    for core in cores[1:]:
        full = torch.tensordot(full, core, dims=([full.dim() - 1], [0]))
    full = full.squeeze(0).squeeze(-1)
    shape = full.shape
    return full.reshape(math.prod(shape[:num_in]), -1)
