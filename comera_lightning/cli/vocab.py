"""One vocabulary size for the model and the data: ``data.vocab_size`` sets ``model.vocab_size``, and a larger model
vocabulary given on the command line is logged apart from the data's."""

from __future__ import annotations

import sys
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser

from ..utilities.internals import rename_logged_hparams


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
