"""StepProgressBar's clock: true elapsed time, steps per second and time left, in a log as on a terminal."""

from __future__ import annotations

import io
import re
import time

import pytest
import rich
from lightning.pytorch import Trainer
from tiny import TinyRegressor, regression_loader

from comera_lightning.training import StepProgressBar
from comera_lightning.training.progress import StepClock


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
