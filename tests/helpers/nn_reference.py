"""Shared helpers for the comera layer tests (float64 references built with tensorly)."""

from __future__ import annotations

import torch

from comera_lightning.tt import tt_to_dense, ttm_to_dense

F64 = torch.float64
FULL_RANK = 10**6  # an int rank is clamped to what the modes allow, so this means "full rank"


def gate_by_hand(cores, gates, masks):
    """Core k times (gate_k * mask_k) on its trailing rank index, without comera_lightning.tt.apply_gates."""
    out = []
    for k, core in enumerate(cores):
        if k < len(gates):
            scale = (gates[k] * masks[k].to(gates[k].dtype)).to(core.dtype)
            core = core * scale.reshape((1,) * (core.dim() - 1) + (-1,))
        out.append(core)
    return out


def reference_linear_weight(layer):
    """(out, in) weight of a TTLinear rebuilt with tensorly from its own cores, gates and masks."""
    cores = gate_by_hand(list(layer.cores), list(layer.gates), layer.rank_masks)
    full = tt_to_dense(cores, len(layer.in_modes))
    return full[: layer.in_features, : layer.out_features].transpose(0, 1)


def reference_embedding_table(layer):
    """(V, D) table of a TTEmbedding rebuilt with tensorly (padding row not zeroed)."""
    cores = gate_by_hand(list(layer.cores), list(layer.gates), layer.rank_masks)
    return ttm_to_dense(cores)[: layer.num_embeddings]


def randomize_gates_(layer, low=0.5, high=1.5):
    """Gates away from 1 so that gate gradients and gating bugs are visible."""
    with torch.no_grad():
        for gate in layer.gates:
            gate.uniform_(low, high)
    return layer
