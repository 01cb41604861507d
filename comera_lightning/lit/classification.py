"""SequenceClassification: the paper's MNLI task (sentence-pair classification) on a comera encoder."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from ..models import LayerConfig, SequenceClassifier
from ..optim import OptimConfig
from .base import ComeraTask
from .checks import check_id_ranges

__all__ = ["SequenceClassification"]


class SequenceClassification(ComeraTask):
    """Cross-entropy classification of ``input_ids`` (+ ``attention_mask``, ``token_type_ids``) batches.

    ``validate`` logs ``val/loss`` and ``val/accuracy``, ``test`` the same under ``test/``; ``predict``
    returns predicted labels and class probabilities (see :meth:`predict_step`).

    Args:
        vocab_size: rows of the word embedding; at least the tokenizer's size.
        num_classes: 3 for MNLI.
        optim, optimizer, lr_scheduler: see :class:`ComeraTask`.
        model_kwargs: the encoder's architecture (``d_model``, ``num_layers``, ``layer_config``, ...),
            see :class:`comera_lightning.models.SequenceClassifier`.
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        num_classes: int = 3,
        optim: OptimConfig = OptimConfig(),
        optimizer: dict[str, Any] | None = None,
        lr_scheduler: dict[str, Any] | None = None,
        **model_kwargs: Any,
    ) -> None:
        super().__init__(optim, optimizer, lr_scheduler)
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.num_classes = num_classes
        LayerConfig.refuse_flat_options(model_kwargs)
        OptimConfig.refuse_flat_options(model_kwargs)
        self.model = SequenceClassifier(vocab_size=vocab_size, num_classes=num_classes, **model_kwargs)
        self.train_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_accuracy = MulticlassAccuracy(num_classes=num_classes, average="micro")  # not in checkpoints

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.check_vocabulary(self.vocab_size)

    @override
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._logits(batch, check_labels=False)

    def _logits(self, batch: dict[str, torch.Tensor], check_labels: bool) -> torch.Tensor:
        checks = [
            (
                "a batch's input_ids",
                batch["input_ids"],
                self.vocab_size,
                f"the model's vocabulary has {self.vocab_size} ids: set model.vocab_size to at least the "
                f"tokenizer's size (data.vocab_size), or use the tokenizer the model was built for",
            )
        ]
        if batch.get("token_type_ids") is not None:
            embeddings = self.model.encoder.embeddings.token_type_embeddings  # nn.Embedding or TTEmbedding
            types = cast(int, embeddings.num_embeddings)
            checks.append(
                (
                    "a batch's token_type_ids",
                    batch["token_type_ids"],
                    types,
                    "set model.type_vocab_size to the number of segments in the data (2 for sentence pairs)",
                )
            )
        if check_labels:
            checks.append(
                (
                    "a batch's labels",
                    batch["labels"],
                    self.num_classes,
                    "set model.num_classes to the number of classes in the data; unlabelled examples "
                    "(label -1, e.g. a test split) cannot be trained or validated on",
                )
            )
        check_id_ranges(checks)
        return self.model(batch["input_ids"], batch.get("attention_mask"), batch.get("token_type_ids"))

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self._logits(batch, check_labels=True)
        loss = F.cross_entropy(logits.float(), batch["labels"])
        self.train_accuracy(logits.detach(), batch["labels"])
        self.log_dict({"train/loss": loss, "train/accuracy": self.train_accuracy}, prog_bar=True)
        return loss

    @override
    def evaluate(self, batch: dict[str, torch.Tensor], stage: str) -> None:
        logits = self._logits(batch, check_labels=True)
        loss = F.cross_entropy(logits.float(), batch["labels"])
        accuracy = getattr(self, f"{stage}_accuracy")
        accuracy(logits, batch["labels"])
        self.log_dict({f"{stage}/loss": loss, f"{stage}/accuracy": accuracy}, prog_bar=True, sync_dist=True)

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        """Per example: ``index`` (B,) long (when the batch has it: the example's number in the dataset),
        ``label`` (B,) long (the true label, when the batch has ``labels``), ``predicted`` (B,) long (the most
        likely class), ``probabilities`` (B, num_classes) float32 (softmax), and ``predicted_name`` (B,) list of
        str when the datamodule has ``class_names``. Unlabelled examples (label -1) are fine here."""
        probs = self._logits(batch, check_labels=False).float().softmax(dim=-1)
        predicted = probs.argmax(dim=-1)
        out: dict[str, Any] = {}
        if batch.get("index") is not None:
            out["index"] = batch["index"].long()
        if batch.get("labels") is not None:
            out["label"] = batch["labels"].long()
        out["predicted"] = predicted
        out["probabilities"] = probs
        datamodule = self.attached_datamodule
        names = getattr(datamodule, "class_names", None)
        if isinstance(names, (list, tuple)) and len(names) == probs.shape[-1]:
            out["predicted_name"] = [str(names[i]) for i in predicted.tolist()]
        return out
