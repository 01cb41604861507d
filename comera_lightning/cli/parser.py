"""The ``comera`` argument parser: comera's arguments and defaults on each subcommand, and errors that say what
to do (the closest option to an unknown one, a config to start from, the command meant)."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Any, Literal, NoReturn

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

from ..callbacks.fault_tolerance import FaultTolerance
from .configs import packaged_configs
from .knobs import RANK_ADAPTATION_KNOBS

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
