"""CompactModelSummary: Lightning's rich table without an empty FLOPs column, plus the lines a function gives."""

from __future__ import annotations

from lightning.pytorch import Trainer
from tiny import TinyRegressor, regression_loader

from comera_lightning.callbacks import CompactModelSummary
from comera_lightning.cli import comera_sizes


def _fit_and_read(tmp_path, capsys, summary: CompactModelSummary) -> str:
    trainer = Trainer(
        max_steps=1,
        callbacks=[summary],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    trainer.fit(TinyRegressor(), regression_loader())
    return capsys.readouterr().out


def test_the_comera_line_follows_the_totals_and_no_flops_are_shown(tmp_path, capsys):
    out = _fit_and_read(tmp_path, capsys, CompactModelSummary(describe=comera_sizes))
    assert "Total params" in out and "FLOPs" not in out
    assert out.index("Total params") < out.index("CoMERA") and "dense-equivalent" in out


def test_without_a_describe_function_only_lightnings_totals(tmp_path, capsys):
    out = _fit_and_read(tmp_path, capsys, CompactModelSummary())
    assert "Trainable params" in out and "CoMERA" not in out
