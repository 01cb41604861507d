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
from typing_extensions import override

__all__ = ["StepProgressBar"]


class StepProgressBar(RichProgressBar):
    """:class:`~lightning.pytorch.callbacks.RichProgressBar` showing ``step N/max_steps`` for step budgets.

    Lightning's bar is drawn first, then its training task is set (through rich's public ``Progress`` API)
    to the step count and a ``Steps (epoch e)`` description.
    """

    @property
    @override
    def total_train_batches(self) -> int | float:
        if self.trainer.max_steps > 0:
            return self.trainer.max_steps
        return super().total_train_batches

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)  # resets the bar to 0 of the total
        self._show_steps(trainer)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._show_steps(trainer)

    def _show_steps(self, trainer: Trainer) -> None:
        """Fill the training bar to ``trainer.global_step`` under a ``Steps (epoch e)`` description."""
        task = self.train_progress_bar_id
        if trainer.max_steps <= 0 or self.progress is None or not self.is_enabled or task is None:
            return
        description = f"{'Steps':{len(self.validation_description)}} (epoch {trainer.current_epoch})"
        if self.theme.description:  # styled as Lightning styles the descriptions of the tasks it adds
            description = f"[{self.theme.description}]{description}"
        self.progress.update(task, completed=trainer.global_step, description=description, visible=True)
        self.refresh()
