"""The RankAdaptation knobs users change most, from the command line, with every shipped config."""

from __future__ import annotations

import pytest
from helpers.cli import CONFIGS, TINY_ENCODER, TINY_TRAINER, _run
from jsonargparse import Namespace

from comera_lightning.callbacks import RankAdaptation
from comera_lightning.cli import ComeraCLI, apply_rank_adaptation_knobs

KNOBS = [
    "--rank_adaptation.target_compression=5",
    "--rank_adaptation.gamma=0.02",
    "--rank_adaptation.late_start_step=100",
    "--rank_adaptation.truncate_every_n_steps=10",
]


class _Parsed(Exception):
    def __init__(self, config) -> None:
        self.config = config


class _ParseOnly(ComeraCLI):
    """Parses (knobs applied) and stops before anything is built."""

    def before_instantiate_classes(self) -> None:
        raise _Parsed(self.config["fit"])


def _rank_adaptation_args(config) -> list:
    return [c.init_args for c in config.trainer.callbacks if c.class_path.endswith("RankAdaptation")]


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml") if p.name != "mnli_6enc_dense.yaml"))
def test_every_shipped_config_with_rank_adaptation_takes_the_knobs(name):
    with pytest.raises(_Parsed) as parsed:
        _ParseOnly(args=["fit", f"--config={CONFIGS / name}", *KNOBS])
    (init_args,) = _rank_adaptation_args(parsed.value.config)
    assert (
        init_args.target_compression,
        init_args.gamma,
        init_args.late_start_step,
        init_args.truncate_every_n_steps,
    ) == (5.0, 0.02, 100, 10)
    assert init_args.get("target_size") is None


@pytest.mark.slow
def test_knobs_reach_the_callback_of_a_fit(workdir):
    cli = _run(
        "fit",
        f"--config={CONFIGS / 'quickstart.yaml'}",
        *TINY_ENCODER,
        *TINY_TRAINER,
        "--trainer.max_steps=2",
        "--data.max_files=15",
        "--data.max_sequences=200",
        *KNOBS,
    )
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, RankAdaptation)]
    assert (callback.target_compression, callback.gamma, callback.late_start_step, callback.truncate_every_n_steps) == (
        5.0,
        0.02,
        100,
        10,
    )


def test_a_size_target_replaces_the_configs_ratio_and_the_ratio_a_size():
    config = Namespace(
        trainer=Namespace(
            callbacks=[
                Namespace(
                    class_path="comera_lightning.callbacks.RankAdaptation",
                    init_args=Namespace(target_compression=20.0, target_size=None, gamma=0.005),
                )
            ]
        )
    )
    apply_rank_adaptation_knobs(config, Namespace(target_size=50_000, target_compression=None, gamma=None))
    init_args = config.trainer.callbacks[0].init_args
    assert (init_args.target_size, init_args.target_compression, init_args.gamma) == (50_000, None, 0.005)
    apply_rank_adaptation_knobs(config, Namespace(target_compression=8.0))
    assert (init_args.target_size, init_args.target_compression) == (None, 8.0)


def test_a_start_fraction_replaces_the_configs_start_step_and_the_step_a_fraction():
    with pytest.raises(_Parsed) as parsed:
        _ParseOnly(args=["fit", f"--config={CONFIGS / 'llm_cpu.yaml'}", "--rank_adaptation.late_start_fraction=0.2"])
    (init_args,) = _rank_adaptation_args(parsed.value.config)
    assert (init_args.late_start_fraction, init_args.get("late_start_step")) == (0.2, None)
    config = Namespace(
        trainer=Namespace(
            callbacks=[
                Namespace(
                    class_path="comera_lightning.callbacks.RankAdaptation",
                    init_args=Namespace(late_start_fraction=0.1, late_start_step=None),
                )
            ]
        )
    )
    apply_rank_adaptation_knobs(config, Namespace(late_start_step=300))
    init_args = config.trainer.callbacks[0].init_args
    assert (init_args.late_start_step, init_args.late_start_fraction) == (300, None)


def test_a_config_without_rank_adaptation_refuses_the_knobs_and_says_why(capsys):
    with pytest.raises(SystemExit):
        _ParseOnly(args=["fit", f"--config={CONFIGS / 'mnli_6enc_dense.yaml'}", "--rank_adaptation.gamma=0.1"])
    err = capsys.readouterr().err
    assert "--rank_adaptation.gamma: this config has no RankAdaptation callback" in err
    assert "callbacks/rank_adaptation.yaml" in err
