"""Torch modules built on :mod:`comera_lightning.tt`: TT layers, ``tensorize()`` and size reports."""

from .base import TTLayer, TruncationRecord
from .embedding import TTEmbedding
from .linear import TTLinear
from .tensorize import (
    LayerSize,
    SizeReport,
    TensorizeRecord,
    size_report,
    tensorize,
    tensorize_like,
    tensorize_specs,
    tt_layers,
    untensorize,
)

__all__ = [
    "TTLayer", "TruncationRecord", "TTEmbedding", "TTLinear",
    "LayerSize", "SizeReport", "TensorizeRecord", "size_report", "tensorize", "tensorize_like", "tensorize_specs",
    "tt_layers", "untensorize",
]
