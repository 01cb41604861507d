"""Lightning callbacks that give any LightningModule with comera layers CoMERA training."""

from .contraction_planner import ContractionPlanner
from .cuda_graphs import CudaGraphs
from .divergence import DivergenceError, DivergenceGuard
from .fault_tolerance import FaultTolerance
from .final_validation import FinalValidation
from .host_memory import KeepFreedMemory
from .progress import StepProgressBar
from .late_stage import LateStagePolicy, PaperLateStage, ScheduledLateStage
from .predictions import PredictionWriter
from .rank_adaptation import RankAdaptation
from .rank_monitor import RankMonitor

__all__ = [
    "ContractionPlanner", "CudaGraphs", "DivergenceError", "DivergenceGuard", "FaultTolerance", "FinalValidation",
    "KeepFreedMemory", "LateStagePolicy", "PaperLateStage", "PredictionWriter", "RankAdaptation", "RankMonitor", "ScheduledLateStage", "StepProgressBar",
]
