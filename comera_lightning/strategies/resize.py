"""Keeping optimisers and distributed wrappers valid after comera layers change shape.

Physical truncation resizes parameters in place (same objects, smaller ``.data``). Two things outside
the model still remember the old shapes: optimiser state (AdamW moments) and the DDP reducer's
gradient buckets. :func:`after_truncation` fixes both through Lightning's own strategy objects.
"""

from __future__ import annotations

from typing import Iterable

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy, Strategy
from torch.nn.parallel import DistributedDataParallel

from ..nn.base import TruncationRecord
from ..tt.rank import select_rank_slices

__all__ = ["after_truncation", "check_truncation_supported", "slice_optimizer_state"]


def check_truncation_supported(strategy: Strategy) -> None:
    """Raise when the strategy cannot take parameters that change shape mid-fit.

    Single-device and DDP-family strategies are supported; sharded ones (FSDP, DeepSpeed) flatten
    parameters into fixed buffers.
    """
    sharded = isinstance(strategy, DeepSpeedStrategy)  # a DDPStrategy subclass, but sharded
    if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and not sharded:
        return
    raise ValueError(
        f"physical rank truncation is not supported under {type(strategy).__name__} (sharded strategies "
        f"flatten parameters into fixed-size buffers); use a DDP strategy, or keep masking only with "
        f"RankAdaptation(truncate_every_n_steps=None)"
    )


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


def after_truncation(trainer: Trainer, record: TruncationRecord) -> None:
    """Make optimiser state and the DDP wrapper match the new parameter shapes.

    Must run on every process at the same step (decisions are made from identical gate values).
    """
    if not record:
        return
    slice_optimizer_state(trainer.optimizers, record)
    strategy = trainer.strategy
    if isinstance(strategy, DDPStrategy) and isinstance(strategy.model, DistributedDataParallel):
        # Dropping the old wrapper frees its reducer (and the autograd hooks it put on the parameters);
        # a new one builds buckets of the new sizes. Parameters are identical on all ranks already.
        strategy.model = strategy.lightning_module
        strategy.configure_ddp()
