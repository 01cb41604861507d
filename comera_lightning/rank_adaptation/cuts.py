"""Physical cuts and what must follow them: the optimiser's state, the DDP wrapper, FSDP2's shards.

A cut removes the masked slices of a train's bonds (:meth:`~comera_lightning.nn.TTLayer.truncate_`), so the cores
and gates change shape. Everything that mirrors a parameter's shape must change with it, on every process at the
same step (the decisions come from identical gate values):

* :func:`slice_optimizer_state` keeps the same slices of every per-parameter optimiser tensor (AdamW's moments);
* :func:`after_truncation` does that and rebuilds the DDP wrapper, whose gradient buckets hold the old sizes;
* under FSDP2 the parameters are shards of a fixed shape: :func:`truncate_sharded` finds the strategy's hook
  (:class:`~comera_lightning.strategies.FSDP2Strategy`), and :func:`cut_sharded_` is that hook's plan: which layers
  to cut, the new full values of their parameters and moments, handed to the strategy to reshard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..nn.base import TruncationRecord, TTLayer
from ..nn.distributed import full_tensor
from ..tt.rank import select_rank_slices
from .objectives import layers_to_truncate

__all__ = ["ShardedCut", "after_truncation", "cut_sharded_", "slice_optimizer_state", "truncate_sharded"]

#: ``reshard(new_full_values, convert)``: the strategy's resharding of resized parameters, ``convert(old, value)``
#: giving each optimiser tensor's new full value
Reshard = Callable[[dict[nn.Parameter, torch.Tensor], Callable[[nn.Parameter, torch.Tensor], torch.Tensor]], None]


class ShardedCut(Protocol):
    """A strategy's hook that cuts layers whose parameters it shards: ``(layers, min_dead_fraction) -> record``."""

    def __call__(self, layers: Sequence[TTLayer], min_dead_fraction: float) -> TruncationRecord: ...


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
    """Make optimiser state and the DDP wrapper match the parameters a truncation resized.

    Parameters are resized in place (same objects, smaller ``.data``), but the optimiser's moments and the
    DDP reducer's gradient buckets keep the old shapes. Must run on every process at the same step
    (decisions are made from identical gate values).
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


def truncate_sharded(strategy: Any) -> ShardedCut | None:
    """The strategy's cut for sharded parameters (``truncate_layers_``), or None when it shards nothing."""
    hook = getattr(strategy, "truncate_layers_", None)
    return hook if callable(hook) else None


def cut_sharded_(layers: Sequence[TTLayer], min_dead_fraction: float, reshard: Reshard) -> TruncationRecord:
    """Cut every layer with at least ``min_dead_fraction`` of some bond masked, its parameters and their optimiser
    state resized through ``reshard`` (gathered, sliced, sharded afresh); returns ``(old parameter, selection)``."""
    record = TruncationRecord()
    cut = layers_to_truncate(layers, min_dead_fraction)
    for layer in cut:
        record.extend(layer.truncation_plan())
    if not record:
        return record
    selections = {param: selection for param, selection in record}
    reshard(
        {p: select_rank_slices(full_tensor(p.detach()), s) for p, s in record},
        lambda old, value: select_rank_slices(full_tensor(value), selections[old]),
    )
    for layer in cut:
        layer.reset_masks_after_truncation_()
    return record
