"""Activation checkpointing of model blocks: memory of one block's activations instead of all of them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["run_block"]


def run_block(block: nn.Module, checkpointed: bool, *inputs: Any) -> Any:
    """``block(*inputs)``; with ``checkpointed`` while training with gradients, through non-reentrant
    ``torch.utils.checkpoint``: the block keeps only its inputs and is run again in the backward pass, RNG
    state included, so dropout masks and gradients are those of the plain call."""
    if checkpointed and block.training and torch.is_grad_enabled():
        return checkpoint(block, *inputs, use_reentrant=False)
    return block(*inputs)
