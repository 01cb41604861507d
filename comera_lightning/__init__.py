"""CoMERA (rank-adaptive tensor-compressed training) for PyTorch Lightning.

Layers live in :mod:`comera_lightning.nn`, the math under them in :mod:`comera_lightning.tt`.
"""

from .nn import TTEmbedding, TTLinear, size_report, tensorize

__version__ = "0.1.0"
__all__ = ["TTEmbedding", "TTLinear", "size_report", "tensorize", "__version__"]
