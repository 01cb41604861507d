"""Torch modules built on :mod:`comera_lightning.tt`: TT layers, their builder, ``tensorize()`` and size reports."""

from . import builder as _builder
from . import tensorize as _tensorize
from .base import TruncationRecord, TTLayer, reusing_inference_factors
from .builder import *  # noqa: F403 (the builder's public names, listed in its __all__)
from .embedding import TTEmbedding
from .linear import TTLinear
from .tensorize import *  # noqa: F403 (tensorize() and its companions, listed in its __all__)

__all__ = ["TTEmbedding", "TTLayer", "TTLinear", "TruncationRecord", "reusing_inference_factors"]
__all__ += _builder.__all__
__all__ += _tensorize.__all__
