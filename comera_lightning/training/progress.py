"""StepProgressBar: a rich progress bar that counts towards ``max_steps`` when the budget is in steps.

Lightning's bars count batches of the current epoch and show ``Epoch e/max_epochs-1``; a step-budgeted
run has ``max_epochs=-1`` and reads ``Epoch 0/-2 ... 0/625``, with no sign of how much of the run is left.
This bar keeps one training bar across epochs, filled to ``trainer.global_step`` of ``trainer.max_steps``
(optimiser steps, the unit of the budget), and falls back to Lightning's behaviour without ``max_steps``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["StepProgressBar"]


class StepProgressBar(RichProgressBar):
    """:class:`~lightning.pytorch.callbacks.RichProgressBar` showing ``step N/max_steps`` for step budgets."""

    def _counts_steps(self) -> bool:
        return self._trainer is not None and self.trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        if self._counts_steps():
            return self.trainer.max_steps
        return super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        if not self._counts_steps():
            return super()._get_train_description(current_epoch)
        return f"{'Steps':{len(self.validation_description)}} (epoch {current_epoch})"

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)  # resets the bar to 0 of the total
        if self._counts_steps():
            self._update(self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._counts_steps():
            self._update(self.train_progress_bar_id, trainer.global_step)
