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
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PackedDropout", "attention", "dropout_layer", "keep_mask", "packed_dropout"]

_LANE_LEVELS = 1 << 16
_LANES_PER_DRAW = 4


def keep_mask(
    shape: Sequence[int], p: float, device: torch.device | str | None = None, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, float]:
    """A ``bool`` mask of ``shape``, True where an element is kept, and the scale for the kept ones.

    Each element is dropped with probability ``round(p * 65536) / 65536``; the scale is ``1 / (1 - that)``.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    drop_levels = round(p * _LANE_LEVELS)
    numel = math.prod(shape)
    words = torch.empty(-(-numel // _LANES_PER_DRAW), dtype=torch.int64, device=device)
    words.random_(-(1 << 63), None, generator=generator)  # the full 64-bit range: four uniform 16-bit lanes
    lanes = words.view(torch.int16)[:numel].view(tuple(shape))
    return lanes >= drop_levels - _LANE_LEVELS // 2, _LANE_LEVELS / (_LANE_LEVELS - drop_levels)


def _keep_mask_of(x: torch.Tensor, p: float) -> torch.Tensor:
    """:func:`keep_mask` for ``x``'s shape and device."""
    return keep_mask(x.shape, p, device=x.device)[0]


def _keep_mask_like(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.bool, device=x.device)


# the mask as one opaque operator: torch.compile keeps it as a node of the graph (the in-place draw would break the
# graph) and it draws from the same generator as eager code; torch.library.custom_op exists from torch 2.4
_compiled_keep_mask: Callable[[torch.Tensor, float], torch.Tensor] | None = None
if hasattr(torch.library, "custom_op"):
    _compiled_keep_mask = torch.library.custom_op("comera::packed_keep_mask", _keep_mask_of, mutates_args=())
    _compiled_keep_mask.register_fake(_keep_mask_like)


def _mask_and_scale(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    # a product with the bool mask reads it as it is (torch 2.13): 1.03x (attention) to 1.20x (hidden states)
    # faster than ``where(keep, x, 0)`` (docs/results.md, the dropout masking table)
    return x.mul(keep).mul_(scale)


class _KeepAndScale(torch.autograd.Function):
    """``x`` times ``scale`` where ``keep``, zero elsewhere; the backward pass applies the same map."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return _mask_and_scale(x, keep, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return _mask_and_scale(grad, keep, ctx.scale), None, None


def packed_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout of ``x`` with packed masks on a CPU (see the module docstring); ``F.dropout`` elsewhere. While
    ``torch.compile`` traces, the mask comes from one opaque operator (the same draws as eager, no graph break)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or (torch.compiler.is_compiling() and _compiled_keep_mask is None):
        return F.dropout(x, p, training=True)
    if torch.compiler.is_compiling() and _compiled_keep_mask is not None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        scale = _LANE_LEVELS / (_LANE_LEVELS - round(p * _LANE_LEVELS))
        return _KeepAndScale.apply(x, _compiled_keep_mask(x, p), scale)
    keep, scale = keep_mask(x.shape, p, device=x.device)
    return _KeepAndScale.apply(x, keep, scale)


class PackedDropout(nn.Dropout):
    """Drop-in ``nn.Dropout`` whose CPU masks cost a quarter of the random draws (:func:`packed_dropout`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_dropout(x, self.p, self.training)


def dropout_layer(p: float, packed: bool) -> nn.Dropout:
    """``PackedDropout(p)`` when ``packed``, else ``nn.Dropout(p)``: the models' ``packed_dropout`` switch."""
    return PackedDropout(p) if packed else nn.Dropout(p)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    packed_masks: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, except that dropout on a CPU with ``packed_masks`` uses packed masks.

    Attention dropout already sends SDPA to its unfused math path (scores, softmax, dropout, product); this is
    that path with :func:`packed_dropout` on the probabilities. Without dropout, or elsewhere, it is SDPA itself.
    ``attn_mask`` is a boolean mask (True = attend) broadcastable to ``(..., L, S)``; a query whose keys are all
    masked gets zeros, as in SDPA. While ``torch.compile`` traces, a call with ``attn_mask`` is SDPA (its check for
    queries without keys would break the graph).
    """
    compiling_with_mask = torch.compiler.is_compiling() and attn_mask is not None
    if dropout_p == 0.0 or not packed_masks or q.device.type != "cpu" or compiling_with_mask:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p)
    if is_causal and attn_mask is not None:
        raise ValueError("attention: pass either attn_mask or is_causal=True, not both (as in SDPA)")
    # scaling q is half the work of scaling the scores when head_dim <= keys; an additive -inf bias costs
    # the backward pass nothing, where masked_fill would mask the gradient too
    scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)
    has_key = None
    if is_causal:
        length, source = scores.shape[-2:]
        scores.add_(torch.full((length, source), float("-inf"), dtype=scores.dtype, device=q.device).triu(1))
    elif attn_mask is not None:
        blocked = ~attn_mask
        if not bool(attn_mask.any(dim=-1).all()):
            # softmax over no key is NaN (and so are its gradients): such a query attends everywhere here and
            # its probabilities are zeroed below, which SDPA's output is
            has_key = attn_mask.any(dim=-1, keepdim=True)
            blocked = blocked & has_key
        scores.add_(torch.zeros(blocked.shape, dtype=scores.dtype, device=q.device).masked_fill(blocked, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    if has_key is not None:
        probs = probs.masked_fill(~has_key, 0.0)
    return packed_dropout(probs, dropout_p) @ v
