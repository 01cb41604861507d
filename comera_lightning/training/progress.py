"""StepProgressBar: a rich progress bar that counts towards ``max_steps`` when the budget is in steps.

Lightning's bars count batches of the current epoch and show ``Epoch e/max_epochs-1``; a step-budgeted
run has ``max_epochs=-1`` and reads ``Epoch 0/-2 ... 0/625``, with no sign of how much of the run is left.
This bar keeps one training bar across epochs, filled to ``trainer.global_step`` of ``trainer.max_steps``
(optimiser steps, the unit of the budget), and falls back to Lightning's behaviour without ``max_steps``.

Its clock and rate are its own: rich derives them from the bar's updates, but Lightning restarts the
training bar every epoch and fills it with the batch index before this bar sets the step, so rich saw
jumps of whole epochs in no time (a non-interactive log printed rates such as ``46483 it/s``).
"""

from __future__ import annotations

import time
from collections import deque
from datetime import timedelta
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from rich.progress import ProgressColumn, Task
from rich.text import Text
from typing_extensions import override

__all__ = ["StepProgressBar"]


class StepClock:
    """Elapsed time, steps per second over a recent window, and the time left to ``total`` steps.

    Args:
        window_s: the rate is measured over the steps of the last ``window_s`` seconds.
    """

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self.start: float | None = None
        self._samples: deque[tuple[float, int]] = deque()

    def reset(self, now: float | None = None) -> None:
        """Start the clock (at the start of a fit)."""
        self.start = time.monotonic() if now is None else now
        self._samples.clear()

    def record(self, step: int, now: float | None = None) -> None:
        """Note that ``step`` steps are done at time ``now``."""
        now = time.monotonic() if now is None else now
        if self.start is None:
            self.reset(now)
        if self._samples and step < self._samples[-1][1]:  # a step count that went back: measure afresh
            self._samples.clear()
        self._samples.append((now, step))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def elapsed(self, now: float | None = None) -> float | None:
        """Seconds since :meth:`reset`, or ``None`` before it."""
        return None if self.start is None else (time.monotonic() if now is None else now) - self.start

    def rate(self) -> float | None:
        """Steps per second over the window, or ``None`` until two samples a step apart exist."""
        if len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if s1 > s0 and t1 > t0 else None

    def remaining(self, step: int, total: int) -> float | None:
        """Seconds left to ``total`` steps at the current rate, or ``None`` without a rate."""
        rate = self.rate()
        return None if rate is None else max(total - step, 0) / rate


def _clock_text(seconds: float | None) -> str:
    return "-:--:--" if seconds is None else str(timedelta(seconds=int(seconds)))


class _StepTimeColumn(ProgressColumn):
    """``elapsed • remaining`` from the task's ``elapsed_s``/``remaining_s`` fields; other tasks as ``fallback``."""

    max_refresh = 0.5

    def __init__(self, fallback: ProgressColumn, style: Any) -> None:
        super().__init__()
        self.fallback, self.style = fallback, style

    def render(self, task: Task) -> Any:
        if "elapsed_s" not in task.fields:
            return self.fallback.render(task)
        return Text(
            f"{_clock_text(task.fields['elapsed_s'])} • {_clock_text(task.fields['remaining_s'])}", style=self.style
        )


class _StepRateColumn(ProgressColumn):
    """Optimiser steps per second from the task's ``steps_per_s`` field; other tasks as ``fallback``."""

    def __init__(self, fallback: ProgressColumn, style: Any) -> None:
        super().__init__()
        self.fallback, self.style = fallback, style

    def render(self, task: Task) -> Any:
        if "steps_per_s" not in task.fields:
            return self.fallback.render(task)
        rate = task.fields["steps_per_s"]
        return Text(f"{'-.--' if rate is None else f'{rate:.2f}'} steps/s", style=self.style)


class StepProgressBar(RichProgressBar):
    """:class:`~lightning.pytorch.callbacks.RichProgressBar` showing ``step N/max_steps`` for step budgets.

    Lightning's bar is drawn first, then its training task is set (through rich's public ``Progress`` API)
    to the step count and a ``Steps (epoch e)`` description. With a step budget, the time and rate
    columns of the training bar show the run's elapsed time, its optimiser steps per second and the time
    left to ``max_steps`` (:class:`StepClock`), not rich's estimates.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = StepClock()

    @property
    @override
    def total_train_batches(self) -> int | float:
        if self.trainer.max_steps > 0:
            return self.trainer.max_steps
        return super().total_train_batches

    @override
    def configure_columns(self, trainer: Trainer) -> list:
        columns = super().configure_columns(trainer)
        if trainer.max_steps > 0 and len(columns) >= 2:  # Lightning's last two: time, then speed
            columns[-2] = _StepTimeColumn(columns[-2], self.theme.time)
            columns[-1] = _StepRateColumn(columns[-1], self.theme.processing_speed)
        return columns

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.clock.reset()
        self.clock.record(trainer.global_step)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)  # resets the bar to 0 of the total
        self._show_steps(trainer)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.clock.record(trainer.global_step)
        self._show_steps(trainer)

    def _show_steps(self, trainer: Trainer) -> None:
        """Fill the training bar to ``trainer.global_step`` under a ``Steps (epoch e)`` description."""
        task = self.train_progress_bar_id
        if trainer.max_steps <= 0 or self.progress is None or not self.is_enabled or task is None:
            return
        description = f"{'Steps':{len(self.validation_description)}} (epoch {trainer.current_epoch})"
        if self.theme.description:  # styled as Lightning styles the descriptions of the tasks it adds
            description = f"[{self.theme.description}]{description}"
        step = trainer.global_step
        self.progress.update(
            task,
            completed=step,
            description=description,
            visible=True,
            elapsed_s=self.clock.elapsed(),
            steps_per_s=self.clock.rate(),
            remaining_s=self.clock.remaining(step, trainer.max_steps),
        )
        self.refresh()
