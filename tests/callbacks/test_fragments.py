"""The YAML fragments in callbacks/ plug the comera callbacks into any LightningCLI project."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from tiny import TinyRegressor

from comera_lightning.callbacks import ContractionPlanner, RankAdaptation, Tensorize
from comera_lightning.strategies import FSDP2Strategy

FRAGMENTS = Path(__file__).resolve().parents[2] / "callbacks"
CALLBACK_FRAGMENTS = sorted(p.name for p in FRAGMENTS.glob("*.yaml") if p.name != "fsdp2.yaml")
QUIET = ["--trainer.logger=false", "--trainer.enable_checkpointing=false"]


def _trainer(args: list[str]):
    return LightningCLI(TinyRegressor, run=False, args=[*args, *QUIET], save_config_callback=None).trainer


def _callbacks(*configs: Path) -> list:
    return _trainer([arg for config in configs for arg in ("--config", str(config))]).callbacks


def _added(callbacks: list) -> list:
    """The callbacks beyond the ones Lightning adds by itself (progress bar, model summary)."""
    defaults = {type(c) for c in _trainer([]).callbacks}
    return [c for c in callbacks if type(c) not in defaults]


def _fragment(name: str) -> tuple[type, dict[str, Any]]:
    """The one callback a fragment adds: its class and the options it sets."""
    (entry,) = yaml.safe_load((FRAGMENTS / name).read_text())["trainer"]["callbacks+"]
    module, _, cls = entry["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), cls), entry.get("init_args") or {}


def _state(value: Any) -> Any:
    """A comparable picture of a callback's attributes (objects by their own attributes, NaN equal to NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, dict):
        return {k: _state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_state(v) for v in value]
    if torch.is_tensor(value):
        return value.tolist()
    return (type(value).__qualname__, _state(vars(value)))


def _argument(value: Any) -> str:
    """A value as typed on the command line: strings bare, the rest as YAML (JSON is YAML)."""
    return value if isinstance(value, str) else json.dumps(value)


@pytest.mark.parametrize("name", CALLBACK_FRAGMENTS)
def test_a_fragment_adds_exactly_its_callback_with_its_options_by_config_and_by_command_line(name):
    kind, options = _fragment(name)
    expected = _state(kind(**options))
    by_config = _added(_callbacks(FRAGMENTS / name))
    # the same callback on the command line, every option the fragment sets given as its own argument
    args = [f"--trainer.callbacks+={kind.__module__}.{kind.__qualname__}"]
    args += [f"--trainer.callbacks.{key}={_argument(value)}" for key, value in options.items()]
    by_command_line = _added(_trainer(args).callbacks)
    for added in (by_config, by_command_line):
        assert [type(c) for c in added] == [kind]
        assert _state(added[0]) == expected


def test_the_fragments_set_their_documented_values():
    # the options that differ from the callbacks' defaults, as the fragments' comments describe them
    rank = _added(_callbacks(FRAGMENTS / "rank_adaptation.yaml"))[0]
    assert rank.late_start_epoch == 2 and rank.target_compression == 10.0 and rank.truncate_every_n_steps == 100
    tensorize = _added(_callbacks(FRAGMENTS / "tensorize.yaml"))[0]
    assert tensorize.arguments["rank"] == 30 and tensorize.arguments["min_features"] == 128


def test_fsdp2_fragment_sets_the_strategy_and_adds_no_callback():
    trainer = _trainer(["--config", str(FRAGMENTS / "fsdp2.yaml")])
    assert type(trainer.strategy) is FSDP2Strategy and not _added(trainer.callbacks)
    by_command_line = _trainer(['--trainer.strategy={"class_path": "comera_lightning.strategies.FSDP2Strategy"}'])
    assert type(by_command_line.strategy) is FSDP2Strategy and not _added(by_command_line.callbacks)


def test_fragments_compose():
    found = _added(_callbacks(*sorted(FRAGMENTS.glob("*.yaml"))))
    assert sorted(type(c).__name__ for c in found) == sorted(_fragment(name)[0].__name__ for name in CALLBACK_FRAGMENTS)
    for kind in (RankAdaptation, ContractionPlanner, Tensorize):
        assert sum(isinstance(c, kind) for c in found) == 1
    rank = next(c for c in found if isinstance(c, RankAdaptation))
    assert rank.late_start_epoch == 2 and rank.target_compression == 10.0


def test_tensorize_from_the_command_line():
    args = [
        "--trainer.callbacks+=comera_lightning.callbacks.Tensorize",
        "--trainer.callbacks.rank=8",
        "--trainer.callbacks.min_features=16",
        "--trainer.callbacks.parameterization=mup",
        "--trainer.callbacks.layer_kwargs={init_std: 0.1}",
    ]
    found = _added(_trainer(args).callbacks)
    assert [type(c) for c in found] == [Tensorize]
    assert found[0].arguments["rank"] == 8 and found[0].arguments["min_features"] == 16
    # every option of tensorize() is a field of the callback's TensorizeOptions, hence an argument
    assert found[0].options.parameterization == "mup" and found[0].options.layer_kwargs == {"init_std": 0.1}
    # or as one options object
    as_options = "{class_path: comera_lightning.callbacks.Tensorize, init_args: {options: {rank: 8, min_features: 16}}}"
    (callback,) = _added(_trainer([f"--trainer.callbacks+={as_options}"]).callbacks)
    assert callback.arguments["rank"] == 8 and callback.arguments["min_features"] == 16
