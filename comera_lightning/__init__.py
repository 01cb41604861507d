"""CoMERA (rank-adaptive tensor-compressed training) for PyTorch Lightning.

Layers live in :mod:`comera_lightning.nn`, the math under them in :mod:`comera_lightning.tt`.
"""

from .loading import load_from_checkpoint
from .nn import TTEmbedding, TTLinear, size_report, tensorize, tensorize_like, untensorize
from .utilities import distributed as _distributed  # noqa: F401  (destroys a process group left alive at exit)

__version__ = "0.1.0"
__all__ = [
    "TTEmbedding",
    "TTLinear",
    "__version__",
    "load_from_checkpoint",
    "size_report",
    "tensorize",
    "tensorize_like",
    "untensorize",
]
