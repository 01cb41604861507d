"""LightningModules: task heads, losses, torchmetrics and the three optimiser groups."""

from .base import ComeraTask
from .causal_lm import CausalLM
from .checks import check_checkpoint_file
from .classification import SequenceClassification
from .ctr import ClickThrough
from .mlm import MaskedLM

__all__ = [
    "CausalLM",
    "ClickThrough",
    "ComeraTask",
    "MaskedLM",
    "SequenceClassification",
    "check_checkpoint_file",
]
