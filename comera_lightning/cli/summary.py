"""How a fit ends: the compact model exported beside the run's checkpoints, and the summary printed (size and
ranks, validation metrics, the checkpoint and export, the MLflow run)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import MLFlowLogger

from ..data.tokenizer import TokenizerLifecycle
from ..export import export_checkpoint, export_model
from ..nn.distributed import is_sharded
from ..nn.tensorize import size_report
from .tracking import MLFLOW_UI, _mlflow_run, mlflow_run_page


def export_final_model(trainer: Trainer, model: LightningModule) -> Path | None:
    """Export the trained model (TT cores at their active ranks, :mod:`comera_lightning.export`) as
    ``model.safetensors`` beside the run's checkpoint folder, and log it to MLflow (artifact
    ``model/model.safetensors``) so the run shows what it produced. ``None`` when no checkpoint folder."""
    checkpoint = trainer.checkpoint_callback
    folder = getattr(checkpoint, "dirpath", None)
    if not folder:
        return None
    run_ids = {
        logger.run_id: logger for logger in trainer.loggers if isinstance(logger, MLFlowLogger) and logger.run_id
    }
    metadata = {"mlflow_run_id": next(iter(run_ids))} if run_ids else None
    out = Path(folder).parent / "model.safetensors"
    datamodule = getattr(trainer, "datamodule", None)
    tokenizer = datamodule.tokenizer_file if isinstance(datamodule, TokenizerLifecycle) else None
    if any(is_sharded(p) for p in model.parameters()):
        # FSDP2: this process holds only its shards (and runs alone here), so export what the run last saved
        saved = _last_saved(checkpoint)
        if not saved:
            return None
        path = export_checkpoint(saved, out, metadata=metadata, overwrite=True, tokenizer=tokenizer)
    else:
        path = export_model(model, out, metadata, overwrite=True, tokenizer=tokenizer)
    for run_id, logger in run_ids.items():
        logger.experiment.log_artifact(run_id, str(path), "model")
    return path


def _last_saved(checkpoint: Any) -> str:
    """The checkpoint file a checkpoint callback (or ``None``) wrote last: its last, else its best; ``""`` for none."""
    return getattr(checkpoint, "last_model_path", "") or getattr(checkpoint, "best_model_path", "")


def fit_summary(trainer: Trainer, model: LightningModule, exported: Path | None = None) -> str:
    """What a fit produced: size and ranks, validation metrics, the checkpoint and export, the MLflow run."""
    report = size_report(model)
    lines = [f"comera: trained {trainer.global_step} steps"]
    if report.layers:
        lines.append(
            f"  compression {report.compression_ratio:.1f}x: {report.active_parameters:,} active parameters "
            f"(dense equivalent {report.dense_equivalent_parameters:,}); active TT ranks of the allocated ones:"
        )
        lines += _rank_groups(model)
    else:
        lines.append(f"  {report.active_parameters:,} parameters, no TT layers")
    metrics = {k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith("val/")}
    if metrics:
        lines.append("  validation: " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    path = _last_saved(trainer.checkpoint_callback)
    if path:
        lines.append(f"  checkpoint: {path}")
    if exported is not None:
        lines.append(f"  compact model: {exported} (comera_lightning.export.load_exported)")
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger) and logger.run_id:
            uri, run, experiment = _mlflow_run(logger)
            name = f"{run} ({logger.run_id})" if run else logger.run_id
            lines.append(f"  MLflow: run {name}, experiment {experiment}, at {uri}")
            page = mlflow_run_page
            if uri.startswith(("http://", "https://")):
                lines.append(f"  the run in the UI: {page(uri, logger.experiment_id, logger.run_id)}")
            elif uri.startswith("sqlite:") or uri.startswith("file:") or "://" not in uri:
                lines.append(f"  open the UI: mlflow ui --backend-store-uri {uri}")
                lines.append(f"    then the run: {page(MLFLOW_UI, logger.experiment_id, logger.run_id)}")
    return "\n".join(lines)


def _rank_groups(model: LightningModule) -> list[str]:
    """One line per kind of TT layer (block indices folded into ``*``): its active inner ranks, min-max
    over the blocks, against the ranks it started from."""
    groups: dict[str, list[Any]] = {}
    for layer in size_report(model).layers:
        key = re.sub(r"\.\d+(?=\.|$)", ".*", layer.name)
        groups.setdefault(key, []).append(layer)
    lines = []
    for key, layers in groups.items():

        def span(values: list[int]) -> str:
            return str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"

        bonds = range(1, len(layers[0].ranks) - 1)
        if not bonds:
            continue  # a single-mode layer has no rank to adapt
        active = ",".join(span([layer.active_ranks[b] for layer in layers]) for b in bonds)
        start = ",".join(span([layer.ranks[b] for layer in layers]) for b in bonds)
        count = f" (x{len(layers)})" if len(layers) > 1 else ""
        lines.append(f"    {key}{count}: {active} of {start}")
    return lines
