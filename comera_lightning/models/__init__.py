"""Model zoo: plain ``nn.Module`` models built from comera layers, every linear and embedding switchable
between TT and dense (so dense baselines run the same code).

* :class:`LayerConfig`, :class:`LayerFactory`: the per-layer TT-or-dense decision and rank.
* :class:`TransformerEncoder`, :class:`SequenceClassifier` (MNLI), :class:`MaskedLanguageModel`: BERT-style.
* :class:`DecoderLM`: LLaMA-style causal LM (RMSNorm, rotary, SwiGLU), for next-token pre-training.
* :class:`DLRM`: click-through-rate model with TT-matrix embedding tables.
"""

from .decoder import DecoderLM, KVCache
from .dlrm import DLRM
from .factory import LayerConfig, LayerFactory
from .transformer import (
    MaskedLanguageModel,
    SequenceClassifier,
    TransformerEncoder,
    paper_embedding_modes,
    paper_linear_modes,
)

__all__ = [
    "DLRM",
    "DecoderLM",
    "KVCache",
    "LayerConfig",
    "LayerFactory",
    "MaskedLanguageModel",
    "SequenceClassifier",
    "TransformerEncoder",
    "paper_embedding_modes",
    "paper_linear_modes",
]
