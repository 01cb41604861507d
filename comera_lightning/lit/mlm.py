"""MaskedLM: BERT-style masked-language-model pre-training (the paper's CodeBERT-like run)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from ..models import LayerConfig, MaskedLanguageModel
from ..nn.base import capturing_graph
from ..optim import OptimConfig
from .base import ComeraTask
from .checks import check_id_ranges

__all__ = ["MaskedLM"]

IGNORE = -100


class MaskedLM(ComeraTask):
    """Cross-entropy on masked positions (labels ``-100`` elsewhere); logs accuracy and perplexity.

    ``validate`` logs ``val/mlm_accuracy``, ``val/loss``, ``val/perplexity``; ``test`` the same under
    ``test/``. ``predict`` returns, per batch, one entry per masked position (see :meth:`predict_step`).

    Args:
        vocab_size: rows of the word embedding and columns of the decoder; at least the tokenizer's size.
        optim, optimizer, lr_scheduler: see :class:`ComeraTask`.
        predict_top_k: how many of the most likely tokens :meth:`predict_step` returns per masked position.
        model_kwargs: the encoder's architecture, see :class:`comera_lightning.models.MaskedLanguageModel`.
    """

    # what training.Compile compiles by default: the step calls these apart (the head on masked positions only),
    # never ``model`` itself
    compiled_modules: ClassVar[tuple[str, ...]] = ("model.encoder", "model.head")

    def __init__(
        self,
        vocab_size: int = 8192,
        optim: OptimConfig = OptimConfig(),
        optimizer: dict[str, Any] | None = None,
        lr_scheduler: dict[str, Any] | None = None,
        predict_top_k: int = 5,
        **model_kwargs: Any,
    ) -> None:
        super().__init__(optim, optimizer, lr_scheduler)
        if predict_top_k < 1:
            raise ValueError(f"predict_top_k must be >= 1, got {predict_top_k}")
        # an inference option, not saved: LightningCLI applies a checkpoint's hyperparameters over the command
        # line, so a saved value would silently win over `predict --ckpt_path ... --model.predict_top_k`
        self.save_hyperparameters(ignore=["predict_top_k"])
        self.vocab_size = vocab_size
        self.predict_top_k = predict_top_k
        LayerConfig.refuse_flat_options(model_kwargs)
        OptimConfig.refuse_flat_options(model_kwargs)
        self.model = MaskedLanguageModel(vocab_size=vocab_size, **model_kwargs)
        # metric states are not saved in checkpoints: adding the test metrics keeps old checkpoints loadable
        self.val_accuracy = MulticlassAccuracy(num_classes=vocab_size, average="micro", ignore_index=IGNORE)
        self.val_loss = MeanMetric()
        self.test_accuracy = MulticlassAccuracy(num_classes=vocab_size, average="micro", ignore_index=IGNORE)
        self.test_loss = MeanMetric()

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.check_vocabulary(self.vocab_size)

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        labels = batch["labels"]
        if capturing_graph():
            # a graph needs static shapes (no boolean-mask selection, no host-side checks): decode every
            # position and let cross_entropy skip the ignored ones; the same loss, more decoder work
            hidden = self.model.encoder(batch["input_ids"], batch.get("attention_mask"))
            logits = self.model.head(hidden).flatten(0, -2)
            return F.cross_entropy(logits.float(), labels.reshape(-1), ignore_index=IGNORE), logits, labels
        selected = labels != IGNORE
        targets = labels[selected]
        fix = (
            f"the model's vocabulary has {self.vocab_size} ids: set model.vocab_size to at least the tokenizer's "
            f"size (data.vocab_size), or use the tokenizer the model was built for"
        )
        check_id_ranges(
            [
                ("a batch's input_ids", batch["input_ids"], self.vocab_size, fix),
                (f"a batch's labels (besides {IGNORE}, the ignored positions)", targets, self.vocab_size, fix),
            ]
        )
        hidden = self.model.encoder(batch["input_ids"], batch.get("attention_mask"))
        # the vocabulary decoder is the widest layer: run it on the ~15% masked positions only
        logits = self.model.head(hidden[selected])
        return F.cross_entropy(logits.float(), targets), logits, targets

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, _ = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def evaluate(self, batch: dict[str, torch.Tensor], stage: str) -> None:
        loss, logits, labels = self._loss(batch)
        accuracy, mean_loss = getattr(self, f"{stage}_accuracy"), getattr(self, f"{stage}_loss")
        accuracy(logits, labels)
        mean_loss.update(loss, weight=labels.numel())
        self.log(f"{stage}/mlm_accuracy", accuracy, prog_bar=True)

    @override
    def log_evaluation(self, stage: str) -> None:
        mean_loss = getattr(self, f"{stage}_loss")
        mean = mean_loss.compute()
        self.log_dict({f"{stage}/loss": mean, f"{stage}/perplexity": torch.exp(mean)}, prog_bar=True)
        mean_loss.reset()

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Any]:
        """The ``predict_top_k`` most likely tokens at every masked position of the batch.

        Masked positions are those with ``labels != -100`` (batches without ``labels``: those holding the
        datamodule's ``[MASK]`` id). One entry per masked position, in row-major order:

        * ``index`` (N,) long: the row's number in the dataset (the batch's ``index``; without one, the
          row within the batch);
        * ``position`` (N,) long: the position within the row;
        * ``input_id`` (N,) long: the id the model saw there (``[MASK]``, a random token or the true one);
        * ``true_id`` (N,) long: the original token (only when the batch has ``labels``);
        * ``top_ids`` (N, k) long and ``top_probs`` (N, k) float32: the most likely ids, most likely first,
          and their softmax probabilities;
        * ``true_token`` (N,) and ``top_tokens`` (N, k), lists of str: the same ids decoded, when the
          datamodule has a ``tokenizer``.
        """
        input_ids = batch["input_ids"]
        labels = batch.get("labels")
        if labels is not None:
            selected = labels != IGNORE
        else:
            mask_id = getattr(self._datamodule_special_ids(), "mask", None)
            if mask_id is None:
                raise ValueError(
                    "MaskedLM.predict_step needs batches with labels (-100 at unmasked positions), or a datamodule "
                    "whose tokenizer has a [MASK] token to find the masked positions"
                )
            selected = input_ids == mask_id
        fix = (
            f"the model's vocabulary has {self.vocab_size} ids: set model.vocab_size to at least the tokenizer's "
            f"size (data.vocab_size), or use the tokenizer the model was built for"
        )
        check_id_ranges([("a batch's input_ids", input_ids, self.vocab_size, fix)])
        hidden = self.model.encoder(input_ids, batch.get("attention_mask"))
        probs = self.model.head(hidden[selected]).float().softmax(dim=-1)
        top_probs, top_ids = probs.topk(min(self.predict_top_k, probs.shape[-1]), dim=-1)
        rows, positions = selected.nonzero(as_tuple=True)
        index = batch.get("index")
        out: dict[str, Any] = {
            "index": index[rows].long() if index is not None else rows,
            "position": positions,
            "input_id": input_ids[selected].long(),
        }
        if labels is not None:
            out["true_id"] = labels[selected].long()
        out["top_ids"] = top_ids
        out["top_probs"] = top_probs
        tokenizer = self._datamodule_tokenizer()
        if tokenizer is not None:
            k = top_ids.shape[1]
            if labels is not None:
                out["true_token"] = _decode_each(tokenizer, out["true_id"].tolist())
            flat = _decode_each(tokenizer, top_ids.flatten().tolist())
            out["top_tokens"] = [flat[i : i + k] for i in range(0, len(flat), k)]
        return out

    def _datamodule_tokenizer(self) -> Any:
        datamodule = self.attached_datamodule
        try:
            tokenizer = getattr(datamodule, "tokenizer", None)
        except Exception:  # a datamodule whose tokenizer cannot be loaded: predict without decoded tokens
            return None
        return tokenizer if callable(getattr(tokenizer, "decode_batch", None)) else None

    def _datamodule_special_ids(self) -> Any:
        datamodule = self.attached_datamodule
        try:
            return getattr(datamodule, "special_ids", None)
        except Exception:
            return None


def _decode_each(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each id decoded on its own (special tokens kept), with one ``decode_batch`` call."""
    if not ids:
        return []
    return list(tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False))
