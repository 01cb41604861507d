"""Rank adaptation: the ranks of every tensor train learned during training, towards a target model size.

CoMERA (Yang et al., NeurIPS 2024) puts a gate vector on every internal bond of every train (``TTLinear``,
``TTEmbedding``): core ``k``'s trailing rank index is scaled by gate ``d_k``, and a slice whose gate falls to the
threshold is masked, then removed. The ranks, and so the model's size, become something training decides:

* **the penalty** (:mod:`.objectives`): ``R(d)``, a parameter-weighted L1 of the gates (each slice weighted by the
  parameters it holds), whose gradient is added to the gates after the task's backward;
* **two stages** (:mod:`.objectives`, :mod:`.late_stage`): early, ``loss + gamma R``; late, a policy steers the size
  towards its target (``target_compression``) while the loss stays near its value at the switch:
  :class:`ScheduledLateStage` cuts along a ramp by slice importance, :class:`PaperLateStage` is the paper's
  switching rule;
* **cuts** (:mod:`.cuts`): masked slices removed physically on a schedule, with the optimiser's moments sliced
  alike, DDP rewrapped and FSDP2's shards resharded, so compute and memory shrink during training;
* **the callback** (:mod:`.callback`): :class:`RankAdaptation` runs all of it on any LightningModule whose model
  holds comera layers, from ``on_before_optimizer_step`` (gradients all-reduced, unscaled, accumulated), every
  decision made from values identical on all processes.

docs/method.md has the method; docs/own-model.md how to use it on your model.
"""

from .callback import RankAdaptation
from .cuts import after_truncation, cut_sharded_, slice_optimizer_state, truncate_sharded
from .late_stage import LateStagePolicy, PaperLateStage, ScheduledLateStage, late_stage_policy

__all__ = [
    "LateStagePolicy",
    "PaperLateStage",
    "RankAdaptation",
    "ScheduledLateStage",
    "after_truncation",
    "cut_sharded_",
    "late_stage_policy",
    "slice_optimizer_state",
    "truncate_sharded",
]
