"""BERT-style encoders whose linears and embeddings are CoMERA TT layers (or dense, layer by layer).

The paper's transformer experiments (MNLI, masked-LM pre-training) use a post-LN BERT encoder in which
every attention projection, both FFN linears and the word embedding are tensor trains trained from
scratch. With ``d_model=768, d_ff=3072`` the layers get the paper's modes (docs/method.md, "Formats"); other
sizes get automatic modes. Constructors take flat primitives only, so LightningCLI can build the models
from YAML and checkpoints' hyper-parameters stay plain data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.dropout import dropout_layer
from .attention import HeadedAttention
from .checkpointing import run_block
from .factory import LayerConfig, LayerFactory

__all__ = [
    "MaskedLanguageModel",
    "SequenceClassifier",
    "TransformerEncoder",
    "paper_embedding_modes",
    "paper_linear_modes",
]

# (in_features, out_features) -> (in_modes, out_modes) of the paper's six-encoder run.
_PAPER_LINEAR_MODES: dict[tuple[int, int], tuple[list[int], list[int]]] = {
    (768, 768): ([12, 8, 8], [8, 8, 12]),  # attention projections (and the pooler / MLM transform)
    (768, 3072): ([12, 8, 8], [12, 16, 16]),  # fc1
    (3072, 768): ([16, 16, 12], [8, 8, 12]),  # fc2
}
# (num_embeddings, embedding_dim) -> (vocab_modes, dim_modes); 30522 rows padded to 16*20*10*10 = 32000.
_PAPER_EMBEDDING_MODES: dict[tuple[int, int], tuple[list[int], list[int]]] = {
    (30522, 768): ([16, 20, 10, 10], [4, 4, 8, 6]),
}


def paper_linear_modes(in_features: int, out_features: int) -> tuple[list[int] | None, list[int] | None]:
    """The paper's (in_modes, out_modes) for this linear shape, or ``(None, None)`` (automatic)."""
    modes = _PAPER_LINEAR_MODES.get((in_features, out_features))
    return (list(modes[0]), list(modes[1])) if modes else (None, None)


def paper_embedding_modes(num_embeddings: int, embedding_dim: int) -> tuple[list[int] | None, list[int] | None]:
    """The paper's (vocab_modes, dim_modes) for this table shape, or ``(None, None)`` (automatic)."""
    modes = _PAPER_EMBEDDING_MODES.get((num_embeddings, embedding_dim))
    return (list(modes[0]), list(modes[1])) if modes else (None, None)


def _linear(factory: LayerFactory, name: str, in_features: int, out_features: int, bias: bool = True) -> nn.Module:
    in_modes, out_modes = paper_linear_modes(in_features, out_features)
    return factory.linear(name, in_features, out_features, bias=bias, in_modes=in_modes, out_modes=out_modes)


class _Embeddings(nn.Module):
    """Word + learned position + token-type embeddings, then LayerNorm and dropout."""

    def __init__(
        self,
        factory: LayerFactory,
        prefix: str,
        vocab_size: int,
        d_model: int,
        max_len: int,
        type_vocab_size: int,
        dropout: float,
        padding_idx: int | None,
        packed_dropout: bool,
    ) -> None:
        super().__init__()
        vocab_modes, dim_modes = paper_embedding_modes(vocab_size, d_model)
        self.word_embeddings = factory.embedding(
            f"{prefix}word_embeddings",
            vocab_size,
            d_model,
            padding_idx=padding_idx,
            vocab_modes=vocab_modes,
            dim_modes=dim_modes,
            # text repeats tokens (a 32 x 128 batch of stdlib code holds ~1000 distinct ids): each distinct id
            # is looked up once, 2.5x faster and 2.7x lighter there (docs/results.md, embedding lookup)
            deduplicate=True,
        )
        self.position_embeddings = factory.embedding(f"{prefix}position_embeddings", max_len, d_model)
        self.token_type_embeddings = factory.embedding(f"{prefix}token_type_embeddings", type_vocab_size, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.dropout = dropout_layer(dropout, packed_dropout)
        self.max_len = max_len

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        if seq_len > self.max_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_len={self.max_len}; truncate the inputs "
                f"or build the model with a larger max_len"
            )
        positions = torch.arange(seq_len, device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions).unsqueeze(0)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(self.norm(x))


class _SelfAttention(HeadedAttention):
    """Multi-head self-attention with separate q/k/v/output projections and a key padding mask."""

    def __init__(
        self, factory: LayerFactory, prefix: str, d_model: int, num_heads: int, dropout: float, packed_dropout: bool
    ) -> None:
        super().__init__(d_model, num_heads, dropout, packed_dropout)
        self.query = _linear(factory, f"{prefix}query", d_model, d_model)
        self.key = _linear(factory, f"{prefix}key", d_model, d_model)
        self.value = _linear(factory, f"{prefix}value", d_model, d_model)
        self.output = _linear(factory, f"{prefix}output", d_model, d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.heads(self.query(x)), self.heads(self.key(x)), self.heads(self.value(x))
        return self.attend(q, k, v, self.output, attn_mask=key_mask)


class _EncoderLayer(nn.Module):
    """Post-LN block: ``x = LN(x + attn(x)); x = LN(x + fc2(gelu(fc1(x))))``."""

    def __init__(
        self,
        factory: LayerFactory,
        prefix: str,
        d_model: int,
        num_heads: int,
        d_ff: int,
        dropout: float,
        packed_dropout: bool,
    ) -> None:
        super().__init__()
        self.attention = _SelfAttention(factory, f"{prefix}attention.", d_model, num_heads, dropout, packed_dropout)
        self.attention_norm = nn.LayerNorm(d_model)
        self.fc1 = _linear(factory, f"{prefix}fc1", d_model, d_ff)
        self.fc2 = _linear(factory, f"{prefix}fc2", d_ff, d_model)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.dropout = dropout_layer(dropout, packed_dropout)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention_norm(x + self.dropout(self.attention(x, key_mask)))
        return self.ffn_norm(x + self.dropout(self.fc2(F.gelu(self.fc1(x)))))


class TransformerEncoder(nn.Module):
    """BERT-style post-LN encoder; ``forward`` returns hidden states ``(B, T, d_model)``.

    Layer names (what ``dense_layers`` matches): ``embeddings.{word,position,token_type}_embeddings``,
    ``layers.{i}.attention.{query,key,value,output}``, ``layers.{i}.fc1``, ``layers.{i}.fc2``, each
    preceded by ``name_prefix``. :attr:`layer_kinds` maps every such name to ``"tt"`` or ``"dense"``.

    Args:
        vocab_size: rows of the word embedding.
        d_model, num_heads, d_ff, num_layers: encoder sizes (``d_model`` divisible by ``num_heads``).
        max_len: rows of the learned position embedding (longest accepted sequence).
        type_vocab_size: rows of the token-type (segment) embedding.
        dropout: on embeddings, attention probabilities and both residual branches.
        padding_idx: word-embedding row that stays zero (None: no padding row).
        layer_config: which linears and embeddings are TT and their ranks (:class:`LayerConfig`; default TT
            everywhere at rank 30, embeddings 32).
        activation_checkpointing: in training, keep only each block's input and recompute the block in the
            backward pass (``torch.utils.checkpoint``, same dropout masks): activation memory of one block
            instead of all, for about one more forward pass of compute. Gradients are unchanged.
        packed_dropout: on a CPU, draw dropout masks four lanes per random number and keep them as bytes
            (:mod:`comera_lightning.nn.dropout`): the same distribution as ``nn.Dropout`` (``p`` rounded to
            1/65536), other masks, a cheaper step. Attention dropout then runs SDPA's math path itself. On by
            default (other devices keep torch's fused dropout either way); ``False`` gives ``nn.Dropout``'s masks.
        name_prefix: qualified name of this encoder inside a parent model (e.g. ``"encoder."``), so
            ``dense_layers`` patterns see the names the parent's ``named_modules()`` shows.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 768,
        num_heads: int = 12,
        d_ff: int = 3072,
        num_layers: int = 6,
        max_len: int = 128,
        type_vocab_size: int = 2,
        dropout: float = 0.1,
        padding_idx: int | None = 0,
        layer_config: LayerConfig | None = None,
        activation_checkpointing: bool = False,
        packed_dropout: bool = True,
        name_prefix: str = "",
    ) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        if min(vocab_size, d_model, d_ff, num_layers, max_len, type_vocab_size) < 1:
            raise ValueError("vocab_size, d_model, d_ff, num_layers, max_len and type_vocab_size must be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        factory = LayerFactory(layer_config)
        self.d_model, self.activation_checkpointing = d_model, bool(activation_checkpointing)
        # what a task head on top builds with (the same dropout and layer decisions as the encoder's)
        self.dropout_p, self.packed_dropout, self.layer_config = dropout, packed_dropout, factory.config
        self.embeddings = _Embeddings(
            factory,
            f"{name_prefix}embeddings.",
            vocab_size,
            d_model,
            max_len,
            type_vocab_size,
            dropout,
            padding_idx,
            packed_dropout,
        )
        self.layers = nn.ModuleList(
            _EncoderLayer(factory, f"{name_prefix}layers.{i}.", d_model, num_heads, d_ff, dropout, packed_dropout)
            for i in range(num_layers)
        )
        self.layer_kinds: dict[str, str] = dict(factory.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids (B, T)``; ``attention_mask (B, T)``, 1 = token, 0 = padding (keys at padded
        positions are ignored; padded positions still get outputs); ``token_type_ids (B, T)``."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        key_mask = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
                    f"{tuple(input_ids.shape)}"
                )
            key_mask = attention_mask.bool()
            # a sequence with no token would softmax over nothing (NaN on some SDPA backends): let it attend everywhere
            key_mask = key_mask | ~key_mask.any(dim=1, keepdim=True)
            key_mask = key_mask[:, None, None, :]  # (B, 1, 1, T): broadcast over heads and queries
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            x = run_block(layer, self.activation_checkpointing, x, key_mask)
        return x


class _EncoderWithHead(nn.Module):
    """A :class:`TransformerEncoder` (its layers named ``encoder.*``) and a head on its hidden states."""

    def __init__(self, vocab_size: int, **encoder_kwargs: Any) -> None:
        super().__init__()
        self.encoder = TransformerEncoder(vocab_size, **encoder_kwargs, name_prefix="encoder.")

    def _list_layers(self, head_factory: LayerFactory) -> None:
        """:attr:`layer_kinds`: the encoder's layers, then those the head built through ``head_factory``."""
        self.layer_kinds: dict[str, str] = {**self.encoder.layer_kinds, **head_factory.layers}

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The head's output (see the class) on the encoder's hidden states; arguments as the encoder's."""
        return self.head_output(self.encoder(input_ids, attention_mask, token_type_ids))

    def head_output(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class SequenceClassifier(_EncoderWithHead):
    """The paper's MNLI model: encoder, BERT pooler (dense + tanh on ``[CLS]``), dropout, classifier.

    Layer names: ``encoder.<encoder names>``, ``pooler``, ``classifier``; :attr:`layer_kinds` lists all.
    Takes the :class:`TransformerEncoder` arguments plus ``num_classes``; returns logits ``(B, num_classes)``.
    """

    def __init__(self, vocab_size: int, num_classes: int = 3, **encoder_kwargs: Any) -> None:
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        super().__init__(vocab_size, **encoder_kwargs)
        factory, d_model = LayerFactory(self.encoder.layer_config), self.encoder.d_model
        self.pooler = _linear(factory, "pooler", d_model, d_model)
        self.dropout = dropout_layer(self.encoder.dropout_p, self.encoder.packed_dropout)
        self.classifier = _linear(factory, "classifier", d_model, num_classes)
        self._list_layers(factory)

    def head_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` from the first (``[CLS]``) position."""
        pooled = torch.tanh(self.pooler(hidden[:, 0]))
        return self.classifier(self.dropout(pooled))


class _MLMHead(nn.Module):
    """``decoder(LN(gelu(dense(h))))``."""

    def __init__(self, factory: LayerFactory, prefix: str, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.dense = _linear(factory, f"{prefix}dense", d_model, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.decoder = _linear(factory, f"{prefix}decoder", d_model, vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(hidden))))


class MaskedLanguageModel(_EncoderWithHead):
    """Encoder plus the BERT MLM head: dense, GELU, LayerNorm, decoder to the vocabulary (with bias).

    The decoder is not tied to the word embedding (a TT embedding and a TT linear have different
    factors); it goes through the factory like every other linear, so it is TT by default.
    Layer names: ``encoder.<encoder names>``, ``head.dense``, ``head.decoder``.
    Returns logits ``(B, T, vocab_size)``. Takes the :class:`TransformerEncoder` arguments.
    """

    def __init__(self, vocab_size: int, **encoder_kwargs: Any) -> None:
        super().__init__(vocab_size, **encoder_kwargs)
        factory = LayerFactory(self.encoder.layer_config)
        self.head = _MLMHead(factory, "head.", self.encoder.d_model, vocab_size)
        self._list_layers(factory)

    def head_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` at every position."""
        return self.head(hidden)
