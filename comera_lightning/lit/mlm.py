"""MaskedLM: BERT-style masked-language-model pre-training (the paper's CodeBERT-like run)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ..models import MaskedLanguageModel
from ..nn.base import cuda_graph_capturing
from .base import ComeraTask
from .checks import check_id_ranges

__all__ = ["MaskedLM"]

IGNORE = -100


class MaskedLM(ComeraTask):
    """Cross-entropy on masked positions (labels ``-100`` elsewhere); logs accuracy and perplexity.

    Args:
        vocab_size: rows of the word embedding and columns of the decoder; at least the tokenizer's size.
        lr_cores, lr_gates, lr_other, weight_decay, warmup_steps, schedule, optimizer, lr_scheduler: see
            :class:`ComeraTask`.
        model_kwargs: the encoder's architecture, see :class:`comera_lightning.models.MaskedLanguageModel`.
    """

    def __init__(
        self,
        vocab_size: int = 8192,
        lr_cores: float = 1e-4,
        lr_gates: float = 1e-3,
        lr_other: float = 5e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        schedule: str = "constant",
        optimizer: dict[str, Any] | None = None,
        lr_scheduler: dict[str, Any] | None = None,
        **model_kwargs: Any,
    ) -> None:
        super().__init__(lr_cores, lr_gates, lr_other, weight_decay, warmup_steps, schedule, optimizer, lr_scheduler)
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.model = MaskedLanguageModel(vocab_size=vocab_size, **model_kwargs)
        self.val_accuracy = MulticlassAccuracy(num_classes=vocab_size, average="micro", ignore_index=IGNORE)
        self.val_loss = MeanMetric()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.check_vocabulary(self.vocab_size)

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        labels = batch["labels"]
        if cuda_graph_capturing():
            # a graph needs static shapes (no boolean-mask selection, no host-side checks): decode every
            # position and let cross_entropy skip the ignored ones; the same loss, more decoder work
            hidden = self.model.encoder(batch["input_ids"], batch.get("attention_mask"))
            logits = self.model.head(hidden).flatten(0, -2)
            return F.cross_entropy(logits.float(), labels.reshape(-1), ignore_index=IGNORE), logits, labels
        selected = labels != IGNORE
        targets = labels[selected]
        fix = (f"the model's vocabulary has {self.vocab_size} ids: set model.vocab_size to at least the tokenizer's "
               f"size (data.vocab_size), or use the tokenizer the model was built for")
        check_id_ranges([
            ("a batch's input_ids", batch["input_ids"], self.vocab_size, fix),
            (f"a batch's labels (besides {IGNORE}, the ignored positions)", targets, self.vocab_size, fix),
        ])
        hidden = self.model.encoder(batch["input_ids"], batch.get("attention_mask"))
        # the vocabulary decoder is the widest layer: run it on the ~15% masked positions only
        logits = self.model.head(hidden[selected])
        return F.cross_entropy(logits.float(), targets), logits, targets

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, logits, labels = self._loss(batch)
        self.val_accuracy(logits, labels)
        self.val_loss.update(loss, weight=labels.numel())
        self.log("val/mlm_accuracy", self.val_accuracy, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        mean = self.val_loss.compute()
        self.log_dict({"val/loss": mean, "val/perplexity": torch.exp(mean)}, prog_bar=True)
        self.val_loss.reset()

    test_step = validation_step
    on_test_epoch_end = on_validation_epoch_end
