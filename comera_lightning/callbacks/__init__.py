"""Lightning callbacks that give any LightningModule with comera layers CoMERA training."""

from .contraction_planner import ContractionPlanner
from .rank_adaptation import RankAdaptation

__all__ = ["ContractionPlanner", "RankAdaptation"]
