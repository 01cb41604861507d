"""The ``comera`` command (``comera_lightning.cli:main``, also ``python -m comera_lightning``), one file per concern:

* ``comera_cli.py``: ComeraCLI, the LightningCLI subclass with comera's defaults (listed in its docstring);
* ``parser.py``: the argument parser, comera's per-subcommand arguments, errors with the closest option;
* ``knobs.py``: the ``--rank_adaptation.*`` options of ``comera fit``;
* ``configs.py``: the installed configs by name, ``comera configs``, the GPU-config warning;
* ``checkpoints.py``: ``--ckpt_path last``, the no-checkpoint warning, the fault-tolerance folder's key;
* ``tracking.py``: the MLflow store, run names, the config artifact, a run's page in the UI;
* ``console.py``: silenced upstream messages, the progress display, the size texts;
* ``vocab.py``: one vocabulary size for the model and the data;
* ``summary.py``: how a fit ends: the final-model export and the printed summary;
* ``export.py``: the ``comera export`` command;
* this file: :func:`main`, which runs ``configs`` and ``export`` itself and the rest through ComeraCLI.
"""

from __future__ import annotations

import sys
from typing import Any

from .checkpoints import (
    EVALUATIONS,
    FAULT_TOLERANCE_DIR,
    LATEST,
    experiment_key,
    latest_checkpoint,
    missing_checkpoint_warning,
)
from .comera_cli import ComeraCLI
from .configs import GPU_CONFIGS, _print_configs, config_path, gpu_config_warning, packaged_configs, resolve_config_args
from .console import comera_sizes, compression_text, quiet_upstream_messages
from .export import _export_command
from .knobs import RANK_ADAPTATION_KNOBS, apply_rank_adaptation_knobs
from .parser import COMMANDS, ComeraArgumentParser
from .summary import export_final_model, fit_summary
from .tracking import (
    DEFAULT_TRACKING_URI,
    EXPERIMENT,
    MLFLOW_UI,
    ConfigArtifact,
    mlflow_run_page,
    run_name,
    tracking_uri,
)

__all__ = [
    "COMMANDS",
    "DEFAULT_TRACKING_URI",
    "EVALUATIONS",
    "EXPERIMENT",
    "FAULT_TOLERANCE_DIR",
    "GPU_CONFIGS",
    "LATEST",
    "MLFLOW_UI",
    "RANK_ADAPTATION_KNOBS",
    "ComeraArgumentParser",
    "ComeraCLI",
    "ConfigArtifact",
    "apply_rank_adaptation_knobs",
    "comera_sizes",
    "compression_text",
    "config_path",
    "experiment_key",
    "export_final_model",
    "fit_summary",
    "gpu_config_warning",
    "latest_checkpoint",
    "main",
    "missing_checkpoint_warning",
    "mlflow_run_page",
    "packaged_configs",
    "quiet_upstream_messages",
    "resolve_config_args",
    "run_name",
    "tracking_uri",
]


def main(args: Any = None) -> None:
    """Console entry point of ``comera`` (and ``python -m comera_lightning``).

    Besides LightningCLI's subcommands: ``comera configs [NAME]`` lists the installed configs and fragments
    (or prints one's path); ``comera export --ckpt_path C --out F`` writes the compact model;
    ``--config quickstart`` finds an installed config by name.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["configs"]:
        _print_configs(argv[1:])
        return
    if argv[:1] == ["export"]:
        _export_command(argv[1:])
        return
    resolved = resolve_config_args(argv)
    if args is None:
        sys.argv[1:] = resolved  # as LightningCLI reads it (and DDP relaunches it): with the paths found
        ComeraCLI()
    else:
        ComeraCLI(args=resolved)
