"""LightningModules: task heads, losses, torchmetrics and the three optimiser groups."""

from .base import ComeraTask
from .classification import SequenceClassification
from .ctr import ClickThrough
from .mlm import MaskedLM

__all__ = ["ComeraTask", "SequenceClassification", "ClickThrough", "MaskedLM"]
