"""Every Lightning callback of the project, usable on any LightningModule.

CoMERA's own: :class:`Tensorize` (swap a model's layers from the trainer side), :class:`RankAdaptation` and its
late-stage policies (whose home is :mod:`comera_lightning.rank_adaptation`), :class:`RankMonitor`,
:class:`ContractionPlanner`.

Generic training aids that know nothing of tensor trains: :class:`FaultTolerance` (pre-emption and resumes),
:class:`DivergenceGuard`, :class:`DeadRankWatchdog`, :class:`KeepFreedMemory`, :class:`FinalValidation`,
:class:`PredictionWriter`, :class:`CompactModelSummary`, :class:`StepProgressBar` and :class:`LogProgress`,
:class:`Compile`, and :class:`CudaGraphs` (experimental: not yet run on a GPU; never on by default).
"""

from ..rank_adaptation import LateStagePolicy, PaperLateStage, RankAdaptation, ScheduledLateStage
from .compile import Compile
from .contraction_planner import ContractionPlanner
from .cuda_graphs import CudaGraphs
from .dead_rank import DeadRankWatchdog
from .divergence import DivergenceError, DivergenceGuard
from .fault_tolerance import FaultTolerance
from .final_validation import FinalValidation
from .host_memory import KeepFreedMemory
from .model_summary import CompactModelSummary
from .predictions import PredictionWriter
from .progress import LogProgress, StepProgressBar
from .rank_monitor import RankMonitor
from .tensorize import Tensorize

__all__ = [
    "CompactModelSummary",
    "Compile",
    "ContractionPlanner",
    "CudaGraphs",
    "DeadRankWatchdog",
    "DivergenceError",
    "DivergenceGuard",
    "FaultTolerance",
    "FinalValidation",
    "KeepFreedMemory",
    "LateStagePolicy",
    "LogProgress",
    "PaperLateStage",
    "PredictionWriter",
    "RankAdaptation",
    "RankMonitor",
    "ScheduledLateStage",
    "StepProgressBar",
    "Tensorize",
]
