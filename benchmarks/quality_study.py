"""Quality study at CPU scale: dense vs CoMERA training on real (MLM) and synthetic (CTR) data.

What is compared. Two tasks, each trained twice from the same seed on the same data in the same order
(the samplers and the MLM masks depend only on the data seed, so both methods see identical batches):

* ``mlm``: masked-LM on the Python standard library sources (``CodeMLMDataModule``), the quickstart-sized
  BERT encoder of ``configs/quickstart.yaml`` (d_model 128, 2 layers, vocabulary 2048, sequences of 64);
* ``dlrm``: click-through prediction (``ClickThrough``) on the synthetic Criteo stand-in of
  ``CriteoDataModule(synthetic=True)`` with the table sizes of ``configs/dlrm_criteo.yaml`` and smaller MLPs
  (its clicks come from a hidden logistic model of the dense features and per-id effects, so there is
  signal to learn; the JSON carries the constant-predictor log-loss as the floor to beat).

Methods: ``dense`` (every linear and embedding a plain ``nn`` layer, AdamW) and ``comera`` (TT linears and
TT embeddings, ``RankAdaptation`` + ``ContractionPlanner``; the architecture is otherwise the same). The
CoMERA rank schedule: the early stage (scalarised penalty ``gamma``) first, the late stage (towards a target
size) from ``late_fraction`` of the run on, with physical truncation on a step schedule, so the ranks
really shrink within the run.

Protocols: ``steps`` (both methods run the same number of optimiser steps), ``time`` (both get the same
training wall-clock budget; the late stage then starts at ``late_fraction`` of the budget) and ``matched``
(the same wall-clock, decided before training: dense and CoMERA training steps are first timed against
each other in this process, interleaved round by round (``harness.interleave``), and CoMERA then trains
``steps * dense_step / comera_step`` steps; on a shared machine this is robust where a live clock is not,
and conservative for CoMERA, whose steps get cheaper once its ranks shrink). The training
clock counts everything a training step costs (data loading, forward, backward, optimiser, callbacks,
truncations) and leaves out the validation passes, which both methods run every ``val_every`` steps on the
same held-out batches; a callback stops training once the clock reaches the budget.

Reported per run: validation metric curves (MLM accuracy and loss; AUC and log-loss), compression ratio
(``size_report``: dense-equivalent / active parameters) and parameter counts over the run, median and
mean training-step time, steps done, the CPU share other processes took during the run (``/proc/stat``,
``harness.ContentionProbe``; a run above ``--max-other-load`` is flagged contended, "!" in the table), and
a hash of the first training batch (equal across methods: same data order). Runs are strictly sequential.

Output: one markdown table per study on stdout (also ``quality_study.md``), ``quality_<study>.json`` with
every number and curve, ``quality_<study>.png`` (validation metric vs steps and vs training seconds, and
the compression ratio vs steps), in ``--out-dir`` (default ``benchmarks/results``).

    python benchmarks/quality_study.py                     # both studies, both protocols: about 12-14 minutes
    python benchmarks/quality_study.py --quick             # tiny models, 30 steps, 6 s budgets: about a minute
    python benchmarks/quality_study.py --study mlm --steps 600 --budget-s 60 --protocol steps
    python benchmarks/quality_study.py --threads 1 --wait-quiet 60   # on a shared machine

Default sizes, chosen to fit in about 15 minutes on 2 quiet cores (8 runs, strictly one after the other):

* MLM: 1200 steps (batch 32 x 64 tokens) and a 120 s budget per method, validation every 150 steps on
  16 held-out batches (about 4,900 masked tokens); CoMERA's late stage from step 600 / second 60, towards 10x;
* DLRM: 1000 steps (batch 1024, 1M synthetic rows: about one epoch) and a 75 s budget per method,
  validation every 100 steps on 20 held-out batches (20,480 rows); late stage from step 400 / second 30,
  towards 100x (the TT model starts at 61x).

The first MLM run on a machine also trains the BPE tokenizer (cached under ``.cache/comera``), the DLRM
study generates its rows (about 5 s). On a machine shared with other jobs, ``--threads 1`` avoids the
collapse of two torch threads spin-waiting for a core another process holds (10x slower steps seen), and
every run's ``other_load`` says how far its times can be trusted.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STUDIES = ("mlm", "pairs", "dlrm", "lm")
ALL_STUDIES = ("mlm", "pairs", "dlrm")  # what --study all runs (lm: llm_study.py has the decoder's own study)
METHODS = ("dense", "comera", "comera-paper", "comera-norm")
DEFAULT_METHODS = ("dense", "comera")
PROTOCOLS = ("steps", "time", "matched")
DEFAULT_PROTOCOLS = ("steps", "time")
DEFAULT_CACHE = REPO / ".cache" / "comera"

# the DLRM tables of configs/dlrm_criteo.yaml (Criteo Kaggle cardinalities capped at 100k rows)
DLRM_TABLES = [1460, 583, 100000, 100000, 305, 24, 12517, 633, 3, 93145, 5683, 100000, 3194, 27, 14992,
               100000, 10, 5652, 2173, 4, 100000, 18, 15, 100000, 105, 100000]


@dataclass
class StudySpec:
    """One study: the task, its data, the CoMERA schedule and the run lengths.

    ``task_kwargs`` go to the LightningModule (learning rates and architecture; the study adds
    ``tt_linears``/``tt_embeddings`` per method), ``data_kwargs`` to the datamodule, ``rank_kwargs`` to
    ``RankAdaptation`` (the late-stage start is derived from ``late_fraction`` of the run). ``metric`` is the
    headline validation metric (``higher_is_better`` tells its direction), ``secondary`` a second one.
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

    def check(self) -> None:
        """Refuse settings that cannot give a meaningful run, naming the fix."""
        if self.name not in STUDIES:
            raise ValueError(f"unknown study {self.name!r}; use one of {STUDIES}")
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


def with_layer_options(task_kwargs: dict[str, Any], **options: Any) -> dict[str, Any]:
    """``task_kwargs`` with some ``layer_config`` options set (a copy; the spec keeps its own)."""
    return {**task_kwargs, "layer_config": {**(task_kwargs.get("layer_config") or {}), **options}}


def mlm_spec(quick: bool = False) -> StudySpec:
    """The masked-LM study: the quickstart model and schedule (``--quick``: a smaller model and corpus)."""
    task = dict(vocab_size=2048, d_model=128, num_heads=4, d_ff=512, num_layers=2, max_len=64, dropout=0.0,
                layer_config=dict(rank=32, embedding_rank=32, min_features=64),
                optim=dict(lr_cores=2e-3, lr_gates=5e-3, lr_other=2e-3, warmup_steps=100))
    data = dict(vocab_size=2048, seq_len=64, batch_size=32, max_files=400, max_sequences=20000)
    # quickstart.yaml's run: 2000 steps, late stage from step 800 towards 20x (gamma 0.005, truncation every 50
    # steps at 20% dead slices). A switch at 0.6 of the run ended 0.33 points lower and dipped 2 points, at 0.25
    # 0.45 points lower (seed 0, docs/results.md)
    rank = dict(gamma=0.005, target_compression=20.0, truncate_every_n_steps=50, min_dead_fraction=0.2)
    spec = StudySpec("mlm", task, data, rank, steps=2000, budget_s=120.0, val_every=200, limit_val_batches=16,
                     metric="val/mlm_accuracy", secondary="val/loss", higher_is_better=True, late_fraction=0.4)
    if quick:
        spec.task_kwargs.update(vocab_size=512, d_model=64, d_ff=128, max_len=32)
        spec.task_kwargs["optim"].update(warmup_steps=5)
        spec.task_kwargs["layer_config"].update(rank=8, embedding_rank=8)
        spec.data_kwargs.update(vocab_size=512, seq_len=32, batch_size=16, max_files=40, max_sequences=2000)
        spec.rank_kwargs.update(truncate_every_n_steps=5)
        spec.steps, spec.budget_s, spec.val_every, spec.limit_val_batches = 30, 6.0, 10, 4
    return spec


def dlrm_spec(quick: bool = False) -> StudySpec:
    """The DLRM study: configs/dlrm_criteo.yaml's tables, CPU-sized MLPs, synthetic Criteo-like rows."""
    # lr_gates 5e-3 as in the quickstart: with the config's 1e-3 an Adam step moves a gate by at most ~1e-3, so no
    # slice can reach the 0.01 threshold before step ~1000 (in a 1200-step trial the first cut came at 1050)
    task = dict(table_sizes=list(DLRM_TABLES), embedding_dim=16, bottom_mlp=[128, 64, 16], top_mlp=[128, 64],
                layer_config=dict(rank=16, embedding_rank=16, min_embedding_rows=1000),
                optim=dict(lr_cores=1e-3, lr_gates=5e-3, lr_other=1e-3))
    # about one epoch in the same-steps protocol, as CTR models are trained: with several epochs over 200k rows
    # the dense tables memorised their rows (validation AUC 0.72 -> 0.69 from epoch 4 to 6 in a trial)
    data = dict(synthetic=True, num_samples=1_000_000, table_sizes=list(DLRM_TABLES), batch_size=1024,
                val_fraction=0.05)
    # dlrm_criteo.yaml's gamma 0.01; the late stage aims at the paper's DLRM compression (99x; the TT model starts
    # at 61x). A fifth of the size at the switch (the research code's 0.2) reached 314x within 100 steps in a
    # trial and cost 0.05 AUC
    rank = dict(gamma=0.01, target_compression=100.0, truncate_every_n_steps=25, min_dead_fraction=0.2)
    spec = StudySpec("dlrm", task, data, rank, steps=1000, budget_s=75.0, val_every=100, limit_val_batches=20,
                     metric="val/auc", secondary="val/logloss", higher_is_better=True, late_fraction=0.4)
    if quick:
        tables = [min(s, 5000) for s in DLRM_TABLES]
        spec.task_kwargs.update(table_sizes=tables, bottom_mlp=[64, 16], top_mlp=[64])
        spec.task_kwargs["layer_config"].update(rank=8, embedding_rank=8)
        spec.data_kwargs.update(table_sizes=tables, num_samples=20_000, batch_size=256)
        # with 5000-row tables even rank 1 everywhere stays below 100x: aim at half the size at the switch
        spec.rank_kwargs.update(truncate_every_n_steps=5, target_compression=None, target_size_ratio=0.5)
        spec.steps, spec.budget_s, spec.val_every, spec.limit_val_batches = 30, 6.0, 10, 4
    return spec


def pairs_spec(quick: bool = False) -> StudySpec:
    """The pair task: configs/code_pairs.yaml's classifier on docstring/body pairs of the standard library.

    Two encoder layers instead of the config's six, so that three seeds of every method fit the CPU budget.
    """
    task = dict(vocab_size=2048, num_classes=3, d_model=128, num_heads=4, d_ff=512, num_layers=2, max_len=128,
                dropout=0.1, layer_config=dict(rank=32, embedding_rank=32, min_features=64,
                                               dense_layers="position_embeddings|token_type_embeddings|classifier"),
                optim=dict(lr_cores=1e-3, lr_gates=5e-3, lr_other=1e-3, warmup_steps=100))
    data = dict(vocab_size=2048, seq_len=128, batch_size=32)
    rank = dict(gamma=0.005, target_compression=20.0, truncate_every_n_steps=50, min_dead_fraction=0.2)
    spec = StudySpec("pairs", task, data, rank, steps=2000, budget_s=240.0, val_every=200, limit_val_batches=20,
                     metric="val/accuracy", secondary="val/loss", higher_is_better=True, late_fraction=0.4)
    if quick:
        spec.task_kwargs.update(vocab_size=512, d_model=64, d_ff=128, num_layers=1, max_len=64)
        spec.task_kwargs["optim"].update(warmup_steps=5)
        spec.task_kwargs["layer_config"].update(rank=8, embedding_rank=8)
        spec.data_kwargs.update(vocab_size=512, seq_len=64, batch_size=16, max_files=40)
        spec.rank_kwargs.update(truncate_every_n_steps=5, target_compression=None, target_size_ratio=0.5)
        spec.steps, spec.budget_s, spec.val_every, spec.limit_val_batches = 30, 6.0, 10, 4
    return spec


def lm_spec(quick: bool = False) -> StudySpec:
    """The decoder of ``configs/llm_cpu.yaml`` as a study (read by ``llm_study.spec_from_config``)."""
    from llm_study import spec_from_config

    s = spec_from_config(quick=quick)
    return StudySpec("lm", s.task_kwargs, s.data_kwargs, s.rank_kwargs, steps=s.steps, budget_s=s.budget_s,
                     val_every=s.val_every, limit_val_batches=s.limit_val_batches, metric="val/perplexity",
                     secondary="val/loss", higher_is_better=False, late_fraction=s.late_fraction)


SPECS: dict[str, Callable[[bool], StudySpec]] = {"mlm": mlm_spec, "pairs": pairs_spec, "dlrm": dlrm_spec,
                                                 "lm": lm_spec}


# ------------------------------------------------------------------------------------------------------
# building blocks


def build_datamodule(spec: StudySpec, cache_dir: Path = DEFAULT_CACHE):
    """The study's datamodule, prepared and set up once (every run then reads the very same tensors)."""
    from comera_lightning.data import CodeLMDataModule, CodeMLMDataModule, CodePairsDataModule, CriteoDataModule

    if spec.name in ("mlm", "pairs", "lm"):
        cls = {"mlm": CodeMLMDataModule, "pairs": CodePairsDataModule, "lm": CodeLMDataModule}[spec.name]
        dm = cls(**spec.data_kwargs, cache_dir=str(cache_dir), seed=spec.seed)
        dm.prepare_data()
    else:
        dm = CriteoDataModule(**spec.data_kwargs, seed=spec.seed)
    dm.setup("fit")
    return dm


def build_task(spec: StudySpec, method: str):
    """The LightningModule for ``method``: identical except TT (comera) or plain (dense) layers."""
    from comera_lightning.lit import CausalLM, ClickThrough, MaskedLM, SequenceClassification

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {METHODS}")
    tt = method.startswith("comera")
    torch.manual_seed(spec.seed)
    cls = {"mlm": MaskedLM, "pairs": SequenceClassification, "dlrm": ClickThrough, "lm": CausalLM}[spec.name]
    return cls(**with_layer_options(spec.task_kwargs, tt_linears=tt, tt_embeddings=tt))


def baseline_metrics(spec: StudySpec, dm) -> dict[str, float]:
    """What a model without inputs scores on the same validation batches: the floor a run must beat.

    MLM: accuracy of always predicting the most frequent (non-special) training token. Pairs: accuracy of
    always predicting the most frequent training label. DLRM: log-loss of predicting the training click
    rate everywhere (AUC 0.5).
    """
    if spec.name == "lm":
        return {}  # llm_study.py reports the decoder's own references
    if spec.name == "pairs":
        train_labels = dm.train_dataset.tensors["labels"].long()
        mode = int(torch.bincount(train_labels).argmax())
        hits = total = 0
        for i, batch in enumerate(dm.val_dataloader()):
            if spec.limit_val_batches is not None and i >= spec.limit_val_batches:
                break
            hits += int((batch["labels"] == mode).sum())
            total += batch["labels"].numel()
        return {"majority_accuracy": hits / max(total, 1), "val_pairs": total}
    if spec.name == "mlm":
        special = torch.as_tensor(dm.special_ids.all())
        ids = dm.train_dataset.tensors["input_ids"].long().flatten()
        ids = ids[~torch.isin(ids, special)]
        mode = int(torch.bincount(ids).argmax())
        hits = total = 0
        for i, batch in enumerate(dm.val_dataloader()):
            if spec.limit_val_batches is not None and i >= spec.limit_val_batches:
                break
            labels = batch["labels"][batch["labels"] != -100]
            hits += int((labels == mode).sum())
            total += labels.numel()
        return {"unigram_accuracy": hits / max(total, 1), "val_masked_tokens": total}
    p = float(dm.train_dataset.tensors["labels"].float().mean())
    y = dm.val_dataset.tensors["labels"].float()
    if spec.limit_val_batches is not None:
        y = y[: spec.limit_val_batches * spec.data_kwargs["batch_size"]]
    logloss = float(-(y * math.log(p) + (1 - y) * math.log(1 - p)).mean())
    return {"train_click_rate": p, "constant_logloss": logloss, "val_rows": int(y.numel())}


def _batch_hash(batch: Any) -> str:
    h = hashlib.sha1()
    for key in sorted(batch):
        if torch.is_tensor(batch[key]):
            h.update(key.encode() + batch[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _scalar(value: Any) -> float:
    return float(value.detach().float()) if torch.is_tensor(value) else float(value)


def _size(pl_module) -> dict[str, Any]:
    from comera_lightning.nn import size_report

    report = size_report(pl_module)
    return {"compression_ratio": report.compression_ratio, "params_active": report.active_parameters,
            "params_allocated": report.allocated_parameters,
            "params_dense_equivalent": report.dense_equivalent_parameters,
            # every trainable element, CoMERA's rank gates included (size_report leaves them out)
            "params_trainable": sum(p.numel() for p in pl_module.parameters() if p.requires_grad)}


def _recorder_class():
    from lightning.pytorch import Callback

    class StudyRecorder(Callback):
        """Training clock (validation excluded), step intervals, validation curve, budget stop, contention."""

        def __init__(self, budget_s: float | None, max_other_load: float) -> None:
            self.budget_s = budget_s
            self.max_other_load = max_other_load
            self.step_s: list[float] = []
            self.validations: list[dict[str, Any]] = []
            self.first_batch_hash: str | None = None
            self.train_s_final: float | None = None
            self.stopped_by_budget = False
            self._t0: float | None = None
            self._val_total = 0.0
            self._val_since_start = 0.0
            self._last_start: float | None = None
            self._val_t0 = 0.0
            self._probe: harness.ContentionProbe | None = None
            self._interval_probe: harness.ContentionProbe | None = None
            self.other_load: float | None = None
            self.own_cpu_share: float | None = None

        def train_seconds(self) -> float:
            """Training wall-clock so far, validation passes left out."""
            if self._t0 is None:
                return 0.0
            if self.train_s_final is not None:
                return self.train_s_final
            return time.perf_counter() - self._t0 - self._val_total

        def on_train_start(self, trainer, pl_module) -> None:
            self._probe = harness.ContentionProbe()
            self._interval_probe = harness.ContentionProbe()
            self._t0 = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self.first_batch_hash is None:
                self.first_batch_hash = _batch_hash(batch)
            if self._last_start is not None:
                self.step_s.append(now - self._last_start - self._val_since_start)
            self._last_start, self._val_since_start = now, 0.0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.budget_s is not None and self.train_seconds() >= self.budget_s:
                trainer.should_stop = True
                self.stopped_by_budget = True

        def on_train_end(self, trainer, pl_module) -> None:
            now = time.perf_counter()
            if self._last_start is not None:
                self.step_s.append(now - self._last_start - self._val_since_start)
            self.train_s_final = now - self._t0 - self._val_total
            other, own = self._probe.read()
            self.other_load, self.own_cpu_share = other, own

        def on_validation_start(self, trainer, pl_module) -> None:
            self._val_t0 = time.perf_counter()

        def on_validation_end(self, trainer, pl_module) -> None:
            metrics = {k: _scalar(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            record: dict[str, Any] = {"step": int(trainer.global_step), "metrics": metrics, **_size(pl_module)}
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

    return StudyRecorder


def _timed_rank_adaptation(clock: Callable[[], float], late_start_s: float, **kwargs: Any):
    """RankAdaptation whose late stage starts at ``late_start_s`` seconds of training (budget protocol)."""
    from comera_lightning.callbacks import RankAdaptation

    class TimedRankAdaptation(RankAdaptation):
        def should_enter_late_stage(self, trainer) -> bool:
            return clock() >= late_start_s

        def needs_loss(self) -> bool:
            return True  # the loss target at the switch is the smoothed loss, as with a late_start_step

    return TimedRankAdaptation(**kwargs)


def measure_step_ratio(spec: StudySpec, dm, *, max_other_load: float = 0.15, wait_quiet_s: float = 0.0,
                       repeats: int = 5) -> dict[str, Any]:
    """Dense step time over CoMERA step time at the start of training, timed interleaved in this process.

    A step is what training repeats: forward and loss on one real training batch, backward, AdamW over the
    task's parameter groups (RankAdaptation's per-step work, under a millisecond, is left out).
    """
    batch = next(iter(dm.train_dataloader()))
    steps = {}
    for method in ("dense", "comera"):
        task = build_task(spec, method)
        optimizer = task.configure_optimizers()
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        optimizer = optimizer[0][0] if isinstance(optimizer, tuple) else optimizer

        def step(task=task, optimizer=optimizer) -> None:
            optimizer.zero_grad(set_to_none=True)
            task.training_step(batch, 0).backward()
            optimizer.step()

        steps[method] = step
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.trainer. reference is not registered.*")
        timing = harness.interleave(steps, repeats=repeats, min_sample_s=0.5, max_other_load=max_other_load,
                                    wait_quiet_s=wait_quiet_s, seed=spec.seed)
    return {"ratio_dense_over_comera": timing.ratio("dense", "comera"),
            "paired_ratios": timing.paired_ratios("dense", "comera"), **timing.summary()}


def run_one(spec: StudySpec, method: str, protocol: str, dm, *, max_other_load: float = 0.15,
            wait_quiet_s: float = 0.0, max_steps_cap: int = 1_000_000, steps: int | None = None,
            task: Any = None) -> dict[str, Any]:
    """Train one (method, protocol) run and return its measurements (see the module docstring).

    ``steps`` overrides ``spec.steps`` for a step-bounded run (the ``matched`` protocol's CoMERA run).
    ``task`` trains that LightningModule instead of :func:`build_task`'s (``pareto_study.py``'s baselines);
    a ``method`` starting with ``comera`` still adds the rank callbacks.
    """
    from lightning.pytorch import Trainer, seed_everything

    from comera_lightning.callbacks import ContractionPlanner, RankAdaptation

    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; use one of {PROTOCOLS}")
    spec.check()
    if steps is not None:
        spec = replace(spec, steps=steps)
    seed_everything(spec.seed, verbose=False)
    task = build_task(spec, method) if task is None else task
    at_start = _size(task)
    budget = spec.budget_s if protocol == "time" else None
    recorder = _recorder_class()(budget, max_other_load)
    callbacks: list[Any] = [recorder]
    rank_cb = None
    if method.startswith("comera"):
        rank_kwargs = dict(spec.rank_kwargs)
        if method == "comera-paper":
            rank_kwargs["late_stage"] = "paper"
        elif method == "comera-norm":
            from comera_lightning.callbacks import ScheduledLateStage

            rank_kwargs["late_stage"] = ScheduledLateStage(importance="norm")
        if protocol != "time":
            rank_cb = RankAdaptation(**rank_kwargs, late_start_step=int(round(spec.late_fraction * spec.steps)))
        else:
            rank_cb = _timed_rank_adaptation(recorder.train_seconds, spec.late_fraction * spec.budget_s,
                                             **rank_kwargs)
        callbacks += [rank_cb, ContractionPlanner(verbose=False)]
    quiet = None
    if wait_quiet_s > 0:
        quiet = harness.wait_until_quiet(max_other_load, time.perf_counter() + wait_quiet_s)
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="comera-quality-") as root, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*`max_epochs` was not set.*")
        trainer = Trainer(
            accelerator="cpu", devices=1, max_steps=max_steps_cap if protocol == "time" else spec.steps,
            max_epochs=-1, val_check_interval=spec.val_every, check_val_every_n_epoch=None,
            limit_val_batches=spec.limit_val_batches, num_sanity_val_steps=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root, callbacks=callbacks,
        )
        wall0 = time.perf_counter()
        trainer.fit(task, datamodule=dm)
        fit_wall_s = time.perf_counter() - wall0
        if not recorder.validations or recorder.validations[-1]["step"] != trainer.global_step:
            trainer.validate(task, datamodule=dm, verbose=False)
    final = recorder.validations[-1]
    steps_s = recorder.step_s
    # the first step pays one-off costs (planning, first allocations): medians leave it out where possible
    steady = steps_s[1:] if len(steps_s) > 2 else steps_s
    contended = recorder.other_load is not None and recorder.other_load > max_other_load
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
        "median_step_s_last_quarter": statistics.median(steps_s[-max(1, len(steps_s) // 4):]) if steps_s else None,
        "step_s": steps_s,
        "final": final,
        "size_at_start": at_start,
        "size_final": _size(task),
        "ranks_final": _ranks(task),
        "validations": recorder.validations,
        "first_batch_hash": recorder.first_batch_hash,
        "other_load": recorder.other_load,
        "own_cpu_share": recorder.own_cpu_share,
        "contended": contended,
        "waited_quiet": quiet,
    }
    if rank_cb is not None:
        result["rank_adaptation"] = {**rank_cb.state_dict(), "metrics": rank_cb.comera_metrics()}
    return result


def _ranks(pl_module) -> dict[str, list[int]]:
    from comera_lightning.nn import tt_layers

    return {name: [int(r) for r in layer.active_ranks] for name, layer in tt_layers(pl_module)}


# ------------------------------------------------------------------------------------------------------
# a whole study


def run_study(spec: StudySpec, *, cache_dir: Path = DEFAULT_CACHE, max_other_load: float = 0.15,
              wait_quiet_s: float = 0.0, protocols: tuple[str, ...] = PROTOCOLS,
              methods: tuple[str, ...] = DEFAULT_METHODS, log: Callable[[str], None] = print,
              partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """All (protocol, method) runs of ``spec``, strictly one after the other; returns the study's JSON.

    ``partial`` receives the study's JSON so far after every run (so a cut-off study loses nothing).
    """
    spec.check()
    for protocol in protocols:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}; use one of {PROTOCOLS}")
    t0 = time.perf_counter()
    dm = build_datamodule(spec, cache_dir)
    data_s = time.perf_counter() - t0
    runs = []
    step_ratio = None
    if "matched" in protocols:
        step_ratio = measure_step_ratio(spec, dm, max_other_load=max_other_load, wait_quiet_s=wait_quiet_s)
        log(f"[{spec.name}] dense step / CoMERA step = {step_ratio['ratio_dense_over_comera']:.3f} "
            f"({step_ratio['rounds_clean']}/{step_ratio['rounds_total']} clean rounds)")

    def snapshot() -> dict[str, Any]:
        return {
            "study": spec.name,
            "machine": harness.machine_info(),
            "spec": asdict(spec),
            "data": {"setup_s": data_s, "train_rows": len(dm.train_dataset), "val_rows": len(dm.val_dataset)},
            "baseline": baseline_metrics(spec, dm),
            "max_other_load": max_other_load,
            "step_ratio": step_ratio,
            "runs": runs,
            "summary": summarise(spec, runs),
            "late_start_step": int(round(spec.late_fraction * spec.steps)),
            "total_s": time.perf_counter() - t0,
        }

    for protocol in protocols:
        for method in methods:
            steps = None
            if protocol == "matched" and method != "dense":
                steps = max(1, round(spec.steps * step_ratio["ratio_dense_over_comera"]))
            what = {"steps": f"{spec.steps} steps", "time": f"{spec.budget_s:g} s budget",
                    "matched": f"{steps or spec.steps} steps, the same wall-clock"}[protocol]
            log(f"[{spec.name}] {method} / {protocol} ({what})")
            run = run_one(spec, method, protocol, dm, max_other_load=max_other_load, wait_quiet_s=wait_quiet_s,
                          steps=steps)
            value = run["final"]["metrics"].get(spec.metric, float("nan"))
            log(f"    {run['steps']} steps, {run['train_s']:.1f} s training, median step "
                f"{harness.ms(run['median_step_s'])} ms, {spec.metric} {value:.4f}, "
                f"compression {run['final']['compression_ratio']:.2f}x"
                + (f", CONTENDED ({run['other_load']:.0%} other load)" if run["contended"] else ""))
            runs.append(run)
            if partial is not None:
                partial(snapshot())
    return snapshot()


def summarise(spec: StudySpec, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios between the methods per protocol: metric difference, compression, step-time ratio."""
    out: dict[str, Any] = {}
    for protocol in PROTOCOLS:
        by = {r["method"]: r for r in runs if r["protocol"] == protocol}
        if "dense" not in by:
            continue
        for method in sorted(set(by) - {"dense"}):
            d, c = by["dense"], by[method]
            out[protocol if method == "comera" else f"{protocol} ({method})"] = {
                "metric_dense": d["final"]["metrics"].get(spec.metric),
                "metric_comera": c["final"]["metrics"].get(spec.metric),
                "metric_delta": _delta(c, d, spec.metric),
                "compression_comera": c["final"]["compression_ratio"],
                "step_time_ratio_dense_over_comera": (d["median_step_s"] / c["median_step_s"]
                                                      if d["median_step_s"] and c["median_step_s"] else None),
                "steps_dense": d["steps"],
                "steps_comera": c["steps"],
                "same_data_order": d["first_batch_hash"] == c["first_batch_hash"],
            }
    return out


def _delta(a: dict, b: dict, key: str) -> float | None:
    x, y = a["final"]["metrics"].get(key), b["final"]["metrics"].get(key)
    return None if x is None or y is None else x - y


# ------------------------------------------------------------------------------------------------------
# reporting


def markdown(result: dict[str, Any]) -> str:
    """The study's table: one row per method x protocol, then the CoMERA-vs-dense line per protocol."""
    spec = result["spec"]
    metric, second = spec["metric"], spec["secondary"]
    headers = ["method", "protocol", "steps", "train s", "median step ms", metric, second,
               "compression", "active params", "dense-equiv params", "other load"]
    rows = []
    for r in result["runs"]:
        m = r["final"]["metrics"]
        rows.append([
            r["method"], r["protocol"] + (f" ({r['budget_s']:g} s)" if r["budget_s"] else ""), r["steps"],
            f"{r['train_s']:.1f}", harness.ms(r["median_step_s"]) if r["median_step_s"] else "-",
            f"{m.get(metric, float('nan')):.4f}", f"{m.get(second, float('nan')):.4f}",
            f"{r['final']['compression_ratio']:.2f}x", f"{r['final']['params_active']:,}",
            f"{r['final']['params_dense_equivalent']:,}",
            (f"{r['other_load']:.0%}" if r["other_load"] is not None else "n/a") + (" !" if r["contended"] else ""),
        ])
    lines = [f"### {result['study']}: dense vs CoMERA", "", harness.table(headers, rows), ""]
    base = result["baseline"]
    if result["study"] == "mlm":
        lines.append(f"Floor: always predicting the most frequent token scores accuracy "
                     f"{base['unigram_accuracy']:.4f} on the same {base['val_masked_tokens']} masked tokens.")
    elif result["study"] == "pairs":
        lines.append(f"Floor: always predicting the most frequent label scores accuracy "
                     f"{base['majority_accuracy']:.4f} on the same {base['val_pairs']} pairs.")
    elif result["study"] == "dlrm":
        lines.append(f"Floor: predicting the training click rate ({base['train_click_rate']:.3f}) everywhere gives "
                     f"log-loss {base['constant_logloss']:.4f} and AUC 0.5 on the same {base['val_rows']} rows.")
    for protocol, s in result["summary"].items():
        delta = s["metric_delta"]
        ratio = s["step_time_ratio_dense_over_comera"]
        lines.append(
            f"- {protocol}: CoMERA {metric} {'-' if delta is None else f'{delta:+.4f}'} vs dense at "
            f"{s['compression_comera']:.2f}x compression; dense step / CoMERA step = "
            f"{'-' if ratio is None else harness.times(ratio)}; steps {s['steps_dense']} (dense) vs "
            f"{s['steps_comera']} (CoMERA); same data order: {s['same_data_order']}"
        )
    if any(r["contended"] for r in result["runs"]):
        lines.append(f"- '!': other processes took more than {result['max_other_load']:.0%} of the CPUs during "
                     "that run; its times (and, under the time budget, its step count) are not trustworthy.")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path:
    """Validation metric vs steps, vs training seconds, and compression ratio vs steps, every run."""
    spec = result["spec"]
    fig, axes = harness.new_figure(3, width=5.0, height=3.8)
    colours = {"dense": "tab:blue", "comera": "tab:red", "comera-paper": "tab:orange", "comera-norm": "tab:purple"}
    styles = {"steps": "-", "time": "--", "matched": ":"}
    for r in result["runs"]:
        v = r["validations"]
        label = f"{r['method']} / {r['protocol']}"
        steps = [p["step"] for p in v]
        secs = [p["train_s"] for p in v]
        vals = [p["metrics"].get(spec["metric"], float("nan")) for p in v]
        kw = dict(color=colours[r["method"]], linestyle=styles[r["protocol"]], label=label,
                  marker="o" if r["protocol"] == "steps" else "x", markersize=3 if r["protocol"] == "steps" else 5)
        axes[0].plot(steps, vals, **kw)
        axes[1].plot(secs, vals, **kw)
        axes[2].plot(steps, [p["compression_ratio"] for p in v], **kw)
    axes[0].set_xlabel("optimiser steps")
    axes[1].set_xlabel("training wall-clock seconds (validation excluded)")
    for ax in axes[:2]:
        ax.set_ylabel(spec["metric"])
    axes[2].set_xlabel("optimiser steps")
    axes[2].set_ylabel("compression ratio (dense-equivalent / active)")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['study']}: dense vs CoMERA (same steps: solid, same time: dashed)")
    return harness.save_figure(fig, path)


# ------------------------------------------------------------------------------------------------------
# entry point


def make_specs(study: str, quick: bool = False, steps: int | None = None, budget_s: float | None = None,
               val_every: int | None = None, seed: int = 0) -> list[StudySpec]:
    """The specs ``--study`` selects, with command-line overrides applied and checked."""
    if study not in (*STUDIES, "all"):
        raise ValueError(f"unknown study {study!r}; use one of {(*STUDIES, 'all')}")
    names = ALL_STUDIES if study == "all" else (study,)
    specs = []
    for name in names:
        spec = SPECS[name](quick)
        spec = replace(spec, seed=seed, steps=spec.steps if steps is None else steps,
                       budget_s=spec.budget_s if budget_s is None else budget_s,
                       val_every=spec.val_every if val_every is None else val_every)
        spec.check()
        specs.append(spec)
    return specs


def _quiet_lightning() -> None:
    """Keep Lightning's per-fit banners and tips out of the report (after its import, which resets them)."""
    import logging

    import lightning.pytorch  # noqa: F401  (sets its loggers to INFO on import)

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "comera_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", default="all", choices=[*STUDIES, "all"], help="which study to run (default all)")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps of the same-steps protocol")
    p.add_argument("--budget-s", type=float, default=None, help="training seconds of the same-time protocol")
    p.add_argument("--val-every", type=int, default=None, help="validate every this many steps")
    p.add_argument("--protocol", default="both", nargs="+", choices=[*PROTOCOLS, "both"],
                   help="which protocol(s) to run; both = steps and time")
    p.add_argument("--quick", action="store_true", help="tiny models, 30 steps, 6 s budgets (about a minute)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS,
                   help="dense, comera (the default late stage), comera-paper (the research code's late stage), "
                        "comera-norm (the scheduled late stage ranking slices by core norms)")
    p.add_argument("--late-fraction", type=float, default=None, help="late stage from this share of the run")
    p.add_argument("--target-compression", type=float, default=None, help="late-stage size target")
    p.add_argument("--d-model", type=int, default=None,
                   help="encoder width (heads d/32, d_ff 4d); default the study's (128)")
    p.add_argument("--batch-size", type=int, default=None, help="training batch size; default the study's")
    p.add_argument("--tag", default="", help="suffix of the output files (e.g. the seed)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="tokenizer / encoded corpus cache")
    p.add_argument("--max-other-load", type=float, default=0.15,
                   help="flag a run as contended above this CPU share taken by other processes")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each run, wait up to this many seconds for the machine to go quiet")
    p.add_argument("--repeats", type=int, default=1,
                   help="accepted for the benchmarks' common interface; every training run is done once")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the selected studies, print their tables and write JSON, PNG and markdown into ``--out-dir``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.budget_s is not None and not (math.isfinite(args.budget_s) and args.budget_s > 0):
        parser.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if args.val_every is not None and args.val_every < 1:
        parser.error(f"--val-every must be >= 1, got {args.val_every}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if not 0.0 <= args.max_other_load <= 1.0:
        parser.error(f"--max-other-load is a share of the machine in [0, 1], got {args.max_other_load}")
    if args.wait_quiet < 0:
        parser.error(f"--wait-quiet must be >= 0 seconds, got {args.wait_quiet}")
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = make_specs(args.study, args.quick, args.steps, args.budget_s, args.val_every, args.seed)
    for spec in specs:
        if args.late_fraction is not None:
            spec.late_fraction = args.late_fraction
        if args.batch_size is not None:
            if args.batch_size < 1:
                parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
            spec.data_kwargs.update(batch_size=args.batch_size)
        if args.target_compression is not None:
            spec.rank_kwargs.update(target_compression=args.target_compression)
        if args.d_model is not None:
            if "d_model" not in spec.task_kwargs:
                parser.error(f"--d-model applies to the transformer studies, not {spec.name}")
            spec.task_kwargs.update(d_model=args.d_model, num_heads=max(1, args.d_model // 32), d_ff=4 * args.d_model)
        spec.check()
    chosen = [args.protocol] if isinstance(args.protocol, str) else args.protocol
    protocols = tuple(dict.fromkeys(p for c in chosen for p in (DEFAULT_PROTOCOLS if c == "both" else (c,))))
    _quiet_lightning()
    tables = []
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    for spec in specs:
        stem = f"quality_{spec.name}{args.tag}"

        def partial(result: dict[str, Any], stem: str = stem) -> None:
            harness.write_json(args.out_dir / f"{stem}.partial.json", {**result, "settings": settings})

        result = run_study(spec, cache_dir=args.cache_dir, max_other_load=args.max_other_load,
                           wait_quiet_s=args.wait_quiet, protocols=protocols, methods=tuple(args.methods),
                           partial=partial)
        result["settings"] = settings
        json_path = harness.write_json(args.out_dir / f"{stem}.json", result)
        (args.out_dir / f"{stem}.partial.json").unlink(missing_ok=True)
        png_path = plot(result, args.out_dir / f"{stem}.png")
        text = markdown(result)
        tables.append(text)
        print("\n" + text + f"\n\nJSON: {json_path}\nPNG: {png_path}", flush=True)
    (args.out_dir / f"quality_study{args.tag}.md").write_text("\n\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
