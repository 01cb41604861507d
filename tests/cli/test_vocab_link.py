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
