"""Where ``comera`` tracks its runs in MLflow: the store and experiment, the run names, the resolved config as an
artifact, and the address of a run's page in the MLflow UI."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger
from typing_extensions import override

from ..lit.checks import check_output_dirs
from ..loggers import ResilientMLFlowLogger
from ..loggers.logger import DEFAULT_TRACKING_URI
from ..loggers.logger import default_tracking_uri as tracking_uri

__all__ = ["DEFAULT_TRACKING_URI", "EXPERIMENT", "ConfigArtifact", "mlflow_run_page", "run_name", "tracking_uri"]

EXPERIMENT = "comera"


def run_name(config_files: Any, subcommand: str | None) -> str:
    """``<first config's stem>-<subcommand>-<local time>``: MLflow runs told apart by what and when."""
    files = list(config_files or [])
    stem = Path(str(files[0])).stem if files else "comera"
    return f"{stem}-{subcommand}-{time.strftime('%Y%m%d-%H%M%S')}"


class ConfigArtifact(SaveConfigCallback):
    """Save the resolved config as ``config.yaml``: an MLflow artifact for MLflow loggers, a file in the
    log directory for the others (LightningCLI's behaviour)."""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        if stage == "fit":
            check_output_dirs(trainer)  # before anything is written into them
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


#: where ``mlflow ui`` serves by default
MLFLOW_UI = "http://127.0.0.1:5000"


def mlflow_run_page(ui: str, experiment_id: str | None, run_id: str) -> str:
    """The address of a run's page in the MLflow UI at ``ui``, in the UI's training view: MLflow 3 opens its GenAI
    view unless the address says ``workflowType=machine_learning`` (read from the address by the UI)."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def _mlflow_run(logger: MLFlowLogger) -> tuple[str, str | None, str]:
    """``(tracking URI, run name, experiment name)`` of an MLflow logger whose run exists: a
    ResilientMLFlowLogger knows them; another MLFlowLogger's client reads them from the store."""
    if isinstance(logger, ResilientMLFlowLogger):
        return logger.tracking_uri, logger.run_name, logger.experiment_name
    client = logger.experiment
    run_name = client.get_run(logger.run_id).info.run_name
    return client.tracking_uri, run_name, client.get_experiment(logger.experiment_id).name
