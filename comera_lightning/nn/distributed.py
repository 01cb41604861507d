"""Rank-adaptation views of parameters that FSDP2 shards: a sharded parameter is a ``DTensor`` holding one
piece of the full tensor on each process.

Gates, masks and the rank objective combine a parameter with plain tensors (the masks are buffers, which FSDP2
leaves whole), so they work on the full value. Reading it is a collective (an all-gather): every process must make
the same calls in the same order, which rank adaptation does, as its decisions come from identical values.
Outside a sharded run these helpers are the identity.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["full_tensor", "is_sharded", "write_full_"]


def is_sharded(tensor: torch.Tensor | None) -> bool:
    """True for a ``DTensor`` (a parameter, gradient or optimiser state sharded by FSDP2)."""
    return isinstance(tensor, DTensor)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of ``tensor`` as a plain tensor on every process (differentiable; a collective for a
    ``DTensor``, the tensor itself otherwise)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def write_full_(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` (the whole new value, identical on every process) into ``tensor``, sharded or not."""
    if isinstance(tensor, DTensor):
        piece = distribute_tensor(value.to(tensor.dtype), tensor.device_mesh, tensor.placements, src_data_rank=None)
        tensor.to_local().copy_(piece.to_local())
    else:
        tensor.copy_(value)
