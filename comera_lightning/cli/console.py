"""What ``comera`` prints while it runs: upstream messages a user cannot act on silenced, a live bar on a terminal
or plain lines in a log, and the model's CoMERA size in the model summary and the progress lines."""

from __future__ import annotations

import logging
import sys
import warnings

from lightning.pytorch import LightningModule

from ..nn.tensorize import size_report


class _DropTips(logging.Filter):
    """Lightning 2.6's advertisements on every Trainer ("Tip: For seamless cloud logging ...", "... uploads and
    versioning"): nothing a user of this CLI can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip: For seamless cloud" not in record.getMessage()


def quiet_upstream_messages() -> None:
    """Silence the known, harmless messages of upstream versions that a ``comera`` user cannot act on."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropTips) for f in logger.filters):
        logger.addFilter(_DropTips())
    # MLflow announces at INFO that it creates the tables of a new sqlite store ("Creating initial MLflow database
    # tables...", "Updating database tables")
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    # lightning 2.6.x's utilities/_pytree.py builds torch's LeafSpec, deprecated since torch 2.10: a FutureWarning
    # from inside Lightning on every fit
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    # under bf16-mixed Lightning's summary says it "will not be accurate. Using 32 bits": the weights of a mixed run
    # are float32, so 32 bits is right, and the fit's own summary counts the CoMERA sizes exactly
    warnings.filterwarnings(
        "ignore", message=r"Precision bf16-mixed is not supported by the model summary", category=UserWarning
    )


def _interactive_output() -> bool:
    """Whether standard output is a terminal (a live progress bar), not a file or a pipe (plain lines)."""
    return sys.stdout.isatty()


def _rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def compression_text(model: LightningModule) -> str | None:
    """``compression 4.1x`` for a model with TT layers (the plain progress lines' last field), else ``None``."""
    report = size_report(model)
    return f"compression {report.compression_ratio:.1f}x" if report.layers else None


def comera_sizes(model: LightningModule) -> list[str]:
    """The model summary's CoMERA line: active and dense-equivalent parameters (none for a model without TT layers)."""
    report = size_report(model)
    if not report.layers:
        return []
    return [
        f"[bold]CoMERA[/]: {report.active_parameters:,} active parameters of "
        f"{report.dense_equivalent_parameters:,} dense-equivalent ({report.compression_ratio:.1f}x); "
        "the counts above are allocated ones, dead rank slices included until truncated"
    ]
