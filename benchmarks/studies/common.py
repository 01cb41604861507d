"""What the training studies share: the spec of a study, its models and data, and one training run.

Every run trains one model from the study's seed on the study's datamodule, prepared once, so every method sees
the same batches in the same order (samplers and MLM masks depend on the data seed only), for ``spec.steps``
optimiser steps. The training clock (:class:`StudyRecorder`) counts everything a training step costs and leaves the
validation passes out; ``/proc/stat`` gives the CPU other processes took during each run. The studies' tasks come
from :func:`study_spec`: the decoder of ``configs/llm_cpu.yaml`` (:func:`lm_spec`) or the quickstart's masked LM
(:func:`mlm_spec`), on a corpus of Python sources. :func:`run_pool` runs a study's jobs on worker processes, asking its
plan again after each one; :func:`worker_datamodule` keeps a worker's data for its next run.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import json
import statistics
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback, Trainer, seed_everything

from benchmarks import harness
from comera_lightning.callbacks import ContractionPlanner, RankAdaptation
from comera_lightning.nn import size_report, tt_layers

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = REPO / ".cache" / "comera"
CONFIG = REPO / "configs" / "llm_cpu.yaml"
# study name -> (LightningModule in comera_lightning.lit, datamodule in comera_lightning.data)
TASKS = {"mlm": ("MaskedLM", "CodeMLMDataModule"), "lm": ("CausalLM", "CodeLMDataModule")}
# --set SECTION.KEY=VALUE: which part of the study a config section's values go to
SECTIONS = {"model": "task_kwargs", "data": "data_kwargs", "rank": "rank_kwargs"}


@dataclass
class StudySpec:
    """One study: the task, its data, the CoMERA schedule and the run lengths.

    ``task_kwargs`` go to the task's LightningModule (each method sets ``tt_linears``/``tt_embeddings``),
    ``data_kwargs`` to its datamodule, ``rank_kwargs`` to ``RankAdaptation`` (the late stage starts at
    ``late_fraction`` of the run). Every run trains on the CPU in float32. ``grad_clip`` clips the gradients'
    global norm (the Trainer's ``gradient_clip_val``; None: no clipping).
    """

    name: str
    task_kwargs: dict[str, Any]
    data_kwargs: dict[str, Any]
    rank_kwargs: dict[str, Any]
    steps: int
    val_every: int
    limit_val_batches: int | None
    late_fraction: float = 0.5
    seed: int = 0
    grad_clip: float | None = None

    def check(self) -> None:
        """Refuse settings that cannot give a meaningful run, naming the fix."""
        if self.name not in TASKS:
            raise ValueError(f"unknown study {self.name!r}; use one of {tuple(TASKS)}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
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


def build_datamodule(spec: StudySpec, cache_dir: Path = DEFAULT_CACHE):
    """The study's datamodule, prepared and set up once (every run then reads the very same tensors)."""
    import comera_lightning.data as data

    cls = getattr(data, TASKS[spec.name][1])
    dm = cls(**spec.data_kwargs, cache_dir=str(cache_dir), seed=spec.seed)
    dm.prepare_data()
    dm.setup("fit")
    return dm


_DATAMODULES: dict[str, Any] = {}


def worker_datamodule(spec: StudySpec, cache_dir: Path = DEFAULT_CACHE):
    """:func:`build_datamodule` of ``spec``, kept for a worker process's next run on the same data (one at a time)."""
    data = [spec.name, spec.seed, spec.data_kwargs, str(cache_dir)]
    key = json.dumps(data, sort_keys=True, default=str)
    if key not in _DATAMODULES:
        _DATAMODULES.clear()
        _DATAMODULES[key] = build_datamodule(spec, cache_dir)
    return _DATAMODULES[key]


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
# the studies' tasks


def _quick(spec: StudySpec, task: dict, data: dict, rank: dict, tt_rank: int = 8) -> StudySpec:
    """``spec`` shrunk for a smoke run: 30 steps, validation every 10 steps on 4 batches."""
    layer = spec.task_kwargs["layer_config"]
    spec.task_kwargs.update(task, layer_config={**layer, "rank": tt_rank, "embedding_rank": tt_rank})
    if "optim" in spec.task_kwargs and "warmup_steps" in spec.task_kwargs["optim"]:
        spec.task_kwargs["optim"] = {**spec.task_kwargs["optim"], "warmup_steps": 5}
    spec.data_kwargs.update(data)
    spec.rank_kwargs.update(rank)
    spec.steps, spec.val_every, spec.limit_val_batches = 30, 10, 4
    return spec


def mlm_spec(quick: bool = False) -> StudySpec:
    """The masked-LM study: the quickstart model and schedule (``--quick``: a smaller model and corpus)."""
    task = dict(
        vocab_size=2048,
        d_model=128,
        num_heads=4,
        d_ff=512,
        num_layers=2,
        max_len=64,
        dropout=0.0,
        layer_config=dict(rank=32, embedding_rank=32, min_features=64),
        optim=dict(lr_cores=2e-3, lr_gates=5e-3, lr_other=2e-3, warmup_steps=100),
    )
    data = dict(vocab_size=2048, seq_len=64, batch_size=32, max_files=400, max_sequences=20000)
    # quickstart.yaml's run: 2000 steps, late stage from step 800 towards 20x (gamma 0.005, truncation every 50
    # steps at 20% dead slices). A switch at 0.6 of the run ended 0.33 points lower and dipped 2 points, at 0.25
    # 0.45 points lower (seed 0, docs/results.md)
    rank = dict(gamma=0.005, target_compression=20.0, truncate_every_n_steps=50, min_dead_fraction=0.2)
    spec = StudySpec(
        "mlm",
        task,
        data,
        rank,
        steps=2000,
        val_every=200,
        limit_val_batches=16,
        late_fraction=0.4,
    )
    if quick:
        _quick(
            spec,
            dict(vocab_size=512, d_model=64, d_ff=128, max_len=32),
            dict(vocab_size=512, seq_len=32, batch_size=16, max_files=40, max_sequences=2000),
            dict(truncate_every_n_steps=5),
        )
    return spec


def corpus_root(corpus: str) -> str | None:
    """``stdlib`` (None: the data modules' default), ``site:PACKAGE`` (an installed package's sources) or a path."""
    if corpus == "stdlib":
        return None
    if corpus.startswith("site:"):
        root = Path(sysconfig.get_paths()["purelib"]) / corpus[5:]
        if not root.is_dir():
            raise ValueError(f"corpus {corpus!r}: no installed package folder {root}; pip install it or give a path")
        return str(root)
    if not Path(corpus).expanduser().is_dir():
        raise ValueError(f"corpus {corpus!r} is not a folder; use stdlib, site:PACKAGE or a folder of .py files")
    return corpus


def study_spec(
    task: str, corpus: str, seed: int, steps: int | None, quick: bool, d_model: int | None = None
) -> StudySpec:
    """The task's quality-study spec on ``corpus``, with ``steps`` (the late stage keeps its share of the run) and
    the full-width model at ``d_model`` (the head width and the FFN's ratio to d_model kept)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; use one of {tuple(TASKS)}")
    spec = lm_spec(quick) if task == "lm" else mlm_spec(quick)
    spec = replace(spec, seed=seed, steps=spec.steps if steps is None else steps)
    if d_model is not None:
        if d_model < 1:
            raise ValueError(f"d_model must be >= 1, got {d_model}")
        spec.task_kwargs = at_width(spec.task_kwargs, d_model)
    spec.data_kwargs = {**spec.data_kwargs, "root": corpus_root(corpus)}
    spec.check()
    return spec


def lm_spec(quick: bool = False) -> StudySpec:
    """The decoder study: ``configs/llm_cpu.yaml``'s model, data and RankAdaptation settings (``quick``: a tiny
    version)."""
    config = yaml.safe_load(CONFIG.read_text())
    task = {k: v for k, v in config["model"]["init_args"].items() if not k.startswith("generate_")}
    rank = next(c["init_args"] for c in config["trainer"]["callbacks"] if c["class_path"].endswith("RankAdaptation"))
    trainer = config["trainer"]
    steps = int(trainer["max_steps"])
    # the study places the switch (spec.late_fraction); a config gives it as a share or as a step
    late_step = rank.pop("late_start_step", None)
    late_fraction = rank.pop("late_start_fraction", None)
    if late_fraction is None:
        late_fraction = (int(0.4 * steps) if late_step is None else late_step) / steps
    if isinstance(rank.get("late_stage"), dict):  # a policy object in the config: build it as the CLI would
        module, _, name = rank["late_stage"]["class_path"].rpartition(".")
        rank["late_stage"] = getattr(importlib.import_module(module), name)(**rank["late_stage"].get("init_args", {}))
    spec = StudySpec(
        "lm",
        task,
        dict(config["data"]["init_args"]),
        rank,
        steps=steps,
        val_every=int(trainer["val_check_interval"]),
        limit_val_batches=trainer.get("limit_val_batches"),
        late_fraction=late_fraction,
    )
    if quick:
        layer = {**spec.task_kwargs.get("layer_config", {}), "rank": 8, "embedding_rank": 8, "min_features": 16}
        if "layer_ranks" in layer:
            layer["layer_ranks"] = {name: 8 for name in layer["layer_ranks"]}
        spec.task_kwargs.update(
            vocab_size=512,
            d_model=32,
            num_heads=2,
            d_ff=64,
            num_layers=1,
            max_len=32,
            layer_config=layer,
            optim={**spec.task_kwargs.get("optim", {}), "warmup_steps": 2},
        )
        spec.data_kwargs.update(vocab_size=512, seq_len=32, batch_size=8, max_files=30, max_sequences=400)
        spec.rank_kwargs.update(truncate_every_n_steps=3, target_compression=None, target_size_ratio=0.5)
        spec.steps, spec.val_every, spec.limit_val_batches = 6, 3, 2
    return spec


def apply_overrides(spec: StudySpec, assignments: list[str]) -> None:
    """Set ``SECTION.KEY[.KEY...]=VALUE`` items (values read as YAML) in the spec's model, data or rank settings."""
    for item in assignments:
        path, sep, text = item.partition("=")
        section, *keys = path.split(".")
        if not sep or section not in SECTIONS or not keys:
            raise ValueError(
                f"--set takes SECTION.KEY=VALUE with SECTION one of {tuple(SECTIONS)} "
                f"(e.g. data.root=stdlib), got {item!r}"
            )
        target = getattr(spec, SECTIONS[section])
        for key in keys[:-1]:
            target[key] = dict(target.get(key) or {})
            target = target[key]
        target[keys[-1]] = yaml.safe_load(text)


# ------------------------------------------------------------------------------------------------------
# one training run


class StudyRecorder(Callback):
    """Training clock (validation excluded), step intervals, validation curve, contention."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.validations: list[dict[str, Any]] = []
        self.first_batch_hash: str | None = None
        self.train_s_final: float | None = None
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


def run_one(
    spec: StudySpec,
    method: str,
    dm,
    *,
    task: Any,
    steps: int | None = None,
    max_other_load: float = 0.15,
    wait_quiet_s: float = 0.0,
    extra_callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Train ``task`` (a LightningModule) for one run and return its measurements.

    The ``comera`` method adds the rank callbacks, its late stage from ``spec.late_start_step``. ``steps`` overrides
    ``spec.steps``. ``extra_callbacks`` run after the study's own.
    """
    spec.check()
    spec = spec if steps is None else replace(spec, steps=steps)
    seed_everything(spec.seed, verbose=False)
    at_start = size(task)
    recorder = StudyRecorder()
    rank_cb = RankAdaptation(**spec.rank_kwargs, late_start_step=spec.late_start_step) if method == "comera" else None
    callbacks = [recorder] + ([rank_cb, ContractionPlanner(verbose=False)] if rank_cb else []) + list(extra_callbacks)
    quiet = harness.wait_until_quiet(max_other_load, time.perf_counter() + wait_quiet_s) if wait_quiet_s > 0 else None
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="comera-study-") as root, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*`max_epochs` was not set.*")
        trainer = Trainer(
            accelerator="cpu",
            precision="32-true",
            devices=1,
            max_steps=spec.steps,
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
        "steps": int(trainer.global_step),
        "train_s": recorder.train_s_final,
        "fit_wall_s": fit_wall_s,
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


def _set_threads(threads: int) -> None:
    torch.set_num_threads(threads)


def run_pool(
    pending: Callable[[], Sequence[Any]],
    submit: Callable[[ProcessPoolExecutor, Any], Future],
    finish: Callable[[Any, dict[str, Any] | BaseException, float], None],
    workers: int,
    threads: int,
    deadline: float | None,
) -> None:
    """Run a study's jobs on ``workers`` spawned processes of ``threads`` torch threads each until none is left.

    The plan is asked again after each finished run, so a run's result can add jobs (a sweep that must widen, the
    finals once the rates are known). A job is anything with a ``key``; one already running is not started twice.
    ``finish`` gets each job with its record, or with the exception that failed it (a failed run must not stop the
    others), and the run's wall seconds. No run starts after ``deadline`` (a ``time.time()``); running ones finish.
    """
    running: dict[Future, tuple[Any, float]] = {}
    context = get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_set_threads, initargs=(threads,)) as pool:
        while True:
            busy = {job.key for job, _ in running.values()}
            waiting = [job for job in pending() if job.key not in busy]
            out_of_time = deadline is not None and time.time() > deadline
            while waiting and len(running) < workers and not out_of_time:
                job = waiting.pop(0)
                running[submit(pool, job)] = (job, time.time())
            if not running:
                return
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                job, started = running.pop(future)
                try:
                    outcome: dict[str, Any] | BaseException = future.result()
                except Exception as err:
                    outcome = err
                finish(job, outcome, time.time() - started)
