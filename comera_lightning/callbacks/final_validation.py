"""FinalValidation: a step-budgeted run ends with a validation, so its last checkpoint is the final model.

Lightning validates on the ``val_check_interval`` grid. When ``max_steps`` falls between two checks
(the quickstart validates at steps 500, 1125 and 1750 of 2000), training stops without validating, and a
``ModelCheckpoint(save_last=True)``, which saves after validations, leaves ``last.ckpt`` at step 1750.
Asking the loop to stop on the last step (``trainer.should_stop``) makes Lightning run its usual
validation there, and every checkpoint callback saves after it, exactly as at any other check.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

__all__ = ["FinalValidation"]


class FinalValidation(Callback):
    """Validate (and checkpoint) on the last optimiser step of a ``max_steps`` run."""

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True
