"""CoMERA's Lightning callbacks: tensorizing from the trainer side, rank adaptation and its late-stage policies,
rank monitoring, contraction planning.

Generic training aids that know nothing of tensor trains live in :mod:`comera_lightning.training`.
"""

from ..rank_adaptation import LateStagePolicy, PaperLateStage, RankAdaptation, ScheduledLateStage
from .contraction_planner import ContractionPlanner
from .rank_monitor import RankMonitor
from .tensorize import Tensorize

__all__ = [
    "ContractionPlanner",
    "LateStagePolicy",
    "PaperLateStage",
    "RankAdaptation",
    "RankMonitor",
    "ScheduledLateStage",
    "Tensorize",
]
