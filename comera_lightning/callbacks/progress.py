"""StepProgressBar: a rich progress bar that counts towards ``max_steps`` when the budget is in steps.

Lightning's bars count batches of the current epoch and show ``Epoch e/max_epochs-1``; a step-budgeted
run has ``max_epochs=-1`` and reads ``Epoch 0/-2 ... 0/625``, with no sign of how much of the run is left.
This bar keeps one training bar across epochs, filled to ``trainer.global_step`` of ``trainer.max_steps``
(optimiser steps, the unit of the budget), and falls back to Lightning's behaviour without ``max_steps``.

Its clock and rate are its own: rich derives them from the bar's updates, but Lightning restarts the
training bar every epoch and fills it with the batch index before this bar sets the step, so rich saw
jumps of whole epochs in no time (a non-interactive log printed rates such as ``46483 it/s``).

LogProgress is the same clock as plain lines, for output that is not a terminal (``nohup``, a batch job,
CI), where a live bar shows nothing until it ends: a line every ``every_s`` seconds and/or every
``every_n_steps`` steps with the step, the progress-bar metrics, steps per second, the time left and
whatever ``describe(model)`` adds, and one line after each validation.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TextIO

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme
from rich.progress import BarColumn, ProgressColumn, Task
from rich.table import Column
from rich.text import Text
from typing_extensions import override

__all__ = ["LogProgress", "StepProgressBar"]


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


class _StepFieldColumn(ProgressColumn):
    """A column drawn from the fields the step bar sets on its training task (when ``field`` is among them);
    other tasks as ``fallback``."""

    field: str

    def __init__(self, fallback: ProgressColumn, style: Any) -> None:
        super().__init__()
        self.fallback, self.style = fallback, style

    def render(self, task: Task) -> Any:
        if self.field not in task.fields:
            return self.fallback.render(task)
        return Text(self.text(task.fields), style=self.style)

    def text(self, fields: dict[str, Any]) -> str:
        raise NotImplementedError


class _StepTimeColumn(_StepFieldColumn):
    """``elapsed • remaining`` from the task's ``elapsed_s``/``remaining_s`` fields."""

    max_refresh = 0.5
    field = "elapsed_s"

    def text(self, fields: dict[str, Any]) -> str:
        return f"{_clock_text(fields['elapsed_s'])} • {_clock_text(fields['remaining_s'])}"


class _StepRateColumn(_StepFieldColumn):
    """Optimiser steps per second from the task's ``steps_per_s`` field."""

    field = "steps_per_s"

    def text(self, fields: dict[str, Any]) -> str:
        rate = fields["steps_per_s"]
        return f"{'-.--' if rate is None else f'{rate:.2f}'} steps/s"


class StepProgressBar(RichProgressBar):
    """:class:`~lightning.pytorch.callbacks.RichProgressBar` showing ``step N/max_steps`` for step budgets.

    Lightning's bar is drawn first, then its training task is set (through rich's public ``Progress`` API)
    to the step count and a ``Steps (epoch e)`` description. With a step budget, the time and rate
    columns of the training bar show the run's elapsed time, its optimiser steps per second and the time
    left to ``max_steps`` (:class:`StepClock`), not rich's estimates.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # one metric a line: the metrics column is then as wide as its longest "name: value", and the bar
        # gives way in a narrow terminal instead of the metrics wrapping between name and value or being cut
        kwargs.setdefault("theme", RichProgressBarTheme(metrics_text_delimiter="\n"))
        super().__init__(*args, **kwargs)
        self.clock = StepClock()
        self._fitted: Any = None  # the rich Progress whose columns _fit_columns set

    @property
    @override
    def total_train_batches(self) -> int | float:
        if self.trainer.max_steps > 0:
            return self.trainer.max_steps
        return super().total_train_batches

    @override
    def configure_columns(self, trainer: Trainer) -> list:
        columns = super().configure_columns(trainer)
        if len(columns) >= 2 and isinstance(columns[1], BarColumn):  # a fixed 40 columns in Lightning's
            bar = columns[1]
            columns[1] = type(bar)(
                bar_width=None,
                style=bar.style,
                complete_style=bar.complete_style,
                finished_style=bar.finished_style,
                pulse_style=bar.pulse_style,
            )
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

    @override
    def refresh(self, hard: bool = False) -> None:
        self._fit_columns()
        super().refresh(hard)

    def _fit_columns(self) -> None:
        """In a narrow terminal only the bar gives way: every other column (description, counts, times, rate,
        metrics) keeps its whole width, so no metric wraps between its name and value or is cut."""
        progress = self.progress
        if progress is None or progress is self._fitted:
            return
        for column in progress.columns:
            if isinstance(column, ProgressColumn) and not isinstance(column, BarColumn):
                column._table_column = Column(no_wrap=True)  # what rich's table_column argument sets
        self._fitted = progress

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


def _metric_text(metrics: dict[str, Any], prefix: str | None = None) -> str:
    """``key value`` pairs of numeric metrics (4 significant digits), those under ``prefix`` only if given."""
    parts = []
    for key, value in metrics.items():
        if key == "v_num" or (prefix is not None and not key.startswith(prefix)):
            continue
        try:
            parts.append(f"{key} {float(value):.4g}")
        except (TypeError, ValueError):
            continue
    return "  ".join(parts)


class LogProgress(ProgressBar):
    """Training progress as plain lines, for logs: output redirected to a file, a batch job, CI.

    While training, a line such as
    ``step 500/2000 (25%)  train/loss 5.123  3.21 steps/s  elapsed 0:02:36  ETA 0:07:48  compression 4.1x``
    at least every ``every_s`` seconds, every ``every_n_steps`` optimiser steps if that is set, and at the end of
    training; after each validation of a fit, ``validation at step 500: val/loss 5.0  ...``.

    Args:
        every_s: a line at least this often while training (seconds).
        every_n_steps: also a line every this many optimiser steps (0: by time only).
        describe: text appended to each training line, from the model (``comera fit`` gives the compression
            ratio); ``None`` or an empty string adds nothing.
        stream: where the lines go; ``None``: ``sys.stdout`` as it is when a line is written.
    """

    def __init__(
        self,
        every_s: float = 30.0,
        every_n_steps: int = 0,
        describe: Callable[[LightningModule], str | None] | None = None,
        stream: TextIO | None = None,
    ) -> None:
        super().__init__()
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0 (seconds between lines), got {every_s}")
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0 (0: lines by time only), got {every_n_steps}")
        self.every_s, self.every_n_steps = float(every_s), int(every_n_steps)
        self.describe, self.stream = describe, stream
        self.clock = StepClock()
        self._enabled = True
        self._last_time = 0.0
        self._last_step = -1

    @property
    def is_enabled(self) -> bool:
        """Whether lines are written (Lightning disables the bar on every process but global rank 0)."""
        return self._enabled

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.clock.reset()
        self.clock.record(trainer.global_step)
        self._last_time, self._last_step = time.monotonic(), trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        self.clock.record(step)
        if step == self._last_step:  # an accumulation micro-batch: no optimiser step yet
            return
        due = self.every_n_steps > 0 and step % self.every_n_steps == 0
        if due or time.monotonic() - self._last_time >= self.every_s:
            self._write_step(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step != self._last_step:
            self._write_step(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        metrics = _metric_text(self.get_metrics(trainer, pl_module), prefix="val")
        if metrics:
            self._write(f"validation at step {trainer.global_step}: {metrics}")

    def line(self, trainer: Trainer, pl_module: LightningModule) -> str:
        """The training line for the current step."""
        step, total = trainer.global_step, trainer.max_steps
        parts = [f"step {step}/{total} ({100 * step // total}%)" if total > 0 else f"step {step}"]
        metrics = self.get_metrics(trainer, pl_module)
        parts.append(_metric_text({k: v for k, v in metrics.items() if not str(k).startswith("val")}))
        rate = self.clock.rate()
        parts.append(f"{'-.--' if rate is None else f'{rate:.3g}'} steps/s")
        parts.append(f"elapsed {_clock_text(self.clock.elapsed())}")
        if total > 0:
            parts.append(f"ETA {_clock_text(self.clock.remaining(step, total))}")
        if self.describe is not None:
            parts.append(self.describe(pl_module) or "")
        return "  ".join(part for part in parts if part)

    def _write_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_time, self._last_step = time.monotonic(), trainer.global_step
        self._write(self.line(trainer, pl_module))

    def _write(self, text: str) -> None:
        if not self.is_enabled:
            return
        stream = self.stream if self.stream is not None else sys.stdout
        stream.write(text + "\n")
        stream.flush()
