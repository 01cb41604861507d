"""ComeraModelSummary: Lightning's rich model summary, with the sizes that matter for a CoMERA model.

Lightning's table counts *allocated* parameters: a TT layer's masked (dead) rank slices count until the layer is
physically truncated, and the dense layers a TT layer stands for do not count at all. This summary keeps the
table and adds one line with the active parameters, the dense-equivalent ones and the compression ratio
(:func:`~comera_lightning.nn.size_report`, what RankMonitor logs). Its FLOPs column and total are left out
where Lightning measured none (always, unless the model defines an ``example_input_array``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichModelSummary
from typing_extensions import override

from ..nn.tensorize import size_report, tt_layers

__all__ = ["ComeraModelSummary"]

_FLOPS = "FLOPs"


class ComeraModelSummary(RichModelSummary):
    """:class:`~lightning.pytorch.callbacks.RichModelSummary` plus the active / dense-equivalent parameters."""

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sizes = size_report(pl_module) if tt_layers(pl_module) else None
        super().on_fit_start(trainer, pl_module)

    @override
    def summarize(self, summary_data: list[tuple[str, list[str]]], total_parameters: int,
                  trainable_parameters: int, model_size: float, total_training_modes: dict[str, int],
                  total_flops: int, **summarize_kwargs: Any) -> None:
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
        lines = [f"[bold]Trainable params[/]: {get_human_readable_count(int(trainable_parameters))}",
                 f"[bold]Non-trainable params[/]: {get_human_readable_count(int(total_parameters - trainable_parameters))}",
                 f"[bold]Total params[/]: {get_human_readable_count(int(total_parameters))} "
                 f"({model_size:.2f} MB)"]
        sizes = getattr(self, "_sizes", None)
        if sizes is not None:
            lines.append(f"[bold]CoMERA[/]: {sizes.active_parameters:,} active parameters of "
                         f"{sizes.dense_equivalent_parameters:,} dense-equivalent ({sizes.compression_ratio:.1f}x); "
                         "the counts above are allocated ones, dead rank slices included until truncated")
        if total_flops:
            lines.append(f"[bold]Total FLOPs[/]: {get_human_readable_count(int(total_flops))}")
        for line in lines:
            console.print(line)
