"""Lightning callbacks that give any LightningModule with comera layers CoMERA training."""

from .contraction_planner import ContractionPlanner
from .divergence import DivergenceError, DivergenceGuard
from .fault_tolerance import FaultTolerance
from .rank_adaptation import RankAdaptation
from .rank_monitor import RankMonitor

__all__ = [
    "ContractionPlanner", "DivergenceError", "DivergenceGuard", "FaultTolerance", "RankAdaptation", "RankMonitor",
]
