"""Training infrastructure that knows nothing of tensor trains: generic callbacks, the MLflow logger, atomic files.

Any Lightning project can use these; CoMERA's own callbacks live in :mod:`comera_lightning.callbacks`.
"""

from .compile import Compile
from .cuda_graphs import CudaGraphs
from .dead_rank import DeadRankWatchdog
from .divergence import DivergenceError, DivergenceGuard
from .fault_tolerance import FaultTolerance
from .final_validation import FinalValidation
from .host_memory import KeepFreedMemory
from .loggers import ResilientMLFlowLogger
from .model_summary import CompactModelSummary
from .predictions import PredictionWriter
from .progress import LogProgress, StepProgressBar

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
