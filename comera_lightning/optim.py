"""Optimisers for CoMERA: parameter groups (cores, gates and the rest learn at different rates) and
optimiser state that follows a physical truncation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from torch import nn

from .config import GroupedOptions
from .nn.tensorize import tt_layers

__all__ = ["OptimConfig", "comera_parameter_groups"]


@dataclass(frozen=True)
class OptimConfig(GroupedOptions):
    """How a task learns: the learning rates of CoMERA's three parameter groups and the schedule.

    One object per task (``model.init_args.optim`` in YAML, ``--model.optim.lr_gates 0.2`` on the command
    line) rather than the same six arguments in every task's constructor.

    Attributes:
        lr_cores, lr_gates, lr_other: AdamW learning rates of the TT cores, the rank gates and every other
            parameter (the paper: 1e-4, 1e-3, 5e-5).
        weight_decay: for cores and other parameters (never for gates).
        warmup_steps: linear LR warmup (optimiser steps).
        schedule: after warmup, ``constant`` (the paper), ``linear`` or ``cosine`` decay to ``final_lr_ratio``
            times each rate at the end of training (``trainer.estimated_stepping_batches``).
        final_lr_ratio: where a decaying schedule ends, as a fraction of the peak rate (0: to zero; the LLaMA
            recipes of GaLore and CoLA decay to 0.1).
    """

    lr_cores: float = 1e-4
    lr_gates: float = 1e-3
    lr_other: float = 5e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    final_lr_ratio: float = 0.0

    argument: ClassVar[str] = "optim"

    def __post_init__(self) -> None:
        for name in ("lr_cores", "lr_gates", "lr_other"):
            if not getattr(self, name) > 0:
                raise ValueError(f"optim.{name} must be > 0, got {getattr(self, name)}")
        if self.schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"optim.schedule must be 'constant', 'linear' or 'cosine', got {self.schedule!r}")
        if not 0.0 <= self.final_lr_ratio <= 1.0:
            raise ValueError(
                f"optim.final_lr_ratio is the end of the decay as a fraction of the peak rate, in [0, 1]; "
                f"got {self.final_lr_ratio}"
            )
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError(
                f"optim.warmup_steps and optim.weight_decay must be >= 0, got {self.warmup_steps}, {self.weight_decay}"
            )


def comera_parameter_groups(
    model: nn.Module,
    lr_cores: float = OptimConfig.lr_cores,
    lr_gates: float = OptimConfig.lr_gates,
    lr_other: float = OptimConfig.lr_other,
    weight_decay: float = OptimConfig.weight_decay,
) -> list[dict[str, Any]]:
    """Three groups (the paper's AdamW setup): TT cores, rank gates (never decayed), other parameters.

    Cores whose layer was built with the ``mup`` parameterisation learn at ``lr_cores`` times their own multiplier
    (:attr:`~comera_lightning.nn.TTLayer.lr_scales`): they form one group per multiplier, named
    ``cores`` (multiplier 1) and ``cores*<multiplier>``, each recording its ``lr_scale``. Groups are named
    (``"name"`` key) so schedulers and loggers can tell them apart; empty groups are left out.
    """
    cores_by_scale: dict[float, list[nn.Parameter]] = {}
    gates: list[nn.Parameter] = []
    for _, layer in tt_layers(model):
        core_scales = iter(layer.lr_scales)
        for kind, param in layer.comera_parameters():
            if kind == "core":
                cores_by_scale.setdefault(next(core_scales), []).append(param)
            else:
                gates.append(param)
    cores = [p for params in cores_by_scale.values() for p in params]
    taken = {id(p) for p in cores + gates}
    other = [p for p in model.parameters() if id(p) not in taken and p.requires_grad]
    core_groups = [
        {
            "name": "cores" if scale == 1.0 else f"cores*{scale:.4g}",
            "params": params,
            "lr": lr_cores * scale,
            "lr_scale": scale,
            "weight_decay": weight_decay,
        }
        for scale, params in sorted(cores_by_scale.items(), reverse=True)
    ]
    groups = [
        *core_groups,
        {"name": "gates", "params": gates, "lr": lr_gates, "weight_decay": 0.0},
        {"name": "other", "params": other, "lr": lr_other, "weight_decay": weight_decay},
    ]
    return [g for g in groups if g["params"]]


def __getattr__(name: str):  # the old home of slice_optimizer_state, kept for one release
    if name == "slice_optimizer_state":
        from .rank_adaptation.cuts import slice_optimizer_state
        from .utilities.deprecation import warn_moved

        warn_moved(f"{__name__}.{name}", "comera_lightning.rank_adaptation")
        return slice_optimizer_state
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
