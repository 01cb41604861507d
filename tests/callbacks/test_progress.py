"""StepProgressBar's clock: true elapsed time, steps per second and time left, in a log as on a terminal."""

from __future__ import annotations

import io
import re
import time

import pytest
import rich
import torch
from lightning.pytorch import Trainer
from tiny import TinyRegressor, regression_loader

from comera_lightning.callbacks import LogProgress, StepProgressBar
from comera_lightning.callbacks.progress import StepClock


def test_clock_measures_the_rate_over_its_window_and_restarts_when_the_count_goes_back():
    clock = StepClock(window_s=10.0)
    clock.reset(now=100.0)
    assert clock.rate() is None and clock.remaining(0, 50) is None
    for k in range(21):  # 2 steps a second for 10 s
        clock.record(2 * k, now=100.0 + k)
    assert clock.rate() == pytest.approx(2.0) and clock.elapsed(now=120.0) == pytest.approx(20.0)
    assert clock.remaining(40, 50) == pytest.approx(5.0)
    for k in range(1, 11):  # then 10 steps a second: the window forgets the slow start
        clock.record(40 + 10 * k, now=120.0 + k)
    assert clock.rate() == pytest.approx(10.0)
    clock.record(3, now=131.0)  # a count that goes back (a new fit on the same bar)
    assert clock.rate() is None


class _Paced(TinyRegressor):
    """Steps of at least 20 ms, so the true rate is at most 50 steps/s."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


def test_a_non_interactive_log_shows_the_true_rate_across_epochs(tmp_path):
    out = io.StringIO()
    bar = StepProgressBar(console_kwargs={"file": out, "force_terminal": False, "width": 200})
    trainer = Trainer(
        max_steps=24,
        limit_train_batches=8,
        limit_val_batches=2,
        callbacks=[bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    start = time.monotonic()
    try:
        trainer.fit(_Paced(), regression_loader(), regression_loader())
    finally:
        rich.reconfigure()  # the bar pointed rich's global console at `out`: back to the default one
    true_rate = 24 / (time.monotonic() - start)
    assert trainer.current_epoch >= 2, "the run should cross epoch boundaries, where Lightning restarts its bar"

    line = next(line for line in out.getvalue().splitlines() if line.startswith("Steps"))
    assert "24/24" in line
    shown = float(re.search(r"([\d.]+) steps/s", line).group(1))
    # the bar's window misses the time before the first step and validation, so it reads a little high
    assert true_rate / 2 < shown < min(3 * true_rate, 50.0), (line, true_rate)


class _Logged(_Paced):
    """Shows its loss in the progress bar, and validates with a prefixed key, as the comera tasks do."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self(x).float(), y), prog_bar=True)


def _plain_fit(tmp_path, bar: LogProgress, max_steps: int = 24) -> Trainer:
    trainer = Trainer(
        max_steps=max_steps,
        limit_train_batches=8,
        limit_val_batches=2,
        val_check_interval=8,
        callbacks=[bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    trainer.fit(_Logged(), regression_loader(), regression_loader())
    return trainer


def test_plain_lines_every_n_steps_show_step_loss_rate_eta_and_the_description(tmp_path):
    out = io.StringIO()
    bar = LogProgress(every_n_steps=10, every_s=3600, describe=lambda model: "compression 2.0x", stream=out)
    _plain_fit(tmp_path, bar)
    lines = out.getvalue().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["10/24", "20/24", "24/24"], lines  # the end always gets one
    line = steps[1]
    assert re.search(r"train/loss [\d.]+", line) and re.search(r"[\d.]+ steps/s", line), line
    assert re.search(r"ETA \d+:\d\d:\d\d", line) and line.endswith("compression 2.0x"), line
    validations = [line for line in lines if line.startswith("validation")]
    assert len(validations) == 3 and all(re.search(r"val/loss [\d.]+", line) for line in validations), lines


def test_plain_lines_come_at_least_every_every_s_seconds(tmp_path):
    out = io.StringIO()
    _plain_fit(tmp_path, LogProgress(every_s=0.1, stream=out))  # 20 ms a step
    steps = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert 4 <= len(steps) <= 24, steps


def test_plain_progress_refuses_a_bad_interval():
    with pytest.raises(ValueError, match="every_s must be > 0"):
        LogProgress(every_s=0)
    with pytest.raises(ValueError, match="every_n_steps must be >= 0"):
        LogProgress(every_n_steps=-1)


class _ManyMetrics(_Logged):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y)
        metrics = {"val/loss": loss, "val/perplexity": 1000 * torch.exp(loss), "val/mlm_accuracy": loss / 10}
        self.log_dict(metrics, prog_bar=True)


@pytest.mark.parametrize("width", [110, 90])
def test_a_narrow_terminal_keeps_each_metric_whole(tmp_path, width):
    """Was: in 110 columns metric names and values landed on separate lines, and long names were cut."""
    out = io.StringIO()
    console = {"file": out, "force_terminal": True, "width": width, "color_system": None}
    trainer = Trainer(
        max_steps=2000,
        max_time={"seconds": 3},
        limit_train_batches=8,
        limit_val_batches=2,
        val_check_interval=8,
        callbacks=[StepProgressBar(console_kwargs=console)],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    try:
        trainer.fit(_ManyMetrics(), regression_loader(), regression_loader())
    finally:
        rich.reconfigure()
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    for name in ("train/loss", "val/loss", "val/perplexity", "val/mlm_accuracy"):
        assert re.search(rf"{name}: [\d.]+", screen), (name, screen[-2000:])
    assert "…" not in screen
