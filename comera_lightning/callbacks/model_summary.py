"""CompactModelSummary: Lightning's rich model summary without an empty FLOPs column, plus lines of your own.

Lightning's table has a FLOPs column and total even where it measured none (always, unless the model defines
an ``example_input_array``); this summary leaves them out there. A ``describe`` function adds lines computed
from the model at the start of the fit: the ``comera`` CLI adds the active and dense-equivalent parameters of a
tensorized model (Lightning's counts are allocated parameters, dead rank slices included until truncated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichModelSummary
from typing_extensions import override

__all__ = ["CompactModelSummary"]

_FLOPS = "FLOPs"


class CompactModelSummary(RichModelSummary):
    """:class:`~lightning.pytorch.callbacks.RichModelSummary` without an empty FLOPs column, plus lines of your own.

    Args:
        describe: called with the LightningModule at the start of the fit; the lines it returns (rich markup)
            are printed under the totals.
        **kwargs: as for :class:`~lightning.pytorch.callbacks.RichModelSummary` (``max_depth``, ...).
    """

    def __init__(self, describe: Callable[[pl.LightningModule], list[str]] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.describe = describe
        self._extra_lines: list[str] = []

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._extra_lines = self.describe(pl_module) if self.describe is not None else []
        super().on_fit_start(trainer, pl_module)

    @override
    def summarize(  # type: ignore[override]  # Lightning's staticmethod; an instance method reaches the lines
        self,
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        from lightning.pytorch.utilities.model_summary import get_human_readable_count
        from rich import get_console
        from rich.table import Table

        if not total_flops:
            summary_data = [(name, values) for name, values in summary_data if name != _FLOPS]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        table.add_column(" ", style="dim")
        for name, _ in summary_data[1:]:
            table.add_column(name, justify="right" if name.startswith(("Params", _FLOPS, "In", "Out")) else "left")
        for row in zip(*(values for _, values in summary_data), strict=True):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        frozen = int(total_parameters - trainable_parameters)
        lines = [
            f"[bold]Trainable params[/]: {get_human_readable_count(int(trainable_parameters))}",
            f"[bold]Non-trainable params[/]: {get_human_readable_count(frozen)}",
            f"[bold]Total params[/]: {get_human_readable_count(int(total_parameters))} ({model_size:.2f} MB)",
            *self._extra_lines,
        ]
        if total_flops:
            lines.append(f"[bold]Total FLOPs[/]: {get_human_readable_count(int(total_flops))}")
        for line in lines:
            console.print(line)
