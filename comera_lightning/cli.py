"""The ``comera`` command: LightningCLI over the comera tasks and data modules, tracked in MLflow.

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

import argparse
import difflib
import hashlib
import importlib
import json
import logging
import os
import re
import sys
import tempfile
import time
import warnings
from importlib import resources
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    Callback,
    Checkpoint,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
)
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, LRSchedulerTypeTuple, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from . import callbacks as _callbacks  # noqa: F401  (registers the comera callbacks for short names)
from . import data as _data  # noqa: F401  (registers the data modules for short names)
from . import lit as _lit  # noqa: F401  (registers the tasks for short names)
from .callbacks import RankAdaptation
from .callbacks.dead_rank import DeadRankWatchdog
from .callbacks.fault_tolerance import FaultTolerance, find_resume_checkpoint
from .callbacks.final_validation import FinalValidation
from .callbacks.host_memory import KeepFreedMemory, keeps_freed_memory_here
from .callbacks.model_summary import CompactModelSummary
from .callbacks.predictions import PredictionWriter
from .callbacks.progress import LogProgress, StepProgressBar
from .data.tokenizer import TokenizerLifecycle
from .export import export_checkpoint, export_model, read_export_metadata
from .lit.base import ComeraTask
from .lit.checks import check_checkpoint_file, check_output_dirs
from .loggers import ResilientMLFlowLogger
from .nn.distributed import is_sharded
from .nn.tensorize import size_report
from .utilities.internals import rename_logged_hparams, trainer_callbacks

__all__ = [
    "ComeraCLI",
    "ConfigArtifact",
    "config_path",
    "experiment_key",
    "latest_checkpoint",
    "main",
    "missing_checkpoint_warning",
    "mlflow_run_page",
    "packaged_configs",
    "tracking_uri",
]

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
EXPERIMENT = "comera"
FAULT_TOLERANCE_DIR = "fault_tolerance"
#: fit options that do not change what is trained, left out of the experiment key
#: (--rank_adaptation.* is written into trainer.callbacks, which the key covers)
_KEY_IGNORED = {"config", "resume", "fault_tolerance", "ckpt_path", "weights_only", "__path__", "rank_adaptation"}
_KEY_IGNORED_TRAINER = {"logger", "enable_progress_bar", "enable_model_summary", "default_root_dir"}


def tracking_uri() -> str:
    """Where runs are tracked: ``MLFLOW_TRACKING_URI`` if set, else a sqlite file in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def experiment_key(config: dict[str, Any]) -> str:
    """``<first config file's stem>-<12 hex digits>``: the identity of a fit configuration across launches.

    The digits hash the resolved ``fit`` config (a plain dict) without the options that cannot change the
    training trajectory (``_KEY_IGNORED`` and, under ``trainer``, ``_KEY_IGNORED_TRAINER``), so every
    launch of the same experiment, including ``--resume auto`` relaunches, gets the same key, and changing
    the model, data, optimisation, callbacks or budget gives a new one.
    """
    files = config.get("config") or []
    stem = Path(str(files[0])).stem if files else "run"
    kept = {k: v for k, v in config.items() if k not in _KEY_IGNORED}
    if isinstance(kept.get("trainer"), dict):
        kept["trainer"] = {k: v for k, v in kept["trainer"].items() if k not in _KEY_IGNORED_TRAINER}
    digest = hashlib.sha1(json.dumps(kept, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:12]
    return f"{stem}-{digest}"


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


# the RankAdaptation options users change most, as --rank_adaptation.<name> on `comera fit` with any shipped config
RANK_ADAPTATION_KNOBS: dict[str, tuple[type, str]] = {
    "target_compression": (float, "late-stage size target as a compression ratio (replaces target_size)"),
    "target_size": (int, "late-stage size target in parameters (replaces target_compression)"),
    "late_start_step": (int, "optimiser step at which the late stage starts (replaces late_start_fraction)"),
    "late_start_fraction": (
        float,
        "share of the run's steps after which the late stage starts (replaces late_start_step)",
    ),
    "gamma": (float, "weight of the rank penalty in the early stage"),
    "truncate_every_n_steps": (int, "how often (optimiser steps) layers are physically truncated"),
}
# a knob given replaces its partner from the config (both set would mean two rules, the first to fire wins)
_EXCLUSIVE_KNOBS = {
    "target_compression": "target_size",
    "target_size": "target_compression",
    "late_start_step": "late_start_fraction",
    "late_start_fraction": "late_start_step",
}


def apply_rank_adaptation_knobs(config: Namespace, knobs: Namespace | None) -> None:
    """Write the ``--rank_adaptation.*`` values that were given into the init_args of every RankAdaptation
    callback of ``config`` (a parsed ``fit`` config); refuse them, naming the fix, when it has none."""
    given = {key: value for key, value in (vars(knobs) if knobs else {}).items() if value is not None}
    if not given:
        return
    callbacks = [
        c
        for c in config.get("trainer", {}).get("callbacks") or []
        if isinstance(c, Namespace) and _is_rank_adaptation(c.get("class_path"))
    ]
    if not callbacks:
        options = ", ".join(f"--rank_adaptation.{key}" for key in given)
        raise ValueError(
            f"{options}: this config has no RankAdaptation callback (a dense baseline trains no "
            "ranks), so there is nothing to set; drop the option(s), or add the callback "
            "(--config callbacks/rank_adaptation.yaml)"
        )
    for callback in callbacks:
        init_args = callback.get("init_args")
        if init_args is None:
            init_args = callback["init_args"] = Namespace()
        for key, value in given.items():
            init_args[key] = value
            if key in _EXCLUSIVE_KNOBS and _EXCLUSIVE_KNOBS[key] not in given:
                init_args[_EXCLUSIVE_KNOBS[key]] = None


def _is_rank_adaptation(class_path: Any) -> bool:
    if not isinstance(class_path, str) or "." not in class_path:
        return False
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, RankAdaptation)


class ComeraArgumentParser(LightningArgumentParser):
    """The ``comera`` CLI's parser: each subcommand's parser gets comera's arguments and defaults.

    LightningCLI adds the parameters of ``Trainer.<subcommand>`` to that subcommand's parser with jsonargparse's
    public :meth:`add_method_arguments`: the call that tells a parser which subcommand it serves.

    Options are never abbreviated (``--trainer.max_step`` is an error, not ``--trainer.max_steps``), and an error
    is the message and what to do, without the usage of every option: an unknown option names the closest
    known one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):  # nested parsing, or debugging: as is
            super().error(message, ex)
        self._logger.error(message)
        command = self.prog.replace(" [options]", "")
        help_tip = f"{command} --help lists every " + ("command" if self._subcommands_action else "option")
        unknown = message.removeprefix("unrecognized arguments: ")
        if unknown != message:
            sys.stderr.write(f"{command}: error: {_unknown_arguments(unknown.split(), self)} ({help_tip})\n")
            self.exit(2)
        required = re.search(r"required: (?:(\w+)\.)?(?:data|model)\b", message)
        if required:  # no config given: no model, no data
            if required.group(1):
                command = f"{command} {required.group(1)}"
                help_tip = f"{command} --help lists every option"
            message += f"; start from a config: {command} --config quickstart (comera configs lists them)"
        invalid = re.search(r"invalid choice: '([^']*)'", message)
        close = difflib.get_close_matches(invalid.group(1), COMMANDS, n=1) if invalid else []
        if close:
            message += f"; did you mean {command} {close[0]}?"
        sys.stderr.write(f"{command}: error: {message}\ntip: {help_tip}\n")
        self.exit(2)

    @override
    def add_method_arguments(
        self, class_type: type, method_name: str, nested_key: str | None = None, *args: Any, **kwargs: Any
    ) -> list[str]:
        added = super().add_method_arguments(class_type, method_name, nested_key, *args, **kwargs)
        if nested_key is None and isinstance(class_type, type) and issubclass(class_type, Trainer):
            _add_subcommand_arguments(self, method_name, added)
        return added


def _unknown_arguments(tokens: list[str], parser: argparse.ArgumentParser) -> str:
    """What is wrong with the arguments ``parser`` did not recognise, with the closest option of each."""
    options = [option for action in parser._actions for option in action.option_strings]
    problems: list[str] = []
    for token in tokens:
        if not token.startswith("-"):
            if not problems:  # a value after an unknown option is that option's; a leading one is a stray value
                hint = f": did you mean --config {token}?" if token in packaged_configs() else ""
                problems.append(f"unexpected argument {token!r}{hint}")
            continue
        given = token.split("=", 1)[0]
        close = difflib.get_close_matches(given, options, n=1, cutoff=0.6)
        problems.append(f"unknown option {given}" + (f": did you mean {close[0]}?" if close else ""))
    return "; ".join(problems) or "unrecognized arguments"


def _add_subcommand_arguments(parser: LightningArgumentParser, subcommand: str, method_arguments: list[str]) -> None:
    """comera's defaults and arguments for ``subcommand``, whose ``Trainer`` method's parameters
    (``method_arguments``) the parser has just received."""
    if "weights_only" in method_arguments:
        parser.set_defaults(weights_only=True)  # checkpoints hold tensors and primitives only
    if subcommand == "predict":
        parser.set_defaults(return_predictions=False)  # they go to a file (PredictionWriter), not to memory
    if subcommand == "fit":
        for knob, (kind, what) in RANK_ADAPTATION_KNOBS.items():
            parser.add_argument(
                f"--rank_adaptation.{knob}",
                type=kind | None,
                default=None,
                help=f"{what}: replaces the value of the config's RankAdaptation callback",
            )
        parser.add_class_arguments(FaultTolerance, "fault_tolerance", fail_untyped=False)
        parser.add_argument(
            "--resume",
            type=Literal["auto", "never"],
            default="never",
            help="auto: continue from the newest complete checkpoint in fault_tolerance.dirpath (a fresh "
            "run when there is none); never: always start a fresh run",
        )


class _DropTips(logging.Filter):
    """Lightning 2.6's advertisements on every Trainer ("Tip: For seamless cloud logging ...", "... uploads and
    versioning"): nothing a user of this CLI can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip: For seamless cloud" not in record.getMessage()


def quiet_upstream_messages() -> None:
    """Silence the known, harmless messages of upstream versions that a ``comera`` user cannot act on."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropTips) for f in logger.filters):
        logger.addFilter(_DropTips())
    # MLflow announces at INFO that it creates the tables of a new sqlite store ("Creating initial MLflow database
    # tables...", "Updating database tables")
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    # lightning 2.6.x's utilities/_pytree.py builds torch's LeafSpec, deprecated since torch 2.10: a FutureWarning
    # from inside Lightning on every fit
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    # under bf16-mixed Lightning's summary says it "will not be accurate. Using 32 bits": the weights of a mixed run
    # are float32, so 32 bits is right, and the fit's own summary counts the CoMERA sizes exactly
    warnings.filterwarnings(
        "ignore", message=r"Precision bf16-mixed is not supported by the model summary", category=UserWarning
    )


#: configs made for GPUs, and the CPU config that trains the same kind of model in minutes
GPU_CONFIGS = {
    "llm_60m": "llm_cpu",
    "llm_130m": "llm_cpu",
    "mnli_6enc": "code_pairs",
    "mnli_6enc_dense": "code_pairs",
    "codebert_mlm": "quickstart",
    "dlrm_criteo": "dlrm_criteo --data.synthetic true",
}


def gpu_config_warning(config_paths: Any, cuda_available: bool) -> str | None:
    """The warning for a fit of a GPU config (:data:`GPU_CONFIGS`) on a machine without a GPU, else None."""
    if cuda_available:
        return None
    for path in config_paths or []:
        stem = Path(str(getattr(path, "relative", path))).stem
        if stem in GPU_CONFIGS:
            return (
                f"comera: configs/{stem}.yaml is made for GPUs (bf16, full-size model) and this machine has "
                f"none: on a CPU it runs for hours. For a CPU run use --config {GPU_CONFIGS[stem]}"
            )
    return None


def _link_vocab_sizes(config: Any, args: Any, parser: LightningArgumentParser) -> None:
    """``data.vocab_size`` sets ``model.vocab_size``, unless the command line gives the model's, which must then
    be at least the data's (a larger one is logged next to the data's: :func:`_log_data_hparams_apart`)."""
    model = (config.get("model") or {}).get("init_args") or {}
    data = (config.get("data") or {}).get("init_args") or {}
    model_vocab, data_vocab = model.get("vocab_size"), data.get("vocab_size")
    if not (isinstance(model_vocab, int) and isinstance(data_vocab, int)) or model_vocab == data_vocab:
        return
    argv = [str(a) for a in (sys.argv[1:] if args is None else args)] if not isinstance(args, dict) else []
    explicit = any(a.split("=")[0] in ("--model.vocab_size", "--model.init_args.vocab_size") for a in argv)
    if not explicit:
        model["vocab_size"] = data_vocab
    elif model_vocab < data_vocab:
        parser.error(
            f"model.vocab_size={model_vocab} is smaller than data.vocab_size={data_vocab}: the tokenizer "
            f"would produce ids the embedding has no rows for; set model.vocab_size to at least "
            f"{data_vocab}, or leave it out (it follows data.vocab_size)"
        )


def _differ(first: Any, second: Any) -> bool:
    """Lightning's test for two values of one hyperparameter: another type, another tensor, or unequal."""
    if type(first) is not type(second):
        return True
    return first is not second if isinstance(first, torch.Tensor) else bool(first != second)


def _log_data_hparams_apart(model: LightningModule, datamodule: LightningDataModule | None) -> None:
    """Lightning logs the model's and the data's hyperparameters as one set and stops the run on a key the two
    give different values (a model vocabulary kept larger than the data's): the data's go under ``data.<key>``."""
    if datamodule is None or not (model._log_hyperparams and datamodule._log_hyperparams):
        return
    model_hparams, data_hparams = model.hparams_initial, datamodule.hparams_initial
    shared = (model_hparams.keys() & data_hparams.keys()) - {"_class_path"}
    differing = [key for key in shared if _differ(model_hparams[key], data_hparams[key])]
    if differing:
        rename_logged_hparams(datamodule, {key: f"data.{key}" for key in differing})


#: ``comera --help``'s line for each command (Lightning's take the first lines of the Trainer's docstrings,
#: cut mid-sentence); ``configs`` and ``export`` are run by :func:`main` before LightningCLI
COMMANDS = {
    "fit": "Train a model; it ends with a checkpoint, the compact model and an MLflow run. Start with "
    "--config quickstart.",
    "validate": "Score a checkpoint on the validation set: --ckpt_path PATH, or --ckpt_path last for the newest run's.",
    "test": "Score a checkpoint on the test set: --ckpt_path PATH, or --ckpt_path last for the newest run's.",
    "predict": "Write a checkpoint's predictions to a JSON-lines file: --ckpt_path PATH, or --ckpt_path last.",
    "configs": "List the installed configs, or print the path of one: comera configs [NAME].",
    "export": "Write a checkpoint's compact model: comera export --ckpt_path PATH --out model.safetensors.",
}


def _version() -> str:
    """``<package> (torch <v>, lightning <v>)``: what ``comera --version`` prints after the program name."""
    try:
        own = package_version("comera_lightning")
    except PackageNotFoundError:  # run from a source tree that was never installed
        own = "unknown"
    return f"{own} (torch {torch.__version__}, lightning {package_version('lightning')})"


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
        if subcommand in EVALUATIONS and ckpt_path == LATEST:
            section = self.config[subcommand]
            root = (section.get("trainer") or {}).get("default_root_dir") or "runs"
            try:
                ckpt_path = section["ckpt_path"] = str(latest_checkpoint(root))
            except FileNotFoundError as error:
                parser.error(str(error))
            rank_zero_info(f"comera: --ckpt_path last: {ckpt_path}")
        warning = missing_checkpoint_warning(subcommand, ckpt_path)
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
                fit["fault_tolerance"]["dirpath"] = str(Path(root) / FAULT_TOLERANCE_DIR / experiment_key(dumped))

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


#: the subcommands that score or apply a trained model, and take ``--ckpt_path last``
EVALUATIONS = ("validate", "test", "predict")
#: the ``--ckpt_path`` value that stands for the newest run's last checkpoint (:func:`latest_checkpoint`)
LATEST = "last"


def latest_checkpoint(root: str | os.PathLike[str] = "runs") -> Path:
    """The newest ``<root>/<experiment id>/<run id>/checkpoints/last.ckpt`` (by modification time): what
    ``--ckpt_path last`` means for ``comera validate``, ``test``, ``predict`` and ``export``.

    Raises:
        FileNotFoundError: no run under ``root`` has one, naming the fix.
    """
    found = [path for path in Path(root).glob(f"*/*/checkpoints/{LATEST}.ckpt") if path.exists()]
    if not found:
        raise FileNotFoundError(
            f"--ckpt_path last: no run under {str(root)!r} has a checkpoints/last.ckpt; train one first "
            "(comera fit --config quickstart), or pass a checkpoint's path"
        )
    return max(found, key=lambda path: path.stat().st_mtime)


def missing_checkpoint_warning(subcommand: str | None, ckpt_path: Any) -> str | None:
    """The warning for an evaluation (:data:`EVALUATIONS`) without ``--ckpt_path``, which scores the freshly
    initialised weights of the config's model; ``None`` when there is nothing to warn about."""
    if subcommand not in EVALUATIONS or ckpt_path:
        return None
    return (
        f"comera {subcommand}: no --ckpt_path, so this uses the model's freshly initialised (random) weights, "
        "not a trained model; pass --ckpt_path runs/<exp>/<run>/checkpoints/last.ckpt, or --ckpt_path last for "
        "the newest run's"
    )


def export_final_model(trainer: Trainer, model: LightningModule) -> Path | None:
    """Export the trained model (TT cores at their active ranks, :mod:`comera_lightning.export`) as
    ``model.safetensors`` beside the run's checkpoint folder, and log it to MLflow (artifact
    ``model/model.safetensors``) so the run shows what it produced. ``None`` when no checkpoint folder."""
    checkpoint = trainer.checkpoint_callback
    folder = getattr(checkpoint, "dirpath", None)
    if not folder:
        return None
    run_ids = {
        logger.run_id: logger for logger in trainer.loggers if isinstance(logger, MLFlowLogger) and logger.run_id
    }
    metadata = {"mlflow_run_id": next(iter(run_ids))} if run_ids else None
    out = Path(folder).parent / "model.safetensors"
    datamodule = getattr(trainer, "datamodule", None)
    tokenizer = datamodule.tokenizer_file if isinstance(datamodule, TokenizerLifecycle) else None
    if any(is_sharded(p) for p in model.parameters()):
        # FSDP2: this process holds only its shards (and runs alone here), so export what the run last saved
        saved = getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")
        if not saved:
            return None
        path = export_checkpoint(saved, out, metadata=metadata, overwrite=True, tokenizer=tokenizer)
    else:
        path = export_model(model, out, metadata, overwrite=True, tokenizer=tokenizer)
    for run_id, logger in run_ids.items():
        logger.experiment.log_artifact(run_id, str(path), "model")
    return path


def _plain_dict(value: Any) -> dict[str, Any] | None:
    return value.as_dict() if hasattr(value, "as_dict") else value


def run_name(config_files: Any, subcommand: str | None) -> str:
    """``<first config's stem>-<subcommand>-<local time>``: MLflow runs told apart by what and when."""
    files = list(config_files or [])
    stem = Path(str(files[0])).stem if files else "comera"
    return f"{stem}-{subcommand}-{time.strftime('%Y%m%d-%H%M%S')}"


def _rank_groups(model: LightningModule) -> list[str]:
    """One line per kind of TT layer (block indices folded into ``*``): its active inner ranks, min-max
    over the blocks, against the ranks it started from."""
    groups: dict[str, list[Any]] = {}
    for layer in size_report(model).layers:
        key = re.sub(r"\.\d+(?=\.|$)", ".*", layer.name)
        groups.setdefault(key, []).append(layer)
    lines = []
    for key, layers in groups.items():

        def span(values: list[int]) -> str:
            return str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"

        bonds = range(1, len(layers[0].ranks) - 1)
        if not bonds:
            continue  # a single-mode layer has no rank to adapt
        active = ",".join(span([layer.active_ranks[b] for layer in layers]) for b in bonds)
        start = ",".join(span([layer.ranks[b] for layer in layers]) for b in bonds)
        count = f" (x{len(layers)})" if len(layers) > 1 else ""
        lines.append(f"    {key}{count}: {active} of {start}")
    return lines


def comera_sizes(model: LightningModule) -> list[str]:
    """The model summary's CoMERA line: active and dense-equivalent parameters (none for a model without TT layers)."""
    report = size_report(model)
    if not report.layers:
        return []
    return [
        f"[bold]CoMERA[/]: {report.active_parameters:,} active parameters of "
        f"{report.dense_equivalent_parameters:,} dense-equivalent ({report.compression_ratio:.1f}x); "
        "the counts above are allocated ones, dead rank slices included until truncated"
    ]


def fit_summary(trainer: Trainer, model: LightningModule, exported: Path | None = None) -> str:
    """What a fit produced: size and ranks, validation metrics, the checkpoint and export, the MLflow run."""
    report = size_report(model)
    lines = [f"comera: trained {trainer.global_step} steps"]
    if report.layers:
        lines.append(
            f"  compression {report.compression_ratio:.1f}x: {report.active_parameters:,} active parameters "
            f"(dense equivalent {report.dense_equivalent_parameters:,}); active TT ranks of the allocated ones:"
        )
        lines += _rank_groups(model)
    else:
        lines.append(f"  {report.active_parameters:,} parameters, no TT layers")
    metrics = {k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith("val/")}
    if metrics:
        lines.append("  validation: " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    checkpoint = trainer.checkpoint_callback
    path = (
        (getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")) if checkpoint else ""
    )
    if path:
        lines.append(f"  checkpoint: {path}")
    if exported is not None:
        lines.append(f"  compact model: {exported} (comera_lightning.export.load_exported)")
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger) and logger.run_id:
            uri, run, experiment = _mlflow_run(logger)
            name = f"{run} ({logger.run_id})" if run else logger.run_id
            lines.append(f"  MLflow: run {name}, experiment {experiment}, at {uri}")
            page = mlflow_run_page
            if uri.startswith(("http://", "https://")):
                lines.append(f"  the run in the UI: {page(uri, logger.experiment_id, logger.run_id)}")
            elif uri.startswith("sqlite:") or uri.startswith("file:") or "://" not in uri:
                lines.append(f"  open the UI: mlflow ui --backend-store-uri {uri}")
                lines.append(f"    then the run: {page(MLFLOW_UI, logger.experiment_id, logger.run_id)}")
    return "\n".join(lines)


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


def _interactive_output() -> bool:
    """Whether standard output is a terminal (a live progress bar), not a file or a pipe (plain lines)."""
    return sys.stdout.isatty()


def compression_text(model: LightningModule) -> str | None:
    """``compression 4.1x`` for a model with TT layers (the plain progress lines' last field), else ``None``."""
    report = size_report(model)
    return f"compression {report.compression_ratio:.1f}x" if report.layers else None


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _packaged_root() -> Path:
    return Path(str(resources.files("comera_lightning") / "configs"))


def packaged_configs() -> dict[str, Path]:
    """The configs and callback fragments installed with the package, by name (``quickstart``,
    ``callbacks/rank_adaptation``), so they work from a wheel as well as from a checkout."""
    root = _packaged_root()
    return {path.relative_to(root).with_suffix("").as_posix(): path for path in sorted(root.rglob("*.yaml"))}


def config_path(name: str) -> Path:
    """The installed config or fragment ``name`` (``quickstart``, ``quickstart.yaml``,
    ``configs/quickstart.yaml``, ``callbacks/rank_adaptation``); a ``KeyError`` lists the names."""
    key = name.removesuffix(".yaml").removesuffix(".yml").removeprefix("configs/")
    found = packaged_configs().get(key)
    if found is None:
        raise KeyError(f"no installed config named {name!r}; installed: {', '.join(packaged_configs())}")
    return found


def resolve_config_args(argv: list[str]) -> list[str]:
    """Replace each ``--config``/``-c`` value that is not a file here by the installed config of that name."""
    resolved, expect_value = [], False
    for arg in argv:
        if expect_value or arg.startswith("--config="):
            prefix, value = ("", arg) if expect_value else ("--config=", arg.split("=", 1)[1])
            if not Path(value).exists():
                try:
                    value = str(config_path(value))
                except KeyError as missing:
                    if re.fullmatch(r"[\w./-]+", value):  # a name or a path, not inline YAML
                        raise SystemExit(
                            f"comera: --config {value}: no such file here, and {missing.args[0]}"
                        ) from None
            arg = prefix + value
        expect_value = arg in ("--config", "-c")
        resolved.append(arg)
    return resolved


def _print_configs(names: list[str]) -> None:
    if names:  # comera configs NAME: the path alone, for --config $(comera configs NAME) in other CLIs
        for name in names:
            print(config_path(name))
        return
    for name, path in packaged_configs().items():
        print(f"{name:32} {path}")


def _export_command(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="comera export",
        allow_abbrev=False,
        description="Write a checkpoint's model, TT cores at their active ranks, to a "
        "safetensors file that comera_lightning.export.load_exported rebuilds without the checkpoint.",
    )
    parser.add_argument(
        "--ckpt_path", required=True, help="a checkpoint written by comera fit, or last: the newest run's"
    )
    parser.add_argument("--out", required=True, help="the .safetensors file to write")
    parser.add_argument("--task", default=None, help="the task's class path, for checkpoints that do not record it")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer.json for the export to carry (load_exported_tokenizer reads it)"
    )
    options = parser.parse_args(argv)
    try:
        if options.ckpt_path == LATEST:
            options.ckpt_path = str(latest_checkpoint())
            print(f"comera: --ckpt_path last: {options.ckpt_path}")
        path = export_checkpoint(
            options.ckpt_path, options.out, task=options.task, overwrite=options.overwrite, tokenizer=options.tokenizer
        )
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        parser.exit(2, f"comera export: {error}\n")
    meta = read_export_metadata(path)["size"]
    print(
        f"comera: wrote {path}: {meta['active_parameters']:,} parameters, "
        f"{meta['compression_ratio']:.1f}x smaller than dense"
    )


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


if __name__ == "__main__":
    main()
