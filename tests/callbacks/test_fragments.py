"""The YAML fragments in callbacks/ plug the comera callbacks into any LightningCLI project."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI
from tiny import TinyRegressor

from comera_lightning.callbacks import ContractionPlanner, RankAdaptation, Tensorize

FRAGMENTS = Path(__file__).resolve().parents[2] / "callbacks"


def _callbacks(*configs: Path) -> list:
    args = [arg for config in configs for arg in ("--config", str(config))]
    args += ["--trainer.logger=false", "--trainer.enable_checkpointing=false"]
    cli = LightningCLI(TinyRegressor, run=False, args=args, save_config_callback=None)
    return cli.trainer.callbacks


def test_each_fragment_adds_its_callback():
    kinds = {
        "rank_adaptation.yaml": RankAdaptation,
        "contraction_planner.yaml": ContractionPlanner,
        "tensorize.yaml": Tensorize,
    }
    for name, kind in kinds.items():
        assert sum(isinstance(c, kind) for c in _callbacks(FRAGMENTS / name)) == 1, name


def test_fragments_compose():
    found = _callbacks(*sorted(FRAGMENTS.glob("*.yaml")))
    for kind in (RankAdaptation, ContractionPlanner, Tensorize):
        assert sum(isinstance(c, kind) for c in found) == 1
    rank = next(c for c in found if isinstance(c, RankAdaptation))
    assert rank.late_start_epoch == 2 and rank.target_compression == 10.0


@pytest.mark.parametrize("name", sorted(p.name for p in FRAGMENTS.glob("*.yaml")))
def test_fragment_is_valid_yaml_for_the_cli(name):
    assert _callbacks(FRAGMENTS / name)


def test_tensorize_from_the_command_line():
    args = [
        "--trainer.callbacks+=comera_lightning.callbacks.Tensorize",
        "--trainer.callbacks.rank=8",
        "--trainer.callbacks.min_features=16",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
    ]
    cli = LightningCLI(TinyRegressor, run=False, args=args, save_config_callback=None)
    found = [c for c in cli.trainer.callbacks if isinstance(c, Tensorize)]
    assert len(found) == 1 and found[0].arguments["rank"] == 8 and found[0].arguments["min_features"] == 16
