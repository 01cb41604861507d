"""ClickThrough: click-through-rate prediction with a DLRM whose large tables are TT-matrices."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC

from ..models import DLRM
from .base import ComeraTask

__all__ = ["ClickThrough"]


class ClickThrough(ComeraTask):
    """Binary cross-entropy on ``dense`` + ``sparse`` features; logs AUC and log-loss.

    Args:
        lr_cores, lr_gates, lr_other, weight_decay, warmup_steps, schedule, optimizer, lr_scheduler: see
            :class:`ComeraTask`.
        model_kwargs: the DLRM's architecture (``table_sizes``, ``embedding_dim``, ``rank``, ...), see
            :class:`comera_lightning.models.DLRM`.
    """

    def __init__(
        self,
        lr_cores: float = 1e-3,
        lr_gates: float = 1e-3,
        lr_other: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        schedule: str = "constant",
        optimizer: dict[str, Any] | None = None,
        lr_scheduler: dict[str, Any] | None = None,
        **model_kwargs: Any,
    ) -> None:
        super().__init__(lr_cores, lr_gates, lr_other, weight_decay, warmup_steps, schedule, optimizer, lr_scheduler)
        self.save_hyperparameters()
        self.model = DLRM(**model_kwargs)
        self.val_auc = BinaryAUROC()
        self.val_logloss = MeanMetric()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch["dense"], batch["sparse"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(self(batch).float(), batch["labels"])
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch).float()
        loss = F.binary_cross_entropy_with_logits(logits, batch["labels"])
        self.val_auc(logits, batch["labels"].long())
        self.val_logloss.update(loss, weight=batch["labels"].numel())
        self.log("val/auc", self.val_auc, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.log("val/logloss", self.val_logloss.compute(), prog_bar=True)
        self.val_logloss.reset()

    test_step = validation_step
    on_test_epoch_end = on_validation_epoch_end
