"""Torch modules built on :mod:`comera_lightning.tt`: TT layers, ``tensorize()`` and size reports."""

from .base import TruncationRecord, TTLayer, reusing_inference_factors
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
    "LayerSize",
    "SizeReport",
    "TTEmbedding",
    "TTLayer",
    "TTLinear",
    "TensorizeRecord",
    "TruncationRecord",
    "reusing_inference_factors",
    "size_report",
    "tensorize",
    "tensorize_like",
    "tensorize_specs",
    "tt_layers",
    "untensorize",
]
