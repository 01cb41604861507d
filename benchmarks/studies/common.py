"""The protocol the training studies share (``quality_study.py``, ``llm_study.py``, ``pareto_study.py``).

Every run trains one model from the study's seed on the study's datamodule, prepared once, so every method
sees the same batches in the same order (samplers and MLM masks depend on the data seed only). Protocols:
``steps`` (the same optimiser steps), ``time`` (the same training wall-clock: training stops at the budget, and
CoMERA's late stage starts at ``late_fraction`` of it) and ``matched`` (a step count decided before training,
see ``quality_study.py``). The training clock (:class:`StudyRecorder`) counts everything a training step costs
and leaves the validation passes out; ``/proc/stat`` gives the CPU other processes took during each run.

A study's JSON is rewritten after every run (:class:`Progress`), and a rerun of the same spec resumes where it
stopped. Across seeds, :func:`spread` gives mean and min..max and :func:`late_dip` the fall after the late-stage
switch; :func:`plot_curves` and :func:`runs_table` draw and tabulate the runs.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import harness
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from comera_lightning.callbacks import ContractionPlanner, RankAdaptation, ScheduledLateStage
from comera_lightning.nn import size_report, tt_layers

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = REPO / ".cache" / "comera"
PROTOCOLS = ("steps", "time", "matched")
# dense; CoMERA with the default scheduled late stage, the research code's late stage, slices ranked by core norms
METHODS = ("dense", "comera", "comera-paper", "comera-norm")
# study name -> (LightningModule in comera_lightning.lit, datamodule in comera_lightning.data)
TASKS = {
    "mlm": ("MaskedLM", "CodeMLMDataModule"),
    "pairs": ("SequenceClassification", "CodePairsDataModule"),
    "dlrm": ("ClickThrough", "CriteoDataModule"),
    "lm": ("CausalLM", "CodeLMDataModule"),
}
COLOURS = {
    "dense": "tab:blue",
    "galore": "tab:green",
    "lowrank": "tab:green",
    "comera": "tab:red",
    "comera-paper": "tab:orange",
    "comera-norm": "tab:purple",
}
STYLES = {"steps": "-", "time": "--", "matched": ":"}


@dataclass
class StudySpec:
    """One study: the task, its data, the CoMERA schedule and the run lengths.

    ``task_kwargs`` go to the task's LightningModule (each method sets ``tt_linears``/``tt_embeddings``),
    ``data_kwargs`` to its datamodule, ``rank_kwargs`` to ``RankAdaptation`` (the late stage starts at
    ``late_fraction`` of the run). ``metric`` is the headline validation metric, ``secondary`` a second one.
    ``accelerator`` and ``precision`` go to the Trainer (the CPU studies: ``cpu``, ``32-true``); ``datamodule``
    names a datamodule of ``comera_lightning.data`` other than the task's (a config's ``TextLMDataModule``);
    ``grad_clip`` clips the gradients' global norm (the Trainer's ``gradient_clip_val``; None: no clipping).
    """

    name: str
    task_kwargs: dict[str, Any]
    data_kwargs: dict[str, Any]
    rank_kwargs: dict[str, Any]
    steps: int
    budget_s: float
    val_every: int
    limit_val_batches: int | None
    metric: str
    secondary: str
    higher_is_better: bool = True
    late_fraction: float = 0.5
    seed: int = 0
    accelerator: str = "cpu"
    precision: str = "32-true"
    datamodule: str | None = None
    grad_clip: float | None = None

    def check(self) -> None:
        """Refuse settings that cannot give a meaningful run, naming the fix."""
        if self.name not in TASKS:
            raise ValueError(f"unknown study {self.name!r}; use one of {tuple(TASKS)}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not (math.isfinite(self.budget_s) and self.budget_s > 0):
            raise ValueError(f"budget_s must be a positive number of seconds, got {self.budget_s}")
        if self.val_every < 1:
            raise ValueError(f"val_every must be >= 1 (steps between validations), got {self.val_every}")
        if self.limit_val_batches is not None and self.limit_val_batches < 1:
            raise ValueError(f"limit_val_batches must be >= 1 or None, got {self.limit_val_batches}")
        if not 0.0 <= self.late_fraction <= 1.0:
            raise ValueError(f"late_fraction must be in [0, 1], got {self.late_fraction}")

    @property
    def late_start_step(self) -> int:
        """The step the late stage starts at under the step-bounded protocols."""
        return round(self.late_fraction * self.steps)

    def json(self) -> dict[str, Any]:
        """The spec as JSON values (rank options that are objects, such as a late-stage policy, left out)."""
        plain = (int, float, str, bool, type(None))
        out = asdict(replace(self, rank_kwargs={}))
        out["rank_kwargs"] = {k: v for k, v in self.rank_kwargs.items() if isinstance(v, plain)}
        return json.loads(json.dumps(out))  # tuples as lists: as it reads back from a file


# ------------------------------------------------------------------------------------------------------
# models and data


def with_layer_options(task_kwargs: dict[str, Any], **options: Any) -> dict[str, Any]:
    """``task_kwargs`` with some ``layer_config`` options set (a copy; the spec keeps its own)."""
    return {**task_kwargs, "layer_config": {**(task_kwargs.get("layer_config") or {}), **options}}


def at_width(task_kwargs: dict[str, Any], d_model: int) -> dict[str, Any]:
    """The transformer of ``task_kwargs`` at width ``d_model``: the head width and the FFN's ratio kept."""
    head_dim = task_kwargs["d_model"] // task_kwargs["num_heads"]
    return {
        **task_kwargs,
        "d_model": d_model,
        "num_heads": max(1, d_model // head_dim),
        "d_ff": max(1, round(task_kwargs["d_ff"] * d_model / task_kwargs["d_model"])),
    }


def task_class(name: str) -> type:
    """The LightningModule class of study ``name``."""
    import comera_lightning.lit as lit

    return getattr(lit, TASKS[name][0])


def build_task(spec: StudySpec, method: str, task_kwargs: dict[str, Any] | None = None):
    """The LightningModule of ``method``, seeded: identical except TT (comera*) or plain (dense) layers."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {METHODS}")
    tt = method.startswith("comera")
    torch.manual_seed(spec.seed)
    return task_class(spec.name)(**with_layer_options(task_kwargs or spec.task_kwargs, tt_linears=tt, tt_embeddings=tt))


def build_datamodule(spec: StudySpec, cache_dir: Path = DEFAULT_CACHE):
    """The study's datamodule, prepared and set up once (every run then reads the very same tensors)."""
    import comera_lightning.data as data

    cls = getattr(data, spec.datamodule or TASKS[spec.name][1])
    if spec.name == "dlrm":  # synthetic rows: nothing to tokenise or cache
        dm = cls(**spec.data_kwargs, seed=spec.seed)
    else:
        dm = cls(**spec.data_kwargs, cache_dir=str(cache_dir), seed=spec.seed)
        dm.prepare_data()
    dm.setup("fit")
    return dm


def size(pl_module) -> dict[str, Any]:
    """``size_report``'s counts of ``pl_module``, plus every trainable element (the rank gates included)."""
    report = size_report(pl_module)
    return {
        "compression_ratio": report.compression_ratio,
        "params_active": report.active_parameters,
        "params_allocated": report.allocated_parameters,
        "params_dense_equivalent": report.dense_equivalent_parameters,
        "params_trainable": sum(p.numel() for p in pl_module.parameters() if p.requires_grad),
    }


def ranks(pl_module) -> dict[str, list[int]]:
    """Active ranks of every TT layer."""
    return {name: [int(r) for r in layer.active_ranks] for name, layer in tt_layers(pl_module)}


def batch_hash(batch: dict[str, Any]) -> str:
    """A short hash of a batch's tensors: equal across methods when they saw the same data in the same order."""
    h = hashlib.sha1()
    for key in sorted(batch):
        if torch.is_tensor(batch[key]):
            h.update(key.encode() + batch[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------------
# one training run


class StudyRecorder(Callback):
    """Training clock (validation excluded), step intervals, validation curve, budget stop, contention."""

    def __init__(self, budget_s: float | None) -> None:
        self.budget_s = budget_s
        self.step_s: list[float] = []
        self.validations: list[dict[str, Any]] = []
        self.first_batch_hash: str | None = None
        self.train_s_final: float | None = None
        self.stopped_by_budget = False
        self.other_load: float | None = None
        self.own_cpu_share: float | None = None
        self._t0: float | None = None
        self._val_total = self._val_since_start = self._val_t0 = 0.0
        self._last_start: float | None = None
        self._probe = self._interval_probe = None

    def train_seconds(self) -> float:
        """Training wall-clock so far, validation passes left out."""
        if self._t0 is None:
            return 0.0
        if self.train_s_final is not None:
            return self.train_s_final
        return time.perf_counter() - self._t0 - self._val_total

    def on_train_start(self, trainer, pl_module) -> None:
        self._probe, self._interval_probe = harness.ContentionProbe(), harness.ContentionProbe()
        self._t0 = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self.first_batch_hash is None:
            self.first_batch_hash = batch_hash(batch)
        if self._last_start is not None:
            self.step_s.append(now - self._last_start - self._val_since_start)
        self._last_start, self._val_since_start = now, 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.budget_s is not None and self.train_seconds() >= self.budget_s:
            trainer.should_stop = self.stopped_by_budget = True

    def on_train_end(self, trainer, pl_module) -> None:
        now = time.perf_counter()
        if self._last_start is not None:
            self.step_s.append(now - self._last_start - self._val_since_start)
        self.train_s_final = now - self._t0 - self._val_total
        self.other_load, self.own_cpu_share = self._probe.read()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        metrics = {
            k: float(v.detach().float()) if torch.is_tensor(v) else float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith("val/")
        }
        record: dict[str, Any] = {"step": int(trainer.global_step), "metrics": metrics, **size(pl_module)}
        for cb in trainer.callbacks:
            if hasattr(cb, "comera_metrics"):
                record["stage"] = cb.comera_metrics().get("comera/stage")
                record["truncations"] = cb.comera_metrics().get("comera/truncations")
        if self._interval_probe is not None:
            record["other_load"] = self._interval_probe.read()[0]
            self._interval_probe = harness.ContentionProbe()
        # everything since on_validation_start, this bookkeeping included, stays off the training clock
        dt = time.perf_counter() - self._val_t0
        if trainer.state.fn == "fit":
            self._val_total += dt
            self._val_since_start += dt
        record.update(train_s=self.train_seconds(), val_s=dt)
        self.validations.append(record)


class TimedRankAdaptation(RankAdaptation):
    """RankAdaptation whose late stage starts at ``late_start_s`` seconds of ``clock`` (the time protocol)."""

    def __init__(self, clock: Callable[[], float], late_start_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._clock, self._late_start_s = clock, late_start_s

    def should_enter_late_stage(self, trainer) -> bool:
        """Once the training clock reaches the switch."""
        return self._clock() >= self._late_start_s

    def needs_loss(self) -> bool:
        """Always: the loss target at the switch is the smoothed loss, as with a late_start_step."""
        return True


def rank_adaptation(spec: StudySpec, method: str, protocol: str, clock: Callable[[], float]) -> RankAdaptation:
    """The rank callback of a CoMERA ``method``: its late-stage policy, switching at ``late_fraction`` of the
    run's steps, or of its seconds under the time protocol."""
    kwargs = dict(spec.rank_kwargs)
    if method == "comera-paper":
        kwargs["late_stage"] = "paper"
    elif method == "comera-norm":
        kwargs["late_stage"] = ScheduledLateStage(importance="norm")
    if protocol == "time":
        return TimedRankAdaptation(clock, spec.late_fraction * spec.budget_s, **kwargs)
    return RankAdaptation(**kwargs, late_start_step=spec.late_start_step)


def run_one(
    spec: StudySpec,
    method: str,
    protocol: str,
    dm,
    *,
    task: Any = None,
    steps: int | None = None,
    max_other_load: float = 0.15,
    wait_quiet_s: float = 0.0,
    extra_callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Train one (method, protocol) run and return its measurements.

    ``task`` trains that LightningModule instead of :func:`build_task`'s (GaLore, the Pareto baselines); a
    ``method`` starting with ``comera`` adds the rank callbacks. ``steps`` overrides ``spec.steps`` for a
    step-bounded run (the matched protocol's CoMERA run). ``extra_callbacks`` run after the study's own.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; use one of {PROTOCOLS}")
    spec.check()
    spec = spec if steps is None else replace(spec, steps=steps)
    seed_everything(spec.seed, verbose=False)
    task = build_task(spec, method) if task is None else task
    at_start = size(task)
    budget = spec.budget_s if protocol == "time" else None
    recorder = StudyRecorder(budget)
    rank_cb = rank_adaptation(spec, method, protocol, recorder.train_seconds) if method.startswith("comera") else None
    callbacks = [recorder] + ([rank_cb, ContractionPlanner(verbose=False)] if rank_cb else []) + list(extra_callbacks)
    quiet = harness.wait_until_quiet(max_other_load, time.perf_counter() + wait_quiet_s) if wait_quiet_s > 0 else None
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="comera-study-") as root, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*`max_epochs` was not set.*")
        trainer = Trainer(
            accelerator=spec.accelerator,
            precision=spec.precision,
            devices=1,
            max_steps=1_000_000 if protocol == "time" else spec.steps,
            max_epochs=-1,
            val_check_interval=spec.val_every,
            check_val_every_n_epoch=None,
            limit_val_batches=spec.limit_val_batches,
            num_sanity_val_steps=0,
            logger=False,
            gradient_clip_val=spec.grad_clip,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=callbacks,
        )
        wall0 = time.perf_counter()
        trainer.fit(task, datamodule=dm)
        fit_wall_s = time.perf_counter() - wall0
        if not recorder.validations or recorder.validations[-1]["step"] != trainer.global_step:
            trainer.validate(task, datamodule=dm, verbose=False)
    if not recorder.validations:
        raise ValueError(
            f"{spec.name} / {method}: no validation batch ran, so the run has no metric: the "
            f"datamodule's validation set is empty ({len(dm.val_dataset)} rows); give it more data or a "
            "larger validation share (e.g. data.val_fraction, data.val_files)"
        )
    steps_s = recorder.step_s
    # the first step pays one-off costs (planning, first allocations): medians leave it out where possible
    steady = steps_s[1:] if len(steps_s) > 2 else steps_s
    result: dict[str, Any] = {
        "method": method,
        "protocol": protocol,
        "steps": int(trainer.global_step),
        "budget_s": budget,
        "train_s": recorder.train_s_final,
        "fit_wall_s": fit_wall_s,
        "stopped_by_budget": recorder.stopped_by_budget,
        "median_step_s": statistics.median(steady) if steady else None,
        "mean_step_s": statistics.fmean(steady) if steady else None,
        "first_step_s": steps_s[0] if steps_s else None,
        # after the late stage and its truncations: what the shrunken model's steps cost
        "median_step_s_last_quarter": statistics.median(steps_s[-max(1, len(steps_s) // 4) :]) if steps_s else None,
        "step_s": steps_s,
        "final": recorder.validations[-1],
        "size_at_start": at_start,
        "size_final": size(task),
        "ranks_final": ranks(task),
        "validations": recorder.validations,
        "first_batch_hash": recorder.first_batch_hash,
        "other_load": recorder.other_load,
        "own_cpu_share": recorder.own_cpu_share,
        "contended": recorder.other_load is not None and recorder.other_load > max_other_load,
        "waited_quiet": quiet,
    }
    if rank_cb is not None:
        result["rank_adaptation"] = {**rank_cb.state_dict(), "metrics": rank_cb.comera_metrics()}
    return result


def pending_runs(
    runs: list[dict[str, Any]],
    protocols: Sequence[str],
    methods: Sequence[str],
    where: Path | None,
    log: Callable[[str], None],
    prefix: str,
) -> Iterator[tuple[str, str]]:
    """The (protocol, method) pairs of a study not yet in ``runs``, in order; logs those a resumed study skips."""
    for protocol in protocols:
        for method in methods:
            if any((r["method"], r["protocol"]) == (method, protocol) for r in runs):
                log(f"{prefix} {method} / {protocol}: already in {where}, skipped")
                continue
            yield protocol, method


def run_log_line(run: dict[str, Any], metric: str) -> str:
    """One line of progress after a run."""
    value = run["final"]["metrics"].get(metric, float("nan"))
    return (
        f"    {run['steps']} steps, {run['train_s']:.1f} s training, median step "
        f"{harness.ms(run['median_step_s']) if run['median_step_s'] else '-'} ms, {metric} {value:.4f}, "
        f"compression {run['final']['compression_ratio']:.2f}x"
        + (f", CONTENDED ({run['other_load']:.0%} other load)" if run["contended"] else "")
    )


# ------------------------------------------------------------------------------------------------------
# a study's JSON, and what several seeds say


class Progress:
    """A study's JSON, rewritten atomically after every run; a rerun of the same spec resumes from it.

    A file at ``path`` that holds another spec is refused (ValueError) rather than mixed with this one's runs;
    ``path`` None keeps the state in memory only.
    """

    def __init__(self, path: Path | None, spec: dict[str, Any]) -> None:
        self.path = path
        self.state: dict[str, Any] = harness.read_json(path) if path is not None and path.exists() else {}
        if self.state and self.state.get("spec") != spec:
            raise ValueError(f"{path} holds runs of another spec: delete it, or write elsewhere (--out-dir, --tag)")
        self.state["spec"] = spec

    def save(self, **fields: Any) -> dict[str, Any]:
        """Update the state with ``fields`` and write it; returns the state."""
        self.state.update(fields)
        if self.path is not None:
            harness.write_json(self.path, self.state)
        return self.state


def spread(values: Sequence[float | None]) -> dict[str, float] | None:
    """Mean, min, max and count of the values that are not None (None when there are none)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def spread_cell(stats: dict[str, float] | None, scale: float = 1.0, fmt: str = "{:.2f}", signed: bool = False) -> str:
    """``mean (min .. max)`` of a :func:`spread`, scaled; '-' for None."""
    if stats is None:
        return "-"
    mean = ("{:+" + fmt[2:]) if signed else fmt
    return (
        f"{mean.format(stats['mean'] * scale)} ({fmt.format(stats['min'] * scale)} .. "
        f"{fmt.format(stats['max'] * scale)})"
    )


def late_dip(validations: list[dict], metric: str, switch_step: int, higher_is_better: bool = True) -> float | None:
    """How far the metric fell, at worst, after the late-stage switch below its last value at or before it
    (>= 0; perplexity relative, as a share; accuracy-like metrics absolute). None without a validation on
    both sides of the switch."""
    before = [v["metrics"].get(metric) for v in validations if v["step"] <= switch_step]
    after = [v["metrics"].get(metric) for v in validations if v["step"] > switch_step]
    after = [v for v in after if v is not None]
    if not before or before[-1] is None or not after:
        return None
    if higher_is_better:
        return max(0.0, before[-1] - min(after))
    return max(0.0, max(after) / before[-1] - 1.0)


# ------------------------------------------------------------------------------------------------------
# reporting


def metric_cell(key: str, digits: int = 4) -> Callable[[dict], str]:
    """A :func:`runs_table` column: a final validation metric of the run."""
    return lambda r: f"{r['final']['metrics'].get(key, float('nan')):.{digits}f}"


RUN_COLUMNS: dict[str, Callable[[dict], object]] = {
    "method": lambda r: r["method"],
    "protocol": lambda r: r["protocol"] + (f" ({r['budget_s']:g} s)" if r["budget_s"] else ""),
    "steps": lambda r: r["steps"],
    "tokens": lambda r: f"{r['tokens']:,}",
    "train s": lambda r: f"{r['train_s']:.1f}",
    "median step ms": lambda r: harness.ms(r["median_step_s"]) if r["median_step_s"] else "-",
    "compression": lambda r: f"{r['final']['compression_ratio']:.2f}x",
    "active params": lambda r: f"{r['final']['params_active']:,}",
    "dense-equiv params": lambda r: f"{r['final']['params_dense_equivalent']:,}",
    "trainable params": lambda r: f"{r['final']['params_trainable']:,}",
    "other load": lambda r: (
        (f"{r['other_load']:.0%}" if r["other_load"] is not None else "n/a") + (" !" if r["contended"] else "")
    ),
}


def runs_table(runs: list[dict], columns: Sequence[str | tuple[str, Callable[[dict], object]]]) -> str:
    """One row per run: named :data:`RUN_COLUMNS`, or ``(header, cell function)`` pairs."""
    cols = [(c, RUN_COLUMNS[c]) if isinstance(c, str) else c for c in columns]
    return harness.table([h for h, _ in cols], [[f(r) for _, f in cols] for r in runs])


def plot_curves(
    runs: list[dict], metric: str, *, compression: bool = True, log_metric: bool = False, title: str | None = None
):
    """Validation ``metric`` of every run against optimiser steps and against training seconds (and the
    compression ratio against steps): a colour per method, a line style per protocol. Returns the figure."""
    fig, axes = harness.new_figure(3 if compression else 2, width=5.0 if compression else 5.5, height=3.8)
    for r in runs:
        v = r["validations"]
        values = [p["metrics"].get(metric, float("nan")) for p in v]
        kw = dict(
            color=COLOURS.get(r["method"], "gray"),
            linestyle=STYLES[r["protocol"]],
            label=f"{r['method']} / {r['protocol']}",
            marker="o" if r["protocol"] == "steps" else "x",
            markersize=3 if r["protocol"] == "steps" else 5,
        )
        axes[0].plot([p["step"] for p in v], values, **kw)
        axes[1].plot([p["train_s"] for p in v], values, **kw)
        if compression:
            axes[2].plot([p["step"] for p in v], [p["compression_ratio"] for p in v], **kw)
    harness.label_axes(axes[0], "optimiser steps", metric, ylog=log_metric)
    harness.label_axes(axes[1], "training wall-clock seconds (validation excluded)", metric, ylog=log_metric)
    if compression:
        harness.label_axes(axes[2], "optimiser steps", "compression ratio (dense-equivalent / active)", ylog=True)
    if title:
        fig.suptitle(title)
    return fig


# ------------------------------------------------------------------------------------------------------
# command line


def study_parser(
    doc: str, *, repeats: tuple[int, int] = (3, 5), out_dir: Path = harness.RESULTS_DIR, budget: bool = True
) -> argparse.ArgumentParser:
    """``harness.bench_parser`` with the options of every study (``--seed``, ``--steps``, ``--cache-dir``;
    ``budget``: ``--budget-s``, ``--val-every`` and ``--tag`` too); ``--repeats`` counts the interleaved
    rounds of the step timings."""
    p = harness.bench_parser(doc, repeats=repeats, out_dir=out_dir)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="optimiser steps per run (default: the study's)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="tokenizer / encoded corpus cache")
    if budget:
        p.add_argument("--budget-s", type=float, default=None, help="training seconds of the same-time protocol")
        p.add_argument("--val-every", type=int, default=None, help="validate every this many steps")
        p.add_argument("--tag", default="", help="suffix of the output files (e.g. the seed)")
    return p


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``harness.parse`` plus the study options' checks; keeps Lightning's banners out of the report."""
    args = harness.parse(parser, argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    budget_s = getattr(args, "budget_s", None)
    if budget_s is not None and not (math.isfinite(budget_s) and budget_s > 0):
        parser.error(f"--budget-s must be a positive number of seconds, got {budget_s}")
    if getattr(args, "val_every", None) is not None and args.val_every < 1:
        parser.error(f"--val-every must be >= 1, got {args.val_every}")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "comera_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
    return args
