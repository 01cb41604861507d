"""The ``comera`` command: LightningCLI over the comera tasks and data modules, tracked in MLflow.

    comera fit --config configs/quickstart.yaml
    comera validate --config configs/quickstart.yaml --ckpt_path <checkpoint>

Defaults that differ from plain LightningCLI:

* the logger is MLflow on a local sqlite store (``sqlite:///mlflow.db`` in the working directory unless
  ``MLFLOW_TRACKING_URI`` is set), experiment ``comera``;
* the resolved config is saved as an MLflow artifact (``config.yaml``), since a sqlite-backed MLflow
  logger has no log directory for LightningCLI's usual copy;
* checkpoints go under ``<default_root_dir>/<experiment id>/<run id>/checkpoints`` with
  ``default_root_dir`` = ``runs``;
* the comera callbacks resolve by short name (``class_path: RankAdaptation``) and a rich progress bar is
  used when the progress bar is on.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

from . import callbacks as _callbacks  # noqa: F401  (registers the comera callbacks for short names)
from . import data as _data  # noqa: F401  (registers the data modules for short names)
from . import lit as _lit  # noqa: F401  (registers the tasks for short names)
from .lit.base import ComeraTask

__all__ = ["ComeraCLI", "main", "tracking_uri", "ConfigArtifact"]

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
EXPERIMENT = "comera"


def tracking_uri() -> str:
    """Where runs are tracked: ``MLFLOW_TRACKING_URI`` if set, else a sqlite file in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


class ConfigArtifact(SaveConfigCallback):
    """Save the resolved config as ``config.yaml``: an MLflow artifact for MLflow loggers, a file in the
    log directory for the others (LightningCLI's behaviour)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        mlflow_loggers = [logger for logger in trainer.loggers if isinstance(logger, MLFlowLogger)]
        if not mlflow_loggers:
            if trainer.log_dir is not None:
                super().setup(trainer, pl_module, stage)
            return
        if trainer.is_global_zero:
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / self.config_filename
                self.parser.save(self.config, path, skip_none=False, overwrite=True, multifile=False)
                for logger in mlflow_loggers:
                    logger.experiment.log_artifact(logger.run_id, str(path))
        self.already_saved = True


class ComeraCLI(LightningCLI):
    """LightningCLI with comera's defaults (see the module docstring)."""

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        defaults = {
            "logger": {
                "class_path": "lightning.pytorch.loggers.MLFlowLogger",
                "init_args": {"experiment_name": EXPERIMENT, "tracking_uri": tracking_uri()},
            },
            "default_root_dir": "runs",
        }
        kwargs.setdefault("trainer_defaults", defaults)
        kwargs.setdefault("save_config_callback", ConfigArtifact)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(
            ComeraTask,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            args=args,
            run=run,
            **kwargs,
        )

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        configured = list(config.get("callbacks") or []) + list(callbacks)
        wants_bar = config.get("enable_progress_bar") is not False
        if wants_bar and not any(isinstance(c, ProgressBar) for c in configured) and _rich_available():
            callbacks = [*callbacks, RichProgressBar()]
        return super()._instantiate_trainer(config, callbacks)

    def after_fit(self) -> None:
        checkpoint = self.trainer.checkpoint_callback
        if checkpoint is not None and checkpoint.best_model_path and self.trainer.is_global_zero:
            print(f"comera: checkpoints in {checkpoint.dirpath} (best: {checkpoint.best_model_path})")


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def main(args: Any = None) -> None:
    """Console entry point of ``comera``."""
    ComeraCLI(args=args)


if __name__ == "__main__":
    main()
