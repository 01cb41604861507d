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

It also keeps a compact rank history (one entry per layer only when its ranks change, plus the steps of
:class:`~comera_lightning.callbacks.RankAdaptation`'s switch to the late stage and of its truncations) that
travels in checkpoints, and at the end of ``fit`` writes ``rank_evolution.png`` (model size and compression
ratio over steps above a heatmap of the active rank of every bond of every layer, with the stage switch and
the truncations marked; see :func:`plot_rank_history`) and ``rank_history.json`` (the history plus the
final size report): uploaded as artifacts under ``comera/`` of the run of every
:class:`~lightning.pytorch.loggers.MLFlowLogger`, written into the log directory of every other logger.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from itertools import pairwise
from typing import Any, NamedTuple

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from ..nn.tensorize import SizeReport, size_report, tt_layers
from ..rank_adaptation import RankAdaptation
from ..utilities.internals import trainer_callbacks

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
        max_history_steps: the history is bounded, whatever the length of the run: per-layer ranks and sizes are
            kept as change points (ranks only fall, so there are at most as many as rank slices), and the steps
            of the logging events are downsampled, every other one dropped, whenever they exceed this number.

    Example::

        trainer = Trainer(callbacks=[RankAdaptation(), RankMonitor(log_every_n_steps=100)],
                          logger=MLFlowLogger(tracking_uri="sqlite:///mlflow.db"))
    """

    def __init__(
        self,
        log_every_n_steps: int = 50,
        save_artifacts: bool = True,
        artifact_path: str = "comera",
        max_history_steps: int = 2048,
    ) -> None:
        if int(log_every_n_steps) < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        if int(max_history_steps) < 2:
            raise ValueError(f"max_history_steps must be >= 2 (the first and the last step), got {max_history_steps}")
        self.max_history_steps = int(max_history_steps)
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
        # RankAdaptation's events, at exact optimiser steps
        self._switch_step: int | None = None
        self._truncation_steps: list[int] = []
        self._target_size: float | None = None
        self._adaptations: list[RankAdaptation] = []
        self._seen_truncations = 0

    @property
    def history(self) -> dict[str, Any]:
        """The rank history as primitives: ``{"steps": [...], "layers": {name: {"steps", "active_ranks"}},
        "params": {"steps", "active", "allocated", "dense_equivalent"}, "events": {"stage_switch",
        "truncations", "target_size"}}``; per-layer and parameter entries are change points (a value holds
        until the next step listed); ``events`` holds RankAdaptation's switch to the late stage (a step or
        None), the steps of its truncations and its late-stage size target in parameters (or None)."""
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
            "events": {
                "stage_switch": self._switch_step,
                "truncations": list(self._truncation_steps),
                "target_size": self._target_size,
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
            if len(self._steps) > self.max_history_steps:
                self._steps = self._steps[-1::-2][::-1]  # every other one, the latest kept
        for layer in report.layers:
            _append_change(
                self._layers.setdefault(layer.name, {"steps": [], "ranks": []}),
                "ranks",
                step,
                [int(r) for r in layer.active_ranks],
            )
        _append_change(
            self._params,
            "values",
            step,
            [int(report.active_parameters), int(report.allocated_parameters), int(report.dense_equivalent_parameters)],
        )

    # --- hooks ---------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # a new fit starts a new history; a resumed one gets its history back from load_state_dict after this
        if stage == "fit":
            self._reset()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._adaptations = [cb for cb in trainer_callbacks(trainer) if isinstance(cb, RankAdaptation)]
        # a resumed fit restored the counter from its checkpoint: only later truncations are new
        self._seen_truncations = sum(cb.truncations for cb in self._adaptations)
        self._watch_events(trainer)
        self._log(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # a RankAdaptation listed after this callback truncated in its on_train_batch_end of the step that
        # global_step still names here
        self._watch_events(trainer)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._watch_events(trainer)
        step = trainer.global_step
        if step != self._last_logged_step and step % self.log_every_n_steps == 0:
            self._log(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._watch_events(trainer)
        # the loggers are still open here (they are finalised before on_fit_end)
        self._log(trainer, pl_module, skip_if_unchanged=True)
        if self.save_artifacts:
            self.write_artifacts(trainer)

    def _watch_events(self, trainer: Trainer) -> None:
        """Note RankAdaptation's stage switch, new truncations and size target (attribute reads only)."""
        if not self._adaptations:
            return
        truncations = 0
        for cb in self._adaptations:
            truncations += cb.truncations
            if cb.switch_step is not None and self._switch_step is None:
                self._switch_step = int(cb.switch_step)
            if cb.target_size is not None:
                self._target_size = float(cb.target_size)
        if truncations > self._seen_truncations:
            self._truncation_steps.append(int(trainer.global_step))
        self._seen_truncations = truncations

    # --- logging -------------------------------------------------------------------------------------
    def _log(self, trainer: Trainer, pl_module: LightningModule, skip_if_unchanged: bool = False) -> None:
        if not tt_layers(pl_module):
            if not self._warned_no_layers:
                rank_zero_warn(
                    f"{type(self).__name__}: {type(pl_module).__name__} has no comera layers "
                    "(TTLinear / TTEmbedding); nothing to monitor.",
                    category=UserWarning,
                )
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
        for callback in trainer_callbacks(trainer):
            provider = getattr(callback, "comera_metrics", None)
            if callback is self or not callable(provider):
                continue
            for key, value in provider().items():
                try:
                    metrics[metric_safe_name(str(key))] = float(value)
                except (TypeError, ValueError) as err:
                    raise TypeError(
                        f"{type(callback).__name__}.comera_metrics() returned a non-numeric value "
                        f"for {key!r}: {value!r}"
                    ) from err
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
        payload: dict[str, Any] = {
            "history": self.history,
            "log_every_n_steps": self.log_every_n_steps,
            "final_size_report": final,
        }
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
    @override
    def state_dict(self) -> dict[str, Any]:
        """The history as ints, lists and dicts only (loads with ``torch.load(weights_only=True)``)."""
        return self.history

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the history of an interrupted fit; a checkpoint from an unknown format is ignored."""
        if not isinstance(state_dict, Mapping) or state_dict.get("format_version") != _FORMAT_VERSION:
            rank_zero_warn(
                f"{type(self).__name__}: checkpoint state not understood; starting a new rank history.",
                category=UserWarning,
            )
            return
        self._steps = [int(s) for s in state_dict.get("steps", [])]
        self._layers = {
            str(name): {
                "steps": [int(s) for s in h["steps"]],
                "ranks": [[int(r) for r in rs] for rs in h["active_ranks"]],
            }
            for name, h in state_dict.get("layers", {}).items()
        }
        p = state_dict.get("params", {})
        self._params = {
            "steps": [int(s) for s in p.get("steps", [])],
            "values": [
                [int(a), int(b), int(c)]
                for a, b, c in zip(
                    p.get("active", []), p.get("allocated", []), p.get("dense_equivalent", []), strict=True
                )
            ],
        }
        events = state_dict.get("events") or {}  # absent in histories written before events were kept
        switch, target = events.get("stage_switch"), events.get("target_size")
        self._switch_step = None if switch is None else int(switch)
        self._truncation_steps = [int(s) for s in events.get("truncations", [])]
        self._target_size = None if target is None else float(target)


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
        directory: str | None
        if isinstance(logger, (CSVLogger, TensorBoardLogger)):
            directory = logger.log_dir
        else:
            directory = getattr(logger, "log_dir", None) or logger.save_dir
        directory = directory or trainer.default_root_dir
        if directory not in dirs:
            dirs.append(directory)
    return dirs


def _values_at(change_steps: list[int], values: list, steps: list[int]) -> list:
    """The value of a change-point series at each of ``steps`` (None before its first change point)."""
    out, i = [], -1
    for step in steps:
        while i + 1 < len(change_steps) and change_steps[i + 1] <= step:
            i += 1
        out.append(values[i] if i >= 0 else None)
    return out


def _short_names(names: list[str]) -> list[str]:
    """Layer names without their common dotted prefix (``model.encoder.``)."""
    prefix = ""
    if len(names) > 1:  # whole dotted parts, and never a layer's own last part
        parents = [n.split(".")[:-1] for n in names]
        for parts in zip(*parents, strict=False):  # as far as the shortest name goes
            if len(set(parts)) > 1:
                break
            prefix += parts[0] + "."
    short = [n[len(prefix) :] for n in names]
    return names if any(not n or n.isdigit() for n in short) else short  # "0", "2" would say nothing


def _cut(text: str, width: int = 28) -> str:
    """``text`` cut from the left to at most ``width`` characters, at a dot where one allows."""
    if len(text) <= width:
        return text
    tail = text[1 - width :]
    dot = tail.find(".")
    return "\u2026" + (tail[dot + 1 :] if 0 <= dot < len(tail) - 1 else tail)


def _split_block(name: str) -> tuple[str, str]:
    """``("layers.3", "attention.query")`` for ``layers.3.attention.query``: the numbered block a layer
    belongs to and its name inside it; ``("", name)`` when the name has no numbered block."""
    match = re.match(r"(.*?(?:^|\.)\d+)\.(.+)$", name)
    return (match.group(1), match.group(2)) if match else ("", name)


def _millions(count: float) -> str:
    return f"{count / 1e6:.3g}M" if count >= 1e5 else f"{count:,.0f}"


def _truncation_steps(history: Mapping[str, Any]) -> list[int]:
    """Recorded truncations, plus a logged step for every drop of allocated parameters none explains
    (a truncation without RankAdaptation, or a history from before events were kept)."""
    recorded = sorted(int(s) for s in (history.get("events") or {}).get("truncations", []))
    params = history.get("params", {})
    steps, allocated = params.get("steps", []), params.get("allocated", [])
    logged = history.get("steps", [])
    out = list(recorded)
    for i in range(1, len(steps)):
        if allocated[i] < allocated[i - 1]:
            j = logged.index(steps[i]) if steps[i] in logged else -1
            previous = logged[j - 1] if j > 0 else steps[i - 1]
            # inclusive: a truncation at a logged step may come after that step's logging (callback order)
            if not any(previous <= r <= steps[i] for r in recorded):
                out.append(int(steps[i]))
    return sorted(set(out))


class _Timeline(NamedTuple):
    """The logged steps and RankAdaptation's events, which both panels share."""

    steps: list[int]
    first: int
    last: int
    span: int
    switch: int | None
    truncations: list[int]
    events: Mapping[str, Any]


class _RankRows(NamedTuple):
    """The heatmap: one row per bond (or per layer), as a share of its initial rank at every logged step."""

    names: list[str]
    rows: list[list[float]]
    row_edges: list[float]  # a layer is at least 3 rows high (its label must fit), its bonds share that height
    layer_rows: list[tuple[float, float]]  # [top, bottom) of every layer
    finals: list[str]  # every layer's final ranks / its initial rank
    bonds: int
    per_bond: bool


def plot_rank_history(history: Mapping[str, Any], path: str, max_bond_rows: int = 400) -> None:
    """Draw :attr:`RankMonitor.history` into a PNG at ``path`` (matplotlib's Agg canvas; no pyplot state).

    Top: active (and allocated) parameters and, on a second axis, the compression ratio over steps, with
    the late-stage size target. Below, on the same step axis: a heatmap with one row per bond of every
    layer (grouped by layer, layers of one block such as ``layers.3`` between thicker lines), coloured by
    the bond's active rank as a share of its first recorded rank; the final ranks are listed on the right.
    Both mark RankAdaptation's switch to the late stage (dashed line) and its truncations (triangles).
    Above ``max_bond_rows`` bonds in all, the heatmap gets one row per layer (its summed bond ranks).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps: list[int] = list(history.get("steps", []))
    events = history.get("events") or {}
    first, last = (steps[0], steps[-1]) if steps else (0, 1)
    timeline = _Timeline(
        steps, first, last, max(last - first, 1), events.get("stage_switch"), _truncation_steps(history), events
    )
    ranks = _rank_rows(history, steps, max_bond_rows)
    units = ranks.row_edges[-1]
    map_height = min(max(0.042 * units, 0.2 * len(ranks.names), 1.2), 10.0) if ranks.rows else 0.0
    size_height = 2.5
    fig = Figure(figsize=(12, size_height + map_height + 0.9), layout="constrained")
    FigureCanvasAgg(fig)
    if ranks.rows:
        grid = fig.add_gridspec(2, 1, height_ratios=[size_height, map_height])
        ax = fig.add_subplot(grid[0])
        heat = fig.add_subplot(grid[1], sharex=ax)
    else:
        ax, heat = fig.add_subplot(1, 1, 1), None
    _plot_sizes(ax, history.get("params", {}), timeline)
    if heat is not None:
        _plot_ranks(fig, heat, ranks, timeline, map_height)
        ax.tick_params(labelbottom=False)
    else:
        ax.set_xlabel("optimiser step", fontsize=9)
    fig.suptitle("CoMERA rank evolution", fontsize=12, fontweight="bold")
    fig.savefig(path, dpi=100)


def _rank_rows(history: Mapping[str, Any], steps: list[int], max_bond_rows: int) -> _RankRows:
    # a one-core train has no bond, hence no rank to learn: it only counts in the sizes
    layers: Mapping[str, Any] = {
        n: h for n, h in history.get("layers", {}).items() if h.get("active_ranks") and len(h["active_ranks"][0]) > 2
    }
    bonds = sum(len(h["active_ranks"][0]) - 2 for h in layers.values())
    per_bond = bonds <= max_bond_rows
    rows: list[list[float]] = []
    row_edges = [0.0]
    layer_rows: list[tuple[float, float]] = []
    finals: list[str] = []
    for h in layers.values():
        initial = h["active_ranks"][0][1:-1]
        at = _values_at(h["steps"], [r[1:-1] for r in h["active_ranks"]], steps)
        top = row_edges[-1]
        if per_bond:
            height = max(len(initial), 3) / max(len(initial), 1)
            for k, r0 in enumerate(initial):
                rows.append([float("nan") if r is None else r[k] / max(r0, 1) for r in at])
                row_edges.append(row_edges[-1] + height)
        else:
            rows.append([float("nan") if r is None else sum(r) / max(sum(initial), 1) for r in at])
            row_edges.append(row_edges[-1] + 1.0)
        layer_rows.append((top, row_edges[-1]))
        final = h["active_ranks"][-1][1:-1]
        finals.append(" ".join(str(r) for r in final) + (f"  /{max(initial)}" if initial else ""))
    return _RankRows(list(layers), rows, row_edges, layer_rows, finals, bonds, per_bond)


def _outline() -> list[Any]:
    """A white halo that keeps a mark readable over any colour."""
    from matplotlib import patheffects

    return [patheffects.withStroke(linewidth=3, foreground="white")]


def _mark_events(axis: Any, timeline: _Timeline, label: bool) -> None:
    """The switch to the late stage (a dashed line) and every truncation (a triangle on top of ``axis``)."""
    if timeline.switch is not None:
        axis.axvline(
            timeline.switch,
            color="black",
            linestyle="--",
            linewidth=1.2,
            path_effects=_outline(),
            label="switch to late stage" if label else None,
            zorder=5,
        )
    if timeline.truncations:
        axis.plot(
            timeline.truncations,
            [1.0] * len(timeline.truncations),
            linestyle="none",
            marker="v",
            markersize=6,
            color="black",
            markeredgecolor="white",
            transform=axis.get_xaxis_transform(),
            clip_on=False,
            label="truncation" if label else None,
            zorder=6,
        )


def _plot_sizes(ax: Any, params: Mapping[str, Any], timeline: _Timeline) -> None:
    """The top panel: active and allocated parameters, the compression ratio and its target, the events."""
    ax.set_xlim(timeline.first, timeline.first + timeline.span)
    handles: list[Any] = []
    if params.get("steps") and timeline.steps:
        _label_stages(ax, timeline)
        handles, title = _plot_size_curves(ax, params, timeline)
    else:
        title = "model size (nothing recorded)"
    _mark_events(ax, timeline, label=True)
    handles += [h for h in ax.get_lines() if h.get_label() in ("switch to late stage", "truncation")]
    # below the panel (its step labels are the heatmap's): the curves stay uncovered
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.02),
        fontsize=8,
        ncols=6,
        frameon=False,
        handlelength=2.5,
    )
    ax.set_title(title, fontsize=10, loc="left")
    ax.tick_params(labelsize=8)
    ax.grid(axis="y", color="0.9", linewidth=0.6)


def _label_stages(ax: Any, timeline: _Timeline) -> None:
    """The late stage shaded, and each stage named where it is wide enough."""
    first, last, switch = timeline.first, timeline.last, timeline.switch
    if switch is None:
        return
    ax.axvspan(switch, last, color="#fbe3c8", zorder=0, linewidth=0)
    for x0, x1, text in ((first, switch, "early stage"), (switch, last, "late stage")):
        if x1 - x0 > 0.08 * timeline.span:
            ax.text(
                (x0 + x1) / 2,
                0.97,
                text,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=9,
                color="0.3",
                style="italic",
            )


def _plot_size_curves(ax: Any, params: Mapping[str, Any], timeline: _Timeline) -> tuple[list[Any], str]:
    """Parameters on ``ax``, the compression ratio on its twin; the legend's handles and the panel's title."""
    import numpy as np
    from matplotlib.ticker import EngFormatter

    steps = timeline.steps
    active, allocated, dense = (
        np.array([np.nan if v is None else v for v in _values_at(params["steps"], params[key], steps)], dtype=float)
        for key in ("active", "allocated", "dense_equivalent")
    )
    handles = ax.plot(steps, active, color="tab:blue", linewidth=1.6, label="active parameters")
    if np.nanmax(allocated - active) > 0:
        handles += ax.plot(
            steps, allocated, color="tab:blue", linewidth=1.0, linestyle=":", label="allocated parameters"
        )
    ax.set_ylim(0, np.nanmax(allocated) * 1.12)
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_ylabel("parameters", color="tab:blue", fontsize=9)
    ratio = dense / np.maximum(active, 1)
    twin = ax.twinx()
    handles += twin.plot(steps, ratio, color="tab:red", linewidth=1.6, label="compression ratio")
    top = np.nanmax(ratio)
    target = timeline.events.get("target_size")
    if target:
        goal = float(dense[-1]) / float(target)
        handles.append(
            twin.axhline(goal, color="tab:red", linestyle="--", linewidth=1.0, label=f"target compression {goal:.1f}x")
        )
        top = max(top, goal)
    twin.set_ylim(0, top * 1.12)
    twin.set_ylabel("compression ratio (dense / active)", color="tab:red", fontsize=9)
    twin.yaxis.set_major_formatter(lambda v, _: f"{v:g}x")
    twin.tick_params(labelsize=8)
    twin.annotate(
        f"{ratio[-1]:.1f}x",
        (steps[-1], ratio[-1]),
        xytext=(-4, -6),
        textcoords="offset points",
        ha="right",
        va="top",
        fontsize=9,
        color="tab:red",
        fontweight="bold",
        path_effects=_outline(),
    )
    title = (
        f"model size: {_millions(active[0])} \u2192 {_millions(active[-1])} active parameters, "
        f"compression {ratio[0]:.1f}x \u2192 {ratio[-1]:.1f}x"
    )
    return handles, title


def _plot_ranks(fig: Any, heat: Any, ranks: _RankRows, timeline: _Timeline, map_height: float) -> None:
    """The heatmap panel: active rank shares, layer and block labels, final ranks, the events, a colour bar."""
    import numpy as np
    from matplotlib import colormaps

    steps, first, last = timeline.steps, timeline.first, timeline.last
    mids = [(a + b) / 2 for a, b in pairwise(steps)]
    x_edges = [first, *mids, last] if len(steps) > 1 else [first, first + timeline.span]
    values = np.ma.masked_invalid(np.array(ranks.rows, dtype=float))
    cmap = colormaps["viridis"].with_extremes(bad="0.85")
    mesh = heat.pcolormesh(
        x_edges, ranks.row_edges, values, cmap=cmap, vmin=0.0, vmax=1.0, shading="flat", rasterized=True
    )
    units = ranks.row_edges[-1]
    heat.set_ylim(units, 0)
    pitch = 72 * map_height / units * min(b - a for a, b in ranks.layer_rows)  # points of the thinnest layer
    fontsize = max(4.5, min(8.0, 0.7 * pitch))
    centers = [(a + b) / 2 for a, b in ranks.layer_rows]
    _label_layers(heat, ranks, centers, fontsize)
    right = heat.twinx()
    right.set_ylim(units, 0)
    right.set_yticks(centers, ranks.finals, fontsize=fontsize, family="monospace")
    right.tick_params(axis="y", length=0)
    heat.annotate(
        "final ranks / initial",
        (1, 1),
        xycoords="axes fraction",
        xytext=(3, 3),
        textcoords="offset points",
        ha="left",
        va="bottom",
        fontsize=8,
    )
    _mark_events(heat, timeline, label=False)
    heat.set_xlabel("optimiser step", fontsize=9)
    heat.tick_params(axis="x", labelsize=8)
    what = "bond" if ranks.per_bond else "layer (summed bond ranks)"
    heat.set_title(
        f"active rank per {what} as a share of its initial rank ({len(ranks.names)} layers, {ranks.bonds} bonds)",
        fontsize=10,
        loc="left",
    )
    bar = fig.colorbar(
        mesh, ax=heat, location="bottom", fraction=0.12 / map_height, aspect=60, pad=0.2 / map_height, shrink=0.5
    )
    bar.set_label("active rank / initial rank", fontsize=8)
    bar.ax.tick_params(labelsize=7)


def _label_layers(heat: Any, ranks: _RankRows, centers: list[float], fontsize: float) -> None:
    """Every layer's name at its rows; numbered blocks (``layers.0``, ``layers.1``, ...) between thick separators,
    with one label per block further left."""
    blocks, inner = zip(*((_cut(b), _cut(n)) for b, n in map(_split_block, _short_names(ranks.names))), strict=True)
    heat.set_yticks(centers, inner, fontsize=fontsize)
    heat.tick_params(axis="y", length=0)
    spans: list[tuple[str, float, float]] = []  # (block, top, bottom)
    for block, (start, stop) in zip(blocks, ranks.layer_rows, strict=True):
        if spans and spans[-1][0] == block:
            spans[-1] = (block, spans[-1][1], stop)
        else:
            spans.append((block, start, stop))
    for start, _ in ranks.layer_rows[1:]:
        heat.axhline(start, color="white", linewidth=0.5)
    for _, start, _ in spans[1:]:
        heat.axhline(start, color="white", linewidth=2.0)
    if any(blocks):
        outer = heat.secondary_yaxis("left")
        outer.spines["left"].set_visible(False)
        widest = max(len(t) for b, t in zip(blocks, inner, strict=True) if b)
        outer.set_yticks(
            [(a + b) / 2 for blk, a, b in spans if blk],
            [blk for blk, _, _ in spans if blk],
            fontsize=fontsize + 1,
            fontweight="bold",
        )
        outer.tick_params(axis="y", length=0, pad=0.62 * fontsize * widest + 8)
