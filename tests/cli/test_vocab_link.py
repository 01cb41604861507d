"""data.vocab_size sets model.vocab_size (was: Lightning's hparams merge refused two values); an explicit smaller
model vocabulary is a clear command-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

from comera_lightning.cli import ComeraCLI

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def _config(*extra: str):
    cli = ComeraCLI(args=["--config", str(QUICKSTART), "--trainer.logger=false", *extra], run=False)
    return cli.config


def test_data_vocab_sets_the_model_vocab(workdir):
    config = _config("--data.vocab_size", "1024")
    assert config["model"]["init_args"]["vocab_size"] == 1024 == config["data"]["init_args"]["vocab_size"]


def test_explicit_smaller_model_vocab_is_a_clear_error(workdir, capsys):
    with pytest.raises(SystemExit):
        _config("--data.vocab_size=1024", "--model.vocab_size=512")
    assert "model.vocab_size=512 is smaller than data.vocab_size=1024" in capsys.readouterr().err


def test_explicit_larger_model_vocab_trains_and_logs_both_values(workdir):
    """Was: Lightning's hparams merge stopped the run on ``vocab_size`` having two values. The data's value is
    logged as ``data.vocab_size`` next to the model's."""
    from lightning.pytorch.loggers import CSVLogger

    cli = ComeraCLI(
        args=[
            "--config",
            str(QUICKSTART),
            "--data.vocab_size=1024",
            "--model.vocab_size=1536",
            "--trainer.max_steps=1",
            "--trainer.limit_val_batches=1",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir=logs",
            "--data.max_files=20",
        ],
        run=False,
    )
    cli.trainer.fit(cli.model, cli.datamodule)
    logger = cli.trainer.logger
    assert isinstance(logger, CSVLogger)
    logged = logger.experiment.hparams
    assert logged["vocab_size"] == 1536 and logged["data.vocab_size"] == 1024
    assert cli.model.hparams["vocab_size"] == 1536 and cli.datamodule.hparams["vocab_size"] == 1024
