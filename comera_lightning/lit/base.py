"""ComeraTask: what every comera LightningModule shares (optimiser groups, LR schedule, size checks)."""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI, instantiate_class
from typing_extensions import override

from ..optim import OptimConfig, comera_parameter_groups
from ..strategies.fsdp2 import shard_model
from ..strategies.resharding import unsharded_class
from .checks import check_output_dirs, check_state_dict_fits

__all__ = ["ComeraTask", "warmup_decay_factor"]


def warmup_decay_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, floor: float = 0.0) -> float:
    """LR multiplier at ``step``: linear warmup, then constant, linear or cosine decay to ``floor`` at
    ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * decay


class ComeraTask(LightningModule):
    """Base of the comera tasks: subclasses build ``self.model`` and implement the steps.

    Args:
        optim: learning rates and schedule (:class:`~comera_lightning.optim.OptimConfig`, or a mapping of its
            fields, as checkpoints hold it).
        optimizer: ``{"class_path": ..., "init_args": {...}}`` of any ``torch.optim.Optimizer`` (the CLI's
            ``--optimizer``), built over the three parameter groups, whose learning rates and weight decay
            take precedence over the optimiser's own; ``None``: AdamW.
        lr_scheduler: the same for a scheduler (the CLI's ``--lr_scheduler``), used as LightningCLI uses it,
            instead of the built-in warmup/decay (``optim.warmup_steps`` must be 0 and ``optim.schedule``
            constant).
    """

    def __init__(
        self,
        optim: OptimConfig = OptimConfig(),
        optimizer: dict[str, Any] | None = None,
        lr_scheduler: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.optim = OptimConfig.of(optim)
        if lr_scheduler is not None and (self.optim.warmup_steps > 0 or self.optim.schedule != "constant"):
            raise ValueError(
                f"lr_scheduler ({lr_scheduler.get('class_path')}) replaces the built-in warmup and decay, but "
                f"optim.warmup_steps={self.optim.warmup_steps} and optim.schedule={self.optim.schedule!r} are set "
                "too: set model.optim.warmup_steps 0 and model.optim.schedule constant, or drop --lr_scheduler"
            )
        self.optimizer_init, self.lr_scheduler_init = optimizer, lr_scheduler

    @property
    def attached_trainer(self) -> Trainer | None:
        """The Trainer running this task, or ``None`` outside one (where ``self.trainer`` raises)."""
        try:
            return self.trainer
        except RuntimeError:
            return None

    @property
    def attached_datamodule(self) -> LightningDataModule | None:
        """The running Trainer's datamodule, if any (its tokenizer's size and ``decode`` serve checks and
        predictions)."""
        return getattr(self.attached_trainer, "datamodule", None)

    @override
    def save_hyperparameters(self, *args: Any, ignore: Any = None, frame: Any = None, logger: bool = True) -> None:
        """Lightning's, with dataclass arguments (a ``LayerConfig``) stored as plain dicts, so that checkpoints load
        with ``torch.load(weights_only=True)`` and the task rebuilds from them."""
        current = inspect.currentframe()
        frame = frame or (current.f_back if current is not None else None)
        super().save_hyperparameters(*args, ignore=ignore, frame=frame, logger=logger)
        plain = {
            key: dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value
            for key, value in self.hparams.items()
        }
        if plain != dict(self.hparams):
            super().save_hyperparameters(plain, frame=frame, logger=logger)  # a mapping: saved as it is

    @override
    def configure_optimizers(self):
        optim = self.optim
        groups = comera_parameter_groups(self, optim.lr_cores, optim.lr_gates, optim.lr_other, optim.weight_decay)
        if self.optimizer_init is None:
            optimizer = torch.optim.AdamW(groups)
        else:
            optimizer = instantiate_class(groups, self.optimizer_init)
        if self.lr_scheduler_init is not None:
            scheduler = instantiate_class(optimizer, self.lr_scheduler_init)
            return LightningCLI.configure_optimizers(self, optimizer, scheduler)
        if optim.warmup_steps == 0 and optim.schedule == "constant":
            return optimizer
        total = 1  # a constant schedule never reads it (time-limited runs have no step total)
        if optim.schedule != "constant":
            estimated = self.trainer.estimated_stepping_batches
            if not math.isfinite(estimated):
                raise ValueError(
                    f"optim.schedule={optim.schedule!r} decays the learning rate to zero at the end of training, "
                    "but this run has no step or epoch limit (only max_time, or max_epochs=-1): set "
                    "trainer.max_steps or trainer.max_epochs, or use optim.schedule='constant'"
                )
            total = max(1, int(estimated))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_decay_factor(step, optim.warmup_steps, total, optim.schedule, optim.final_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` / :class:`~comera_lightning.strategies.FSDP2Strategy`: FSDP2-shard each
        transformer block, embedding table and head (:func:`~comera_lightning.strategies.shard_model`); elsewhere
        nothing."""
        shard_model(self)

    @override
    def setup(self, stage: str) -> None:
        """Before fitting, fail early when an output folder (checkpoints, logs) cannot be written."""
        if stage == "fit" and self.attached_trainer is not None:
            check_output_dirs(self.trainer)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse, with the keys that differ, a checkpoint of another architecture (TT ranks may differ);
        outside ``fit``, skip restoring callback state.

        Only when the Trainer restores with strict loading (``--ckpt_path``); ``load_from_checkpoint(...,
        strict=False)`` outside a Trainer keeps Lightning's partial loading.
        """
        if self.attached_trainer is not None and self.trainer.state.fn != "fit":
            # callback state (rank adaptation's stage, checkpoint bookkeeping) only matters for going on
            # training; restoring it for evaluation only warns about callbacks and folders that are absent
            checkpoint.pop("callbacks", None)
        state_dict = checkpoint.get("state_dict")
        if self.attached_trainer is not None and self.strict_loading and isinstance(state_dict, dict):
            check_state_dict_fits(self, state_dict)

    def evaluate(self, batch: Any, stage: str) -> None:
        """Update (and log) the ``stage`` metrics (``"val"`` or ``"test"``) with one batch."""
        raise NotImplementedError(f"{type(self).__name__} has no evaluation: implement evaluate(batch, stage)")

    def log_evaluation(self, stage: str) -> None:
        """Log and reset what :meth:`evaluate` accumulated over the epoch (nothing by default)."""

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(batch, "val")

    @override
    def on_validation_epoch_end(self) -> None:
        self.log_evaluation("val")

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        """Like validation, logged under ``test/``."""
        self.evaluate(batch, "test")

    @override
    def on_test_epoch_end(self) -> None:
        self.log_evaluation("test")

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the task's class path, so that :func:`comera_lightning.export.export_checkpoint` can rebuild it."""
        task = unsharded_class(self)  # FSDP2 swaps in a class of its own
        checkpoint["comera_task"] = f"{task.__module__}.{task.__qualname__}"

    def check_vocabulary(self, model_vocab: int) -> None:
        """Fail early when the datamodule's tokenizer has more ids than the model's embedding rows."""
        datamodule = self.attached_datamodule
        data_vocab = getattr(datamodule, "vocab_size", None)
        if isinstance(data_vocab, int) and data_vocab > model_vocab:
            raise ValueError(
                f"the tokenizer has {data_vocab} ids but the model's vocabulary is {model_vocab}; set "
                f"model.vocab_size to at least {data_vocab} (or data.vocab_size to at most {model_vocab})"
            )
