"""Modules that moved keep their old import paths for one release, with a warning that names the new path."""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = [
    ("comera_lightning.objectives", "comera_lightning.rank_adaptation.objectives", "rank_penalty"),
    ("comera_lightning.late_stage", "comera_lightning.rank_adaptation.late_stage", "ScheduledLateStage"),
    ("comera_lightning.callbacks.rank_adaptation", "comera_lightning.rank_adaptation.callback", "RankAdaptation"),
    ("comera_lightning.sharding", "comera_lightning.strategies.fsdp2", "FSDP2Strategy"),
    ("comera_lightning.training.fsdp", "comera_lightning.strategies.resharding", "reshard_parameters_"),
    ("comera_lightning.training.atomic", "comera_lightning.utilities.atomic", "atomic_write"),
    ("comera_lightning.training.checkpoint_io", "comera_lightning.utilities.checkpoint_io", "read_checkpoint"),
    ("comera_lightning.training.fault_tolerance", "comera_lightning.callbacks.fault_tolerance", "FaultTolerance"),
    ("comera_lightning.training.progress", "comera_lightning.callbacks.progress", "LogProgress"),
    ("comera_lightning.training.loggers", "comera_lightning.loggers", "ResilientMLFlowLogger"),
    ("comera_lightning.training.loggers.fallback", "comera_lightning.loggers.fallback", "upload_fallback"),
]


@pytest.mark.parametrize(("old", "new", "name"), MOVED)
def test_an_old_path_still_imports_the_same_objects_and_says_where_they_went(old, new, name):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} has moved to {new}; import it from there"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_slice_optimizer_state_keeps_its_old_home_in_optim():
    import comera_lightning.optim as optim
    from comera_lightning.rank_adaptation import slice_optimizer_state

    with pytest.warns(
        DeprecationWarning,
        match=r"^comera_lightning\.optim\.slice_optimizer_state has moved to comera_lightning\.rank_adaptation; import",
    ):
        assert optim.slice_optimizer_state is slice_optimizer_state
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        optim.nothing  # noqa: B018


def test_the_configs_old_strategy_class_path_still_resolves():
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy

    from comera_lightning.strategies import FSDP2Strategy

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Strategy)
    sys.modules.pop("comera_lightning.sharding", None)
    with pytest.warns(DeprecationWarning):
        config = parser.parse_args(["--strategy", '{"class_path": "comera_lightning.sharding.FSDP2Strategy"}'])
    assert isinstance(parser.instantiate_classes(config).strategy, FSDP2Strategy)


def test_the_old_training_package_still_offers_the_callbacks_and_the_logger():
    sys.modules.pop("comera_lightning.training", None)
    with pytest.warns(DeprecationWarning, match="callbacks to comera_lightning.callbacks, the MLflow logger to"):
        training = importlib.import_module("comera_lightning.training")
    from comera_lightning.callbacks import KeepFreedMemory
    from comera_lightning.loggers import ResilientMLFlowLogger

    assert training.KeepFreedMemory is KeepFreedMemory and training.ResilientMLFlowLogger is ResilientMLFlowLogger
    # the names it offers are those that lived there: the generic callbacks and the logger, no more, no fewer
    assert training.__all__ == [
        "CompactModelSummary",
        "Compile",
        "CudaGraphs",
        "DeadRankWatchdog",
        "DivergenceError",
        "DivergenceGuard",
        "FaultTolerance",
        "FinalValidation",
        "KeepFreedMemory",
        "LogProgress",
        "PredictionWriter",
        "ResilientMLFlowLogger",
        "StepProgressBar",
    ]
