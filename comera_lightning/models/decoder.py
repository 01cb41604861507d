"""A LLaMA-style decoder whose linears and token embedding are CoMERA TT layers (or dense, layer by layer).

The architecture of LLaMA and of the GaLore / CoLA pre-training baselines: pre-norm blocks with RMSNorm,
causal multi-head attention with rotary position embeddings (no learned positions) through
``F.scaled_dot_product_attention(is_causal=True)``, a SwiGLU MLP (``down(silu(gate(x)) * up(x))``), no
biases, a final RMSNorm and a vocabulary head, optionally tied to the token embedding. Every linear and
the embedding go through :class:`~comera_lightning.models.LayerFactory`, so the dense baseline is this
same code with ``tt_linears=False, tt_embeddings=False``.

Layer names (what ``dense_layers`` matches): ``embed_tokens``, ``layers.{i}.attention.{q,k,v,o}_proj``,
``layers.{i}.mlp.{gate,up,down}_proj``, ``lm_head`` (absent when tied).

Context. A position attends to itself and at most ``max_len - 1`` positions before it, in every layer: up to
``max_len`` tokens this is plain causal attention (training never sees longer rows); past it, a sliding window
(as Mistral's). Generation keeps each layer's keys and values of the last ``max_len - 1`` positions in a
:class:`KVCache`, so a new token costs one position's work instead of a re-run of the window, and the logits
equal those of :meth:`DecoderLM.forward` on the whole sequence. Rotary embeddings depend only on position
differences, which the window keeps below ``max_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..nn import TTEmbedding
from ..nn.dropout import dropout_layer
from .attention import HeadedAttention
from .checkpointing import run_block
from .factory import LayerConfig, LayerFactory

__all__ = ["DecoderLM", "KVCache", "RMSNorm", "apply_rotary", "rotary_tables"]


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32 (float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in (at least) float32, returned in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = _upcast(x)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(x32.dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rotary_tables(
    seq_len: int,
    head_dim: int,
    theta: float = 10000.0,
    offset: int = 0,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``(seq_len, head_dim)`` for positions ``offset .. offset + seq_len - 1``.

    Channel ``i`` and ``i + head_dim / 2`` form one rotated pair with frequency ``theta^(-2i / head_dim)``
    (the "rotate half" layout of LLaMA's Hugging Face port).
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head dimension, got {head_dim}")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    positions = torch.arange(offset, offset + seq_len, device=device, dtype=dtype)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (..., T, head_dim)`` by the tables of :func:`rotary_tables`; (at least) float32 math, input
    dtype out."""
    x32 = _upcast(x)
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos.to(x32.dtype) + rotated * sin.to(x32.dtype)).to(x.dtype)


@dataclass
class KVCache:
    """Keys and values of the positions a :class:`DecoderLM` has seen, per layer, for incremental decoding.

    Pass one (empty) cache to :meth:`DecoderLM.hidden_states` with the prompt, then with each new token: the
    model reads and extends it in place. It keeps the last ``window - 1`` positions, all a new token can
    attend to, so its memory is bounded however long the generation runs.
    """

    window: int
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    seen: int = 0  # positions processed so far: the position of the next token

    @property
    def cached(self) -> int:
        """How many past positions are held (the same in every layer)."""
        return self.keys[0].shape[2] if self.keys else 0

    def extend(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s cached keys and values followed by the new ones ``(B, H, T, head_dim)``; keeps the
        last ``window - 1`` of them for the next call."""
        if layer < len(self.keys):
            keys = torch.cat([self.keys[layer], keys], dim=2)
            values = torch.cat([self.values[layer], values], dim=2)
        keep = keys.shape[2] - min(keys.shape[2], self.window - 1)
        past_keys, past_values = keys[:, :, keep:], values[:, :, keep:]
        if layer < len(self.keys):
            self.keys[layer], self.values[layer] = past_keys, past_values
        else:
            self.keys.append(past_keys)
            self.values.append(past_values)
        return keys, values


def window_mask(
    query_start: int, queries: int, key_start: int, keys: int, window: int, device: torch.device | None = None
) -> torch.Tensor | None:
    """Boolean mask ``(queries, keys)`` (True = attend) of causal attention within ``window`` positions, for
    queries at positions ``query_start ..`` and keys at ``key_start ..``; ``None`` when it is plain causal
    attention over the same positions (SDPA's ``is_causal``, its fast path)."""
    if key_start == query_start and queries == keys and queries <= window:
        return None
    query_pos = torch.arange(query_start, query_start + queries, device=device)[:, None]
    key_pos = torch.arange(key_start, key_start + keys, device=device)[None, :]
    return (key_pos <= query_pos) & (query_pos - key_pos < window)


class _CausalSelfAttention(HeadedAttention):
    def __init__(
        self, factory: LayerFactory, prefix: str, d_model: int, num_heads: int, dropout: float, packed_dropout: bool
    ) -> None:
        super().__init__(d_model, num_heads, dropout, packed_dropout)
        self.q_proj = factory.linear(f"{prefix}q_proj", d_model, d_model, bias=False)
        self.k_proj = factory.linear(f"{prefix}k_proj", d_model, d_model, bias=False)
        self.v_proj = factory.linear(f"{prefix}v_proj", d_model, d_model, bias=False)
        self.o_proj = factory.linear(f"{prefix}o_proj", d_model, d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        q = apply_rotary(self.heads(self.q_proj(x)), cos, sin)
        k = apply_rotary(self.heads(self.k_proj(x)), cos, sin)
        v = self.heads(self.v_proj(x))
        return self.attend(q, k, v, self.o_proj, attn_mask=mask, is_causal=mask is None, cache=cache, layer=layer)


class _SwiGLU(nn.Module):
    def __init__(self, factory: LayerFactory, prefix: str, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_proj = factory.linear(f"{prefix}gate_proj", d_model, d_ff, bias=False)
        self.up_proj = factory.linear(f"{prefix}up_proj", d_model, d_ff, bias=False)
        self.down_proj = factory.linear(f"{prefix}down_proj", d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    """Pre-norm block: ``x = x + attn(norm(x)); x = x + mlp(norm(x))``."""

    def __init__(
        self,
        factory: LayerFactory,
        prefix: str,
        d_model: int,
        num_heads: int,
        d_ff: int,
        dropout: float,
        norm_eps: float,
        packed_dropout: bool,
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(d_model, norm_eps)
        self.attention = _CausalSelfAttention(
            factory, f"{prefix}attention.", d_model, num_heads, dropout, packed_dropout
        )
        self.mlp_norm = RMSNorm(d_model, norm_eps)
        self.mlp = _SwiGLU(factory, f"{prefix}mlp.", d_model, d_ff)
        self.dropout = dropout_layer(dropout, packed_dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), cos, sin, mask, cache, layer))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class DecoderLM(nn.Module):
    """LLaMA-style causal language model; ``forward(input_ids (B, T))`` returns logits ``(B, T, vocab_size)``.

    Args:
        vocab_size: rows of the token embedding and outputs of the head.
        d_model, num_heads, d_ff, num_layers: sizes (``d_model / num_heads`` even, for rotary pairs).
        max_len: the context: each position attends to at most ``max_len`` positions (itself included); longer
            inputs run with a sliding window (see the module docstring). Rotary tables are precomputed up to it.
        dropout: on attention probabilities and both residual branches (LLaMA pre-training uses 0).
        tie_embeddings: the head reuses the token embedding (``logits = h E^T``). With a TT embedding
            the table is rebuilt from its cores once per forward (batch-free); either way both embedding
            and head are initialised with std ``d_model ** -0.5`` so the first logits are of order one.
        rope_theta: rotary base.
        norm_eps: RMSNorm epsilon.
        layer_config: which linears and embeddings are TT and their ranks (:class:`LayerConfig`); layer names are
            ``embed_tokens``, ``layers.{i}.attention.{q,k,v,o}_proj``, ``layers.{i}.mlp.{gate,up,down}_proj``
            and ``lm_head``.
        activation_checkpointing: recompute each block in the backward pass instead of keeping its
            activations (see :class:`TransformerEncoder`).
        packed_dropout: cheaper dropout masks on a CPU (see :class:`TransformerEncoder`).
    """

    rope_cos: torch.Tensor  # rotary tables (buffers)
    rope_sin: torch.Tensor

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 512,
        num_heads: int = 8,
        d_ff: int = 1376,
        num_layers: int = 8,
        max_len: int = 256,
        dropout: float = 0.0,
        tie_embeddings: bool = False,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-6,
        layer_config: LayerConfig | None = None,
        activation_checkpointing: bool = False,
        packed_dropout: bool = True,
    ) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        if (d_model // num_heads) % 2:
            raise ValueError(
                f"the head dimension d_model / num_heads = {d_model // num_heads} must be even "
                f"(rotary embeddings rotate channel pairs)"
            )
        if min(vocab_size, d_model, d_ff, num_layers, max_len) < 1:
            raise ValueError("vocab_size, d_model, d_ff, num_layers and max_len must be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        factory = LayerFactory(layer_config)
        self.vocab_size, self.d_model, self.max_len = vocab_size, d_model, max_len
        self.head_dim, self.rope_theta = d_model // num_heads, float(rope_theta)
        self.tie_embeddings = bool(tie_embeddings)
        self.activation_checkpointing = bool(activation_checkpointing)
        embed_std = d_model**-0.5 if tie_embeddings else 1.0
        # text repeats tokens: each distinct id is looked up once (see TransformerEncoder)
        self.embed_tokens = factory.embedding("embed_tokens", vocab_size, d_model, deduplicate=True, init_std=embed_std)
        if isinstance(self.embed_tokens, nn.Embedding) and tie_embeddings:
            nn.init.normal_(self.embed_tokens.weight, std=embed_std)
        self.drop = dropout_layer(dropout, packed_dropout)
        self.layers = nn.ModuleList(
            _DecoderLayer(factory, f"layers.{i}.", d_model, num_heads, d_ff, dropout, norm_eps, packed_dropout)
            for i in range(num_layers)
        )
        self.norm = RMSNorm(d_model, norm_eps)
        self.lm_head = None if tie_embeddings else factory.linear("lm_head", d_model, vocab_size, bias=False)
        cos, sin = rotary_tables(max_len, self.head_dim, self.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.layer_kinds: dict[str, str] = dict(factory.layers)

    def _rotary(self, start: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if start + length <= self.rope_cos.shape[0]:
            return self.rope_cos[start : start + length], self.rope_sin[start : start + length]
        # float32 math as for the precomputed tables, so a position gets the same table on every path (a cached
        # token and a full re-run agree exactly, also in float64)
        cos, sin = rotary_tables(length, self.head_dim, self.rope_theta, offset=start, device=device)
        return cos.to(self.rope_cos.dtype), sin.to(self.rope_sin.dtype)

    def new_cache(self) -> KVCache:
        """An empty :class:`KVCache` for this model's context."""
        return KVCache(window=self.max_len)

    def hidden_states(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states ``(B, T, d_model)`` of ``input_ids (B, T)``.

        With a ``cache`` (:meth:`new_cache`), ``input_ids`` continue the positions the cache has seen: they attend
        to its keys and values as well as to each other, and the cache is extended with theirs.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        start, length = (cache.seen, input_ids.shape[1]) if cache is not None else (0, input_ids.shape[1])
        cached = cache.cached if cache is not None else 0
        if cache is not None and cache.keys and cache.keys[0].shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"the cache holds a batch of {cache.keys[0].shape[0]} sequences but input_ids has "
                f"{input_ids.shape[0]}: use one cache per batch (model.new_cache())"
            )
        cos, sin = self._rotary(start, length, input_ids.device)
        mask = window_mask(start, length, start - cached, cached + length, self.max_len, input_ids.device)
        x = self.drop(self.embed_tokens(input_ids))
        for index, layer in enumerate(self.layers):
            if cache is None:
                x = run_block(layer, self.activation_checkpointing, x, cos, sin, mask)
            else:
                x = layer(x, cos, sin, mask, cache, index)
        if cache is not None:
            cache.seen += length
        return self.norm(x)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of hidden states (any leading shape)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        embed = self.embed_tokens
        table = embed.weight_dense() if isinstance(embed, TTEmbedding) else embed.get_parameter("weight")
        return F.linear(hidden, table)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)``: position ``t`` predicts token ``t + 1``."""
        return self.head(self.hidden_states(input_ids))
