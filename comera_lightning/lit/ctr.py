"""ClickThrough: click-through-rate prediction with a DLRM whose large tables are TT-matrices."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC
from typing_extensions import override

from ..models import DLRM, LayerConfig
from ..optim import OptimConfig
from .base import ComeraTask

__all__ = ["ClickThrough"]


class ClickThrough(ComeraTask):
    """Binary cross-entropy on ``dense`` + ``sparse`` features; logs AUC and log-loss.

    ``validate`` logs ``val/auc`` and ``val/logloss``, ``test`` the same under ``test/``; ``predict``
    returns click probabilities (see :meth:`predict_step`).

    Args:
        optim, optimizer, lr_scheduler: see :class:`ComeraTask`.
        model_kwargs: the DLRM's architecture (``table_sizes``, ``embedding_dim``, ``layer_config``, ...), see
            :class:`comera_lightning.models.DLRM`.
    """

    def __init__(
        self,
        optim: OptimConfig = OptimConfig(lr_cores=1e-3, lr_gates=1e-3, lr_other=1e-3),
        optimizer: dict[str, Any] | None = None,
        lr_scheduler: dict[str, Any] | None = None,
        **model_kwargs: Any,
    ) -> None:
        super().__init__(optim, optimizer, lr_scheduler)
        self.save_hyperparameters()
        LayerConfig.refuse_flat_options(model_kwargs)
        OptimConfig.refuse_flat_options(model_kwargs)
        self.model = DLRM(**model_kwargs)
        self.val_auc = BinaryAUROC()
        self.val_logloss = MeanMetric()
        self.test_auc = BinaryAUROC()  # metric states are not saved in checkpoints
        self.test_logloss = MeanMetric()

    @override
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch["dense"], batch["sparse"])

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(self(batch).float(), batch["labels"])
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def evaluate(self, batch: dict[str, torch.Tensor], stage: str) -> None:
        logits = self(batch).float()
        loss = F.binary_cross_entropy_with_logits(logits, batch["labels"])
        auc, logloss = getattr(self, f"{stage}_auc"), getattr(self, f"{stage}_logloss")
        auc(logits, batch["labels"].long())
        logloss.update(loss, weight=batch["labels"].numel())
        self.log(f"{stage}/auc", auc, prog_bar=True)

    @override
    def log_evaluation(self, stage: str) -> None:
        logloss = getattr(self, f"{stage}_logloss")
        self.log(f"{stage}/logloss", logloss.compute(), prog_bar=True)
        logloss.reset()

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        """Per example: ``index`` (B,) long (when the batch has it: the row's number in the dataset), ``label``
        (B,) long (the true click, when the batch has ``labels``) and ``click_probability`` (B,) float32."""
        out: dict[str, Any] = {}
        if batch.get("index") is not None:
            out["index"] = batch["index"].long()
        if batch.get("labels") is not None:
            out["label"] = batch["labels"].long()
        out["click_probability"] = torch.sigmoid(self(batch).float())
        return out
