"""Dropout with cheap masks on the CPU, and attention that uses it.

Why: on a CPU, ``torch.nn.functional.dropout`` draws one float per element (``bernoulli_``), then divides and
multiplies, and keeps a float mask for the backward pass. In the six-encoder CoMERA step this was the largest
single item of the profile (22 %), because TT layers make the matrix products cheap and leave dropout as it was.
And any attention dropout sends ``scaled_dot_product_attention`` to its unfused math path, whose mask is drawn
the same way.

How: one 64-bit random draw gives four 16-bit lanes; an element is dropped when its lane falls below a threshold.
So ``p`` is rounded to a multiple of 1/65536 (0.1 becomes 0.100006) and the kept values are scaled by
``1 / (1 - p_effective)``: unbiased, as ``nn.Dropout``. The mask is kept as ``bool`` (1 byte instead of 4).
The draws come from torch's default generator, so ``torch.manual_seed`` and ``torch.utils.checkpoint``'s RNG
state replay reproduce the masks. Other devices use torch's own dropout: CUDA's is a fused kernel already.

The masks differ from ``nn.Dropout``'s for the same seed (a different stream), the distribution does not.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PackedDropout", "attention", "drop_mask", "dropout_layer", "packed_dropout"]

_LANE_LEVELS = 1 << 16
_LANES_PER_DRAW = 4


def drop_mask(shape: Sequence[int], p: float, device: torch.device | str | None = None,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, float]:
    """A ``bool`` mask of ``shape``, True where an element is dropped, and the scale for the kept ones.

    Each element is dropped with probability ``round(p * 65536) / 65536``; the scale is ``1 / (1 - that)``.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    drop_levels = round(p * _LANE_LEVELS)
    numel = math.prod(shape)
    words = torch.empty(-(-numel // _LANES_PER_DRAW), dtype=torch.int64, device=device)
    words.random_(-(1 << 63), None, generator=generator)  # the full 64-bit range: four uniform 16-bit lanes
    lanes = words.view(torch.int16)[:numel].view(tuple(shape))
    return lanes < drop_levels - _LANE_LEVELS // 2, _LANE_LEVELS / (_LANE_LEVELS - drop_levels)


class _ZeroAndScale(torch.autograd.Function):
    """``x`` with the masked elements zeroed and the rest scaled; the backward pass applies the same map."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dropped: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(dropped)
        ctx.scale = scale
        return x.masked_fill(dropped, 0).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (dropped,) = ctx.saved_tensors
        return grad.masked_fill(dropped, 0).mul_(ctx.scale), None, None


def packed_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout of ``x`` with packed masks on a CPU (see the module docstring); ``F.dropout`` elsewhere."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    dropped, scale = drop_mask(x.shape, p, device=x.device)
    return _ZeroAndScale.apply(x, dropped, scale)


class PackedDropout(nn.Dropout):
    """Drop-in ``nn.Dropout`` whose CPU masks cost a quarter of the random draws (:func:`packed_dropout`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_dropout(x, self.p, self.training)


def dropout_layer(p: float, packed: bool) -> nn.Dropout:
    """``PackedDropout(p)`` when ``packed``, else ``nn.Dropout(p)``: the models' ``packed_dropout`` switch."""
    return PackedDropout(p) if packed else nn.Dropout(p)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
              is_causal: bool = False, dropout_p: float = 0.0, packed_masks: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, except that dropout on a CPU with ``packed_masks`` uses packed masks.

    Attention dropout already sends SDPA to its unfused math path (scores, softmax, dropout, product); this is
    that path with :func:`packed_dropout` on the probabilities. Without dropout, or elsewhere, it is SDPA itself.
    ``attn_mask`` is a boolean mask (True = attend) broadcastable to ``(..., L, S)``.
    """
    if dropout_p == 0.0 or not packed_masks or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              dropout_p=dropout_p)
    if is_causal and attn_mask is not None:
        raise ValueError("attention: pass either attn_mask or is_causal=True, not both (as in SDPA)")
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
    if is_causal:
        length, source = scores.shape[-2:]
        attn_mask = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if attn_mask is not None:  # a row with every key masked: zeros, as SDPA's safe softmax, not NaN
        probs = probs.nan_to_num(0.0)
    return packed_dropout(probs, dropout_p) @ v
