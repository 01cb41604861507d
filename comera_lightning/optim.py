"""Optimisers for CoMERA: parameter groups (cores, gates and the rest learn at different rates) and
optimiser state that follows a physical truncation."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from .nn.base import TruncationRecord
from .nn.tensorize import tt_layers
from .tt.rank import select_rank_slices

__all__ = ["comera_parameter_groups", "slice_optimizer_state"]


def comera_parameter_groups(
    model: nn.Module,
    lr_cores: float = 1e-4,
    lr_gates: float = 1e-3,
    lr_other: float = 5e-5,
    weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """Three groups (the paper's AdamW setup): TT cores, rank gates (never decayed), other parameters.

    Groups are named (``"name"`` key) so schedulers and loggers can tell them apart; empty groups are
    left out.
    """
    cores, gates = [], []
    for _, layer in tt_layers(model):
        for kind, param in layer.comera_parameters():
            (cores if kind == "core" else gates).append(param)
    taken = {id(p) for p in cores + gates}
    other = [p for p in model.parameters() if id(p) not in taken and p.requires_grad]
    groups = [
        {"name": "cores", "params": cores, "lr": lr_cores, "weight_decay": weight_decay},
        {"name": "gates", "params": gates, "lr": lr_gates, "weight_decay": 0.0},
        {"name": "other", "params": other, "lr": lr_other, "weight_decay": weight_decay},
    ]
    return [g for g in groups if g["params"]]


def slice_optimizer_state(optimizers: Iterable[torch.optim.Optimizer], record: TruncationRecord) -> None:
    """Slice every per-parameter state tensor (e.g. ``exp_avg``) of the truncated parameters alike."""
    for optimizer in optimizers:
        for param, selection in record:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() == param.dim() and value.shape != param.shape:
                    state[key] = select_rank_slices(value, selection)
