"""Moved: the generic callbacks live in :mod:`comera_lightning.callbacks`, the MLflow logger in
:mod:`comera_lightning.loggers`, the atomic writer and Lightning/MLflow adapters in :mod:`comera_lightning.utilities`.

This package keeps the old import paths (and configs' ``comera_lightning.training.X`` class paths) working, with a
warning, for one release.
"""

import warnings

from ..callbacks import (
    CompactModelSummary,
    Compile,
    CudaGraphs,
    DeadRankWatchdog,
    DivergenceError,
    DivergenceGuard,
    FaultTolerance,
    FinalValidation,
    KeepFreedMemory,
    LogProgress,
    PredictionWriter,
    StepProgressBar,
)
from ..loggers import ResilientMLFlowLogger

warnings.warn(
    "comera_lightning.training has moved: callbacks to comera_lightning.callbacks, the MLflow logger to "
    "comera_lightning.loggers, atomic files and adapters to comera_lightning.utilities; import them from there (the "
    "old paths will be removed in the next release)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "CompactModelSummary",
    "Compile",
    "CudaGraphs",
    "DeadRankWatchdog",
    "DivergenceError",
    "DivergenceGuard",
    "FaultTolerance",
    "FinalValidation",
    "KeepFreedMemory",
    "LogProgress",
    "PredictionWriter",
    "ResilientMLFlowLogger",
    "StepProgressBar",
]
