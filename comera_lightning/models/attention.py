"""Self-attention as the encoder and the decoder share it: ``d_model`` split into heads, SDPA with dropout (packed
masks on a CPU), and the output projection."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ..nn.dropout import attention

__all__ = ["HeadedAttention", "KeyValueCache"]


class KeyValueCache(Protocol):
    """Keys and values of earlier positions (the decoder's ``KVCache``)."""

    def extend(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s cached keys and values followed by the new ones."""
        ...


class HeadedAttention(nn.Module):
    """Base of the models' self-attention: a subclass builds its projections and calls :meth:`heads` on their
    outputs and :meth:`attend` with the heads.

    Args:
        d_model: the model width, split into ``num_heads`` heads of ``d_model / num_heads``.
        num_heads: how many heads.
        dropout: on the attention probabilities while training.
        packed_dropout: draw those masks packed on a CPU (:func:`comera_lightning.nn.dropout.attention`).
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float, packed_dropout: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.dropout = num_heads, d_model // num_heads, dropout
        self.packed_dropout = packed_dropout

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, T, d_model)`` as ``(B, num_heads, T, head_dim)``."""
        batch, seq_len, _ = t.shape
        return t.reshape(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        output: nn.Module,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        cache: KeyValueCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """``output`` of the heads' attention, as ``(B, T, d_model)``; ``cache`` puts layer ``layer``'s past keys
        and values before ``k`` and ``v``."""
        # projections may differ in dtype under autocast (a dense and a TT one); SDPA wants one dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
        if cache is not None:
            k, v = cache.extend(layer, k, v)
        attended = attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            packed_masks=self.packed_dropout,
        )
        batch, _, seq_len, _ = q.shape
        return output(attended.transpose(1, 2).reshape(batch, seq_len, self.num_heads * self.head_dim))
