"""RankMonitor: watch CoMERA's ranks and model size shrink while training.

CoMERA learns the TT ranks of every comera layer during training (gates below a threshold switch rank
slices off), so the model's size is itself a training curve. Every ``log_every_n_steps`` optimiser steps,
and once when training starts and ends, this callback sends to every logger of the Trainer, in ONE
``log_metrics`` call per logger (MLflow pays about 5 ms a call whatever the number of keys):

* ``rank/<layer>/bond<k>``: active rank ``r_k`` of internal bond ``k`` (1-based as in ``ranks``, which is
  ``[1, r_1, ..., r_{d-1}, 1]``; bond ``k`` is gated by ``layer.gates[k - 1]``) of every comera layer;
* ``params/active``, ``params/allocated``, ``params/dense_equivalent`` and ``compression_ratio``
  (see :func:`comera_lightning.nn.size_report`);
* whatever ``comera_metrics()`` returns on any other callback of the Trainer (RankAdaptation's stage,
  penalty and objective weights).

It also keeps a compact rank history (one entry per layer only when its ranks change) that travels in
checkpoints, and at the end of ``fit`` writes ``rank_evolution.png`` (one panel per layer with the active
rank of each bond over steps, after a panel of total size and compression) and ``rank_history.json``
(the history plus the final size report): uploaded as artifacts under ``comera/`` of the run of every
:class:`~lightning.pytorch.loggers.MLFlowLogger`, written into the log directory of every other logger.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from typing import Any, Mapping

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from ..nn.tensorize import SizeReport, size_report, tt_layers

__all__ = ["RankMonitor", "metric_safe_name", "plot_rank_history"]

_FORMAT_VERSION = 1
_UNSAFE = re.compile(r"[^A-Za-z0-9_/. -]")  # what Lightning's MLFlowLogger keeps (it deletes the rest)
_COMPILED_PREFIX = re.compile(r"(^|\.)_orig_mod\.")  # torch.compile's wrapper, not part of the layer name
PNG_NAME = "rank_evolution.png"
JSON_NAME = "rank_history.json"


def metric_safe_name(name: str) -> str:
    """``name`` with every character MLflow would refuse in a metric key replaced by ``_``."""
    return _UNSAFE.sub("_", _COMPILED_PREFIX.sub(r"\1", name))


class RankMonitor(Callback):
    """Log the active ranks of every comera layer, the model size and the compression ratio.

    Works with any LightningModule whose modules include comera layers (:func:`comera_lightning.nn.tensorize`)
    and any loggers; logs from global rank zero only (ranks and sizes are identical on every process).

    Args:
        log_every_n_steps: log every this many optimiser steps (``trainer.global_step``), besides once at
            the start and once at the end of training.
        save_artifacts: at the end of ``fit`` write the rank-evolution PNG and the JSON history (see
            :meth:`write_artifacts`).
        artifact_path: folder of the artifacts inside an MLflow run.

    Example::

        trainer = Trainer(callbacks=[RankAdaptation(), RankMonitor(log_every_n_steps=100)],
                          logger=MLFlowLogger(tracking_uri="sqlite:///mlflow.db"))
    """

    def __init__(self, log_every_n_steps: int = 50, save_artifacts: bool = True, artifact_path: str = "comera") -> None:
        if int(log_every_n_steps) < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        self.log_every_n_steps = int(log_every_n_steps)
        self.save_artifacts = bool(save_artifacts)
        self.artifact_path = artifact_path
        self._reset()

    # --- history -------------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._steps: list[int] = []  # every logging event
        # per layer, change points only: steps[i] is when the layer's active ranks became ranks[i]
        self._layers: dict[str, dict[str, list]] = {}
        # change points of [active, allocated, dense_equivalent] parameters
        self._params: dict[str, list] = {"steps": [], "values": []}
        self._last_logged_step = -1
        self._warned_no_layers = False

    @property
    def history(self) -> dict[str, Any]:
        """The rank history as primitives: ``{"steps": [...], "layers": {name: {"steps", "active_ranks"}},
        "params": {"steps", "active", "allocated", "dense_equivalent"}}``; per-layer and parameter entries
        are change points (a value holds until the next step listed)."""
        values = self._params["values"]
        return {
            "format_version": _FORMAT_VERSION,
            "steps": list(self._steps),
            "layers": {
                name: {"steps": list(h["steps"]), "active_ranks": [list(r) for r in h["ranks"]]}
                for name, h in self._layers.items()
            },
            "params": {
                "steps": list(self._params["steps"]),
                "active": [v[0] for v in values],
                "allocated": [v[1] for v in values],
                "dense_equivalent": [v[2] for v in values],
            },
        }

    def ranks_at(self, step: int) -> dict[str, list[int]]:
        """Active ranks ``[1, r_1, ..., 1]`` of every layer as recorded at or before ``step``."""
        out = {}
        for name, h in self._layers.items():
            i = _last_index_at_or_before(h["steps"], step)
            if i is not None:
                out[name] = list(h["ranks"][i])
        return out

    def _record(self, step: int, report: SizeReport) -> None:
        if not self._steps or self._steps[-1] != step:
            self._steps.append(step)
        for layer in report.layers:
            _append_change(self._layers.setdefault(layer.name, {"steps": [], "ranks": []}), "ranks", step,
                           [int(r) for r in layer.active_ranks])
        _append_change(self._params, "values", step, [int(report.active_parameters),
                                                      int(report.allocated_parameters),
                                                      int(report.dense_equivalent_parameters)])

    # --- hooks ---------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # a new fit starts a new history; a resumed one gets its history back from load_state_dict after this
        if stage == "fit":
            self._reset()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step != self._last_logged_step and step % self.log_every_n_steps == 0:
            self._log(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the loggers are still open here (they are finalised before on_fit_end)
        self._log(trainer, pl_module, skip_if_unchanged=True)
        if self.save_artifacts:
            self.write_artifacts(trainer)

    # --- logging -------------------------------------------------------------------------------------
    def _log(self, trainer: Trainer, pl_module: LightningModule, skip_if_unchanged: bool = False) -> None:
        if not tt_layers(pl_module):
            if not self._warned_no_layers:
                rank_zero_warn(f"{type(self).__name__}: {type(pl_module).__name__} has no comera layers "
                               "(TTLinear / TTEmbedding); nothing to monitor.", category=UserWarning)
                self._warned_no_layers = True
            return
        step = trainer.global_step
        report = size_report(pl_module)
        if skip_if_unchanged and step == self._last_logged_step and self._unchanged(report):
            return
        self._record(step, report)
        # built on every process: a comera_metrics() that needs a collective then still sees all ranks
        metrics = self.collect_metrics(trainer, report)
        self._last_logged_step = step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _unchanged(self, report: SizeReport) -> bool:
        latest = {name: h["ranks"][-1] for name, h in self._layers.items() if h["ranks"]}
        return all(latest.get(layer.name) == [int(r) for r in layer.active_ranks] for layer in report.layers)

    def collect_metrics(self, trainer: Trainer, report: SizeReport) -> dict[str, float]:
        """Everything one logging event sends: per-bond ranks, sizes and other callbacks' ``comera_metrics()``."""
        metrics: dict[str, float] = {}
        for layer in report.layers:
            prefix = f"rank/{metric_safe_name(layer.name)}/bond"
            for k, r in enumerate(layer.active_ranks[1:-1], start=1):
                metrics[f"{prefix}{k}"] = float(r)
        metrics["params/active"] = float(report.active_parameters)
        metrics["params/allocated"] = float(report.allocated_parameters)
        metrics["params/dense_equivalent"] = float(report.dense_equivalent_parameters)
        metrics["compression_ratio"] = float(report.compression_ratio)
        for callback in trainer.callbacks:
            provider = getattr(callback, "comera_metrics", None)
            if callback is self or not callable(provider):
                continue
            for key, value in provider().items():
                try:
                    metrics[metric_safe_name(str(key))] = float(value)
                except (TypeError, ValueError) as err:
                    raise TypeError(f"{type(callback).__name__}.comera_metrics() returned a non-numeric value "
                                    f"for {key!r}: {value!r}") from err
        return metrics

    # --- artifacts -----------------------------------------------------------------------------------
    def write_artifacts(self, trainer: Trainer) -> list[str]:
        """Write ``rank_evolution.png`` and ``rank_history.json`` for the history so far.

        Every MLFlowLogger gets them as artifacts of its run (under ``artifact_path``); every other logger
        gets them in its log directory (``trainer.default_root_dir`` when there are no loggers). Runs on
        global rank zero only and needs no collective, so it may be called from any hook.

        Returns:
            The local files written (MLflow uploads go through a temporary directory that is removed).
        """
        if not trainer.is_global_zero or not self._steps:
            return []
        pl_module = trainer.lightning_module
        final = size_report(pl_module).as_dict() if pl_module is not None and tt_layers(pl_module) else None
        payload = {"history": self.history, "log_every_n_steps": self.log_every_n_steps, "final_size_report": final}
        mlflow_loggers = [lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)]
        local_dirs = _local_dirs(trainer)
        written: list[str] = []
        with tempfile.TemporaryDirectory(prefix="comera_rank_monitor_") as tmp:
            files = [os.path.join(tmp, JSON_NAME)]
            with open(files[0], "w") as f:
                json.dump(payload, f, indent=1)
            try:
                png = os.path.join(tmp, PNG_NAME)
                plot_rank_history(payload["history"], png)
                files.append(png)
            except ImportError as err:  # matplotlib is optional for the rest of the package
                rank_zero_warn(f"{type(self).__name__}: no rank-evolution picture ({err}).", category=UserWarning)
            for logger in mlflow_loggers:
                for path in files:
                    logger.experiment.log_artifact(logger.run_id, path, artifact_path=self.artifact_path)
            for directory in local_dirs:
                os.makedirs(directory, exist_ok=True)
                for path in files:
                    written.append(shutil.copy(path, os.path.join(directory, os.path.basename(path))))
        return written

    # --- checkpoint state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The history as ints, lists and dicts only (loads with ``torch.load(weights_only=True)``)."""
        return self.history

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the history of an interrupted fit; a checkpoint from an unknown format is ignored."""
        if not isinstance(state_dict, Mapping) or state_dict.get("format_version") != _FORMAT_VERSION:
            rank_zero_warn(f"{type(self).__name__}: checkpoint state not understood; starting a new rank history.",
                           category=UserWarning)
            return
        self._steps = [int(s) for s in state_dict.get("steps", [])]
        self._layers = {
            str(name): {"steps": [int(s) for s in h["steps"]],
                        "ranks": [[int(r) for r in rs] for rs in h["active_ranks"]]}
            for name, h in state_dict.get("layers", {}).items()
        }
        p = state_dict.get("params", {})
        self._params = {"steps": [int(s) for s in p.get("steps", [])],
                        "values": [[int(a), int(b), int(c)] for a, b, c in
                                   zip(p.get("active", []), p.get("allocated", []), p.get("dense_equivalent", []))]}


def _append_change(series: dict[str, list], key: str, step: int, value: list[int]) -> None:
    """Append ``(step, value)`` to a change-point series unless the value is unchanged."""
    steps, values = series["steps"], series[key]
    if values and values[-1] == value:
        return
    if steps and steps[-1] == step:  # a second event at the same step: the later value wins
        values[-1] = value
        if len(values) > 1 and values[-2] == value:
            steps.pop()
            values.pop()
        return
    steps.append(step)
    values.append(value)


def _last_index_at_or_before(steps: list[int], step: int) -> int | None:
    index = None
    for i, s in enumerate(steps):
        if s > step:
            break
        index = i
    return index


def _local_dirs(trainer: Trainer) -> list[str]:
    """Where non-MLflow loggers keep their files (without ``trainer.log_dir``, which is a collective)."""
    dirs: list[str] = []
    loggers: list[Logger] = trainer.loggers
    if not loggers:
        dirs.append(trainer.default_root_dir)
    for logger in loggers:
        if isinstance(logger, MLFlowLogger):
            continue
        if isinstance(logger, (CSVLogger, TensorBoardLogger)):
            directory = logger.log_dir
        else:
            directory = getattr(logger, "log_dir", None) or logger.save_dir
        directory = directory or trainer.default_root_dir
        if directory not in dirs:
            dirs.append(directory)
    return dirs


def _step_series(steps: list[int], values: list[float], last_step: int) -> tuple[list[int], list[float]]:
    """Change points extended to ``last_step``, for ``drawstyle="steps-post"``."""
    if values and steps[-1] < last_step:
        return [*steps, last_step], [*values, values[-1]]
    return list(steps), list(values)


def plot_rank_history(history: Mapping[str, Any], path: str, max_layer_panels: int = 48) -> None:
    """Draw :attr:`RankMonitor.history` into a PNG at ``path`` (matplotlib's Agg canvas; no pyplot state).

    The first panel shows total active parameters and the compression ratio; then one panel per layer
    with the active rank of every bond over steps. Above ``max_layer_panels`` layers a single heatmap
    (layer x logged step, active fraction of the layer's initial bond ranks) replaces the layer panels.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layers: Mapping[str, Any] = history.get("layers", {})
    steps: list[int] = history.get("steps", [])
    last = steps[-1] if steps else 0
    heatmap = len(layers) > max_layer_panels
    if heatmap:  # size panel above a heatmap with one row per layer
        map_height = max(3.0, 0.12 * len(layers))
        fig = Figure(figsize=(12, 3 + map_height), layout="constrained")
        grid = fig.add_gridspec(2, 1, height_ratios=[3, map_height])
        axes = [fig.add_subplot(grid[0]), fig.add_subplot(grid[1])]
    else:  # size panel, then one panel per layer, in a grid at most 6 wide
        panels = 1 + len(layers)
        ncols = min(6, math.ceil(math.sqrt(panels)))
        nrows = math.ceil(panels / ncols)
        fig = Figure(figsize=(3.4 * ncols, 2.6 * nrows), layout="constrained")
        axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(panels)]
    FigureCanvasAgg(fig)

    ax = axes[0]
    params = history.get("params", {})
    if params.get("steps"):
        x, active = _step_series(params["steps"], params["active"], last)
        _, dense = _step_series(params["steps"], params["dense_equivalent"], last)
        ax.plot(x, active, drawstyle="steps-post", color="tab:blue")
        ax.set_ylabel("active parameters", color="tab:blue", fontsize=8)
        twin = ax.twinx()
        twin.plot(x, [d / max(a, 1) for d, a in zip(dense, active)], drawstyle="steps-post", color="tab:red")
        twin.set_ylabel("compression ratio", color="tab:red", fontsize=8)
        twin.tick_params(labelsize=7)
    ax.set_title("model size", fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)

    if heatmap:
        names = list(layers)
        matrix = []
        for name in names:
            h = layers[name]
            initial = max(sum(h["active_ranks"][0][1:-1]), 1) if h["active_ranks"] else 1
            row, i = [], -1
            for s in steps:
                while i + 1 < len(h["steps"]) and h["steps"][i + 1] <= s:
                    i += 1
                row.append(sum(h["active_ranks"][i][1:-1]) / initial if i >= 0 else float("nan"))
            matrix.append(row)
        ax = axes[1]
        image = ax.imshow(matrix, aspect="auto", interpolation="nearest", vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_yticks(range(len(names)), names, fontsize=5)
        ticks = sorted({0, len(steps) - 1, *range(0, len(steps), max(1, len(steps) // 8))}) if steps else []
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks], fontsize=7)
        ax.set_xlabel("step", fontsize=8)
        ax.set_title("active rank fraction per layer (sum of bond ranks / initial)", fontsize=9)
        fig.colorbar(image, ax=ax)
    else:
        for ax, (name, h) in zip(axes[1:], layers.items()):
            ranks = h["active_ranks"]
            nbonds = len(ranks[0]) - 2 if ranks else 0
            for k in range(1, nbonds + 1):
                x, y = _step_series(h["steps"], [r[k] for r in ranks], last)
                ax.plot(x, y, drawstyle="steps-post", label=f"r{k}")
            ax.set_title(name if len(name) <= 40 else "..." + name[-37:], fontsize=8)
            ax.set_ylim(bottom=0)
            ax.tick_params(labelsize=7)
            if 0 < nbonds <= 8:
                ax.legend(fontsize=6, loc="lower left", ncols=min(nbonds, 4))
    fig.suptitle("CoMERA active ranks", fontsize=10)
    fig.savefig(path, dpi=100)
