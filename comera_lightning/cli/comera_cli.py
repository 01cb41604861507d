"""ComeraCLI, the ``comera`` command: LightningCLI over the comera tasks and data modules, tracked in MLflow.

    comera fit --config configs/quickstart.yaml
    comera validate --config configs/quickstart.yaml --ckpt_path <checkpoint>

Defaults that differ from plain LightningCLI:

* the logger is MLflow (:class:`~comera_lightning.loggers.ResilientMLFlowLogger`: buffered, sent in the
  background, kept in a local fallback folder while the store is unreachable) on a local sqlite store
  (``sqlite:///mlflow.db`` in the working directory unless ``MLFLOW_TRACKING_URI`` is set), experiment
  ``comera``;
* the resolved config is saved as an MLflow artifact (``config.yaml``), since a sqlite-backed MLflow
  logger has no log directory for LightningCLI's usual copy;
* checkpoints go under ``<default_root_dir>/<experiment id>/<run id>/checkpoints`` with
  ``default_root_dir`` = ``runs``;
* the comera callbacks resolve by short name (``class_path: RankAdaptation``); when the progress bar is on, a
  rich bar counting optimiser steps is used on a terminal, and plain progress lines
  (:class:`~comera_lightning.callbacks.LogProgress`, with the compression) when output goes to a file or pipe;
* checkpoints load with ``weights_only=True`` (tensors and primitives only) unless ``--weights_only false``;
* ``fit`` is fault tolerant: a :class:`~comera_lightning.callbacks.fault_tolerance.FaultTolerance` callback
  writes an atomic step checkpoint every ``--fault_tolerance.every_n_steps`` steps (default 100, 0 turns it
  off) into a directory that is the same for every launch of the same experiment:
  ``<default_root_dir>/fault_tolerance/<config name>-<hash of the resolved config>``; options that do not
  change the training trajectory (logger, progress bar, model summary, resume options) are left out of
  the hash. ``comera fit ... --resume auto`` continues from the newest complete checkpoint there (weights,
  ranks, gates, optimiser, scheduler, stage, data position, random state), or starts fresh when there is
  none;
* ``fit`` stops at SIGTERM/SIGUSR1 after the step in flight, with a step checkpoint and exit code 128 + signal
  (``FaultTolerance``), and under several processes ends them all within a minute of one dying, naming it
  (:class:`~comera_lightning.callbacks.DeadRankWatchdog`);
* ``fit`` on a CPU (Linux, glibc) keeps freed memory in the process
  (:class:`~comera_lightning.callbacks.KeepFreedMemory`) unless the config lists the callback itself: a step
  stops page-faulting its activations in again;
* ``fit`` takes the RankAdaptation options users change most as ``--rank_adaptation.target_compression``,
  ``target_size``, ``late_start_step``, ``late_start_fraction``, ``gamma`` and ``truncate_every_n_steps``,
  written into the config's RankAdaptation callback (LightningCLI cannot reach into a callback of a config's
  list); a config without one refuses them.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    Callback,
    Checkpoint,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
)
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, LRSchedulerTypeTuple
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from .. import callbacks as _callbacks  # noqa: F401  (registers the comera callbacks for short names)
from .. import data as _data  # noqa: F401  (registers the data modules for short names)
from .. import lit as _lit  # noqa: F401  (registers the tasks for short names)
from ..callbacks.dead_rank import DeadRankWatchdog
from ..callbacks.fault_tolerance import FaultTolerance, find_resume_checkpoint
from ..callbacks.final_validation import FinalValidation
from ..callbacks.host_memory import KeepFreedMemory, keeps_freed_memory_here
from ..callbacks.model_summary import CompactModelSummary
from ..callbacks.predictions import PredictionWriter
from ..callbacks.progress import LogProgress, StepProgressBar
from ..lit.base import ComeraTask
from ..lit.checks import check_checkpoint_file
from ..loggers import ResilientMLFlowLogger
from ..utilities.internals import trainer_callbacks
from . import checkpoints
from .configs import gpu_config_warning
from .console import _interactive_output, _rich_available, comera_sizes, compression_text, quiet_upstream_messages
from .knobs import apply_rank_adaptation_knobs
from .parser import COMMANDS, ComeraArgumentParser
from .summary import export_final_model, fit_summary
from .tracking import EXPERIMENT, ConfigArtifact, run_name, tracking_uri
from .vocab import _link_vocab_sizes, _log_data_hparams_apart


def _version() -> str:
    """``<package> (torch <v>, lightning <v>)``: what ``comera --version`` prints after the program name."""
    try:
        own = package_version("comera_lightning")
    except PackageNotFoundError:  # run from a source tree that was never installed
        own = "unknown"
    return f"{own} (torch {torch.__version__}, lightning {package_version('lightning')})"


def _plain_dict(value: Any) -> dict[str, Any] | None:
    return value.as_dict() if hasattr(value, "as_dict") else value


class ComeraCLI(LightningCLI):
    """LightningCLI with comera's defaults (see the module docstring)."""

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        quiet_upstream_messages()
        defaults = {
            "logger": {
                "class_path": "comera_lightning.loggers.ResilientMLFlowLogger",
                "init_args": {"experiment_name": EXPERIMENT, "tracking_uri": tracking_uri()},
            },
            "default_root_dir": "runs",
        }
        kwargs.setdefault("trainer_defaults", defaults)
        kwargs.setdefault("save_config_callback", ConfigArtifact)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_class", ComeraArgumentParser)
        kwargs.setdefault(
            "parser_kwargs",
            {
                "prog": "comera",
                "description": "CoMERA: tensor-train layers whose ranks shrink while they train, on PyTorch "
                "Lightning. Runs go to MLflow and under runs/; comera configs lists the installed configs.",
                "version": _version(),
                **{name: {"description": COMMANDS[name]} for name in self.subcommands()},
            },
        )
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

    @override
    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        action = getattr(self.parser, "_subcommands_action", None)
        if not add_subcommands or action is None:
            return
        # the help lists each command with its whole sentence, and the two commands main() runs itself
        # (argparse keeps the help of the subcommands as pseudo-actions in _choices_actions)
        listed = getattr(action, "_choices_actions", [])
        for choice in listed:
            choice.help = COMMANDS.get(choice.dest, choice.help)
        for name in ("configs", "export"):
            listed.append(action._ChoicesPseudoAction(name, (), COMMANDS[name]))
        action.metavar = "{" + ",".join([*self.subcommands(), "configs", "export"]) + "}"

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # handed to the task as plain dicts; it builds them over its three parameter groups (ComeraTask)
        parser.add_optimizer_args((Optimizer,))
        parser.add_lr_scheduler_args(LRSchedulerTypeTuple)
        for key in ("optimizer", "lr_scheduler"):
            parser.link_arguments(key, f"model.init_args.{key}", compute_fn=_plain_dict)

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config  # run=False: no subcommand
        logger = config.get("trainer", {}).get("logger")
        init_args = getattr(logger, "init_args", None)
        self.run_name = run_name(config.get("config"), self.subcommand)
        if init_args is not None and "run_name" in init_args and init_args.get("run_name") is None:
            init_args["run_name"] = self.run_name

    @override
    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        _log_data_hparams_apart(self.model, self.datamodule)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if subcommand in checkpoints.EVALUATIONS and ckpt_path == checkpoints.LATEST:
            section = self.config[subcommand]
            root = (section.get("trainer") or {}).get("default_root_dir") or "runs"
            try:
                ckpt_path = section["ckpt_path"] = str(checkpoints.latest_checkpoint(root))
            except FileNotFoundError as error:
                parser.error(str(error))
            rank_zero_info(f"comera: --ckpt_path last: {ckpt_path}")
        warning = checkpoints.missing_checkpoint_warning(subcommand, ckpt_path)
        if warning:
            rank_zero_warn(warning)
        if ckpt_path:
            # a clear error now, before LightningCLI loads the checkpoint for its hyperparameters (next step)
            check_checkpoint_file(ckpt_path)
        _link_vocab_sizes(self.config[subcommand] if subcommand else self.config, args, parser)
        if subcommand == "fit":
            fit = self.config["fit"]
            try:
                apply_rank_adaptation_knobs(fit, fit.get("rank_adaptation"))
            except ValueError as error:
                parser.error(str(error))
            if fit.get("fault_tolerance") is not None and fit["fault_tolerance"].get("dirpath") is None:
                dumped = yaml.safe_load(self.parser.dump(self.config, skip_validation=True))["fit"]
                dumped["config"] = [str(path) for path in fit.get("config") or []]
                root = fit.get("trainer", {}).get("default_root_dir") or "."
                folder = Path(root) / checkpoints.FAULT_TOLERANCE_DIR / checkpoints.experiment_key(dumped)
                fit["fault_tolerance"]["dirpath"] = str(folder)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """LightningCLI's, with comera's callbacks added (see the module docstring) and, outside ``fit``, no
        checkpointing; a ResilientMLFlowLogger's fallback folder goes next to the run's checkpoints."""
        section = self.config_init.get(str(self.subcommand), self.config_init)  # run=False: no subcommand
        config = {**(section.get("trainer") or {}), **kwargs}  # what LightningCLI builds the Trainer from
        overrides = dict(kwargs)
        configured = list(config.get("callbacks") or [])
        if self.subcommand != "fit":
            # evaluation writes no checkpoints: without ModelCheckpoint it also restores no checkpointing
            # state (whose folder belonged to the training run)
            overrides["enable_checkpointing"] = config["enable_checkpointing"] = False
            configured = [c for c in configured if not isinstance(c, Checkpoint)]
        added: list[Callback] = []
        wants_bar = config.get("enable_progress_bar") is not False
        if wants_bar and not any(isinstance(c, ProgressBar) for c in configured):
            if not _interactive_output():  # a live bar shows nothing in a log until it ends
                added.append(LogProgress(describe=compression_text))
            elif _rich_available():
                added.append(StepProgressBar())
        if self.subcommand == "fit" and not any(isinstance(c, FinalValidation) for c in configured):
            added.append(FinalValidation())
        if self.subcommand == "fit" and not any(isinstance(c, DeadRankWatchdog) for c in configured):
            added.append(DeadRankWatchdog())  # idle in one process; several: a dead one does not hang the rest
        if config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in configured):
            added.append(CompactModelSummary(describe=comera_sizes))
            # the summary is ours: with the flag on, Lightning would announce that it skips adding its own
            overrides["enable_model_summary"] = False
        if self.subcommand == "fit":
            section_config = self.config.get(str(self.subcommand), self.config)
            warning = gpu_config_warning(section_config.get("config"), torch.cuda.is_available())
            if warning:
                rank_zero_warn(warning)
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in configured):
            root = config.get("default_root_dir") or "."
            added.append(PredictionWriter(str(Path(root) / "predictions" / f"{self.run_name}.jsonl")))
        fault_tolerance = self._fault_tolerance()
        if fault_tolerance is not None and config.get("enable_checkpointing") is False:
            rank_zero_warn(
                "comera: trainer.enable_checkpointing is false, so there are no fault-tolerance "
                "checkpoints and --resume auto has nothing to resume from"
            )
        elif fault_tolerance is not None:
            if not any(isinstance(c, Checkpoint) for c in configured):
                # Lightning adds a default ModelCheckpoint only when no Checkpoint callback is present: keep it
                added.append(ModelCheckpoint())
            # last: FaultTolerance is a ModelCheckpoint too, and trainer.checkpoint_callback (the first one)
            # must stay the user's; with every_n_steps 0 it writes nothing but still restores the random
            # state of a resumed run
            added.append(fault_tolerance)
        # a new list: LightningCLI appends its own callbacks (the config artifact) to the one it is given
        overrides["callbacks"] = configured + added
        trainer = super().instantiate_trainer(**overrides)
        if (
            self.subcommand == "fit"
            and isinstance(trainer.accelerator, CPUAccelerator)
            and keeps_freed_memory_here()
            and not any(isinstance(c, KeepFreedMemory) for c in trainer_callbacks(trainer))
        ):
            # fast by default: a CPU step stops page-faulting its large activations in again (host_memory.py)
            trainer_callbacks(trainer).append(KeepFreedMemory())
        for logger in trainer.loggers:
            if isinstance(logger, ResilientMLFlowLogger) and logger.local_dir is None:
                logger.local_dir = trainer.default_root_dir  # fallback folder next to the run's checkpoints
        return trainer

    def _fault_tolerance(self) -> FaultTolerance | None:
        if self.subcommand != "fit":
            return None
        callback = self.config_init["fit"].get("fault_tolerance")
        return callback if isinstance(callback, FaultTolerance) else None

    def before_fit(self) -> None:
        fit = self.config_init["fit"]
        if fit.get("resume", "never") != "auto":
            return
        if fit.get("ckpt_path") is not None:
            raise ValueError("--resume auto and --ckpt_path exclude each other: pass one of them")
        callback = fit.get("fault_tolerance")
        folder = getattr(callback, "dirpath", None)
        found = find_resume_checkpoint(folder) if folder is not None else None
        if found is None:
            rank_zero_info(f"comera: no complete checkpoint in {folder}; starting a fresh run")
            return
        rank_zero_info(f"comera: resuming from {found}")
        fit["ckpt_path"] = str(found)
        fit["weights_only"] = True

    def after_predict(self) -> None:
        writers = [c for c in trainer_callbacks(self.trainer) if isinstance(c, PredictionWriter)]
        if self.trainer.is_global_zero:
            for writer in writers:
                print(f"comera: predictions in {writer.resolve_path(self.trainer)}")

    def after_fit(self) -> None:
        if self.trainer.is_global_zero and not self.trainer.interrupted:
            exported = export_final_model(self.trainer, self.model)
            print(fit_summary(self.trainer, self.model, exported))
