"""The models of the drop-in compatibility matrix (tests/dropin/test_matrix.py), at tiny sizes, in float64.

Each kind has a builder, an example input and a forward returning one tensor, so a cell can compare a tensorised
model with the dense model it came from. ``Wrapped`` is the LightningModule a user writes around any of them.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader

D, FF, VOCAB, MIN_FEATURES = 32, 64, 128, 32
TORCH_KINDS = [
    "encoder",
    "encoder_seq_first",
    "decoder",
    "decoder_seq_first",
    "transformer",
    "transformer_seq_first",
    "mha_block",
    "mlp",
    "lightning",
]
HF_KINDS = ["llama", "bert", "gpt2"]
KINDS = TORCH_KINDS + HF_KINDS


class MhaBlock(nn.Module):
    """A user's own pre-norm block around nn.MultiheadAttention."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class TinyLM(LightningModule):
    """A LightningModule as a user writes one: embedding, a torch encoder, a head; trained on next tokens."""

    def __init__(self, vocab: int = VOCAB, dtype: str = "float64") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, D)
        layer = nn.TransformerEncoderLayer(D, 4, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1)
        self.head = nn.Linear(D, vocab)
        self.to(getattr(torch, dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=x.dtype)
        return self.head(self.encoder(x, mask=causal, is_causal=True))

    def training_step(self, batch, batch_idx):
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def build(kind: str) -> nn.Module:
    """A tiny float64 model of the kind, dropout off, the same weights for the same kind."""
    torch.manual_seed(0)
    seq_first = kind.endswith("seq_first")
    bf = not seq_first
    if kind.startswith("encoder"):
        layer = nn.TransformerEncoderLayer(D, 4, FF, dropout=0.0, batch_first=bf)
        model: nn.Module = nn.TransformerEncoder(layer, 2, enable_nested_tensor=bf)
    elif kind.startswith("decoder"):
        model = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, 4, FF, dropout=0.0, batch_first=bf), 2)
    elif kind.startswith("transformer"):
        model = nn.Transformer(D, 4, 1, 1, FF, dropout=0.0, batch_first=bf)
    elif kind == "mha_block":
        model = MhaBlock()
    elif kind == "mlp":
        model = nn.Sequential(nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, FF), nn.ReLU(), nn.Linear(FF, D))
    elif kind == "lightning":
        model = TinyLM()
    else:
        model = hf_model(kind)
    return model.double()


def hf_model(kind: str, num_layers: int = 1) -> nn.Module:
    """A tiny randomly initialised Hugging Face model of the kind (``llama``, ``bert``, ``gpt2``; no download),
    dropout off, SDPA attention, ``num_layers`` blocks."""
    import transformers

    common: dict[str, Any] = dict(vocab_size=VOCAB, attn_implementation="sdpa")
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            **common,
        )
        return transformers.LlamaForCausalLM(config)
    if kind == "bert":
        config = transformers.BertConfig(
            hidden_size=64,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
        return transformers.BertForMaskedLM(config)
    if kind != "gpt2":
        raise ValueError(f"unknown Hugging Face kind {kind!r}; use one of {HF_KINDS}")
    config = transformers.GPT2Config(
        n_embd=64,
        n_layer=num_layers,
        n_head=4,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **common,
    )
    return transformers.GPT2LMHeadModel(config)


def example(kind: str, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """The forward's inputs for the kind: token ids, or (batch 2, length 5) activations in its layout."""
    g = torch.Generator().manual_seed(1)
    if kind in HF_KINDS or kind == "lightning":
        return (torch.randint(3, VOCAB, (2, 6), generator=g),)
    shape = (5, 2, D) if kind.endswith("seq_first") else (2, 5, D)
    x = torch.randn(*shape, generator=g, dtype=dtype)
    if kind.startswith(("decoder", "transformer")):
        return x, torch.randn(*shape, generator=g, dtype=dtype).flip(0)
    return (x,)


def forward(model: nn.Module, kind: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The model's main output for ``inputs`` (logits for the language models)."""
    if kind in HF_KINDS:
        return model(input_ids=inputs[0]).logits
    if kind.startswith("decoder"):
        causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=inputs[0].dtype)
        return model(inputs[0], inputs[1], tgt_mask=causal, tgt_is_causal=True)
    return model(*inputs)


class Wrapped(LightningModule):
    """The LightningModule a user writes around any model of the matrix (loss: mean square of its output)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.kind = kind
        self.model = build(kind)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return forward(self.model, self.kind, inputs)

    def training_step(self, batch, batch_idx):
        return self(*example(self.kind)).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def dummy_loader(n: int = 8) -> DataLoader:
    """Batches the Wrapped module ignores (its training step uses the kind's example)."""
    return DataLoader(list(range(n)), batch_size=1)
