"""The tuned quality study: every family at its own learning rate, perplexity at a stated token budget.

Each family sweeps :data:`GRID` at its middle size (5x; the full-width ones at 1x), the grid grown past an edge that
holds the best rate; every other size checks that rate at best, x2 and /2; then each (family, size) trains
``--steps`` at its rate for every seed (a rate whose final diverges is dropped for that size). Families, sized to the
full dense model's active parameters over ``size``: ``dense``, ``narrow`` (a smaller d_model), ``lowrank`` (``A B``),
``cola`` (``B silu(A x)``), ``tt`` (CoMERA's seed-0 final ranks, no gates), ``comera``, ``comera_act`` (SiLU on the
middle bonds), ``comera_early`` (the late stage from 10 % of the run, at the target by 50 %) and ``galore``. Runs go
to ``docs/data/<task>_<corpus>.json`` (``report.py`` renders it) after every run; a rerun resumes. The protocol and
more commands: benchmarks/README.md.

    python -m benchmarks.studies.tuned                           # the decoder LM on the standard library
    python -m benchmarks.studies.tuned --quick --out /tmp/q.json
    python -m benchmarks.studies.tuned --rates-from docs/data/lm_stdlib.json --steps 2000 --seeds 3 4 \
        --out docs/data/lm_stdlib_2k.json                      # the same rates and data, finals only
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.studies.driver import StudyFile, StudyJob, log

REPO = Path(__file__).resolve().parents[2]

FAMILIES = ("dense", "narrow", "lowrank", "cola", "tt", "comera", "comera_act", "comera_early", "galore")
COMERA = ("comera", "comera_act", "comera_early")  # trained with the rank callbacks
FULL_WIDTH = ("dense", "galore")  # trained at the full model's size only
FINAL_ORDER = ("dense", "comera", "tt", "comera_act", "comera_early", "narrow", "lowrank", "cola", "galore")
# comera_early: the late stage starts at this share of the steps and reaches the target this share later
EARLY_LATE_FRACTION, EARLY_RAMP_FRACTION = 0.1, 0.4
DEFAULT_LATE_FRACTION = 0.4  # comera and comera_act: the late stage at 40 % of the run, ScheduledLateStage's ramp
SIZES = (2.0, 5.0, 20.0)
MIDDLE = 5.0
GRID = (1.25e-3, 2.5e-3, 5e-3, 1e-2, 2e-2)
MAX_EXTENSIONS = 2
GATE_LR = 5e-3
FINAL_LR_RATIO = 0.1
GRAD_CLIP = 1.0


@dataclass(frozen=True)
class Job(StudyJob):
    """One training run of the study."""

    phase: str
    family: str
    size: float
    seed: int
    lr: float
    steps: int

    def __str__(self) -> str:
        return f"{self.phase} {self.family} x{self.size:g} seed {self.seed} lr {self.lr:.3g}"


# ------------------------------------------------------------------------------------------------------
# the protocol's decisions (pure functions of the finished runs, so a resumed study decides alike)


def finite(value: Any) -> bool:
    """Whether ``value`` is a finite number (a loss that did not diverge)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def _of(runs: Sequence[dict[str, Any]], phase: str, family: str, size: float) -> list[dict[str, Any]]:
    return [r for r in runs if r["phase"] == phase and r["family"] == family and r["size"] == size]


def best_rate(runs: Sequence[dict[str, Any]]) -> float:
    """The rate of the lowest final validation loss (ties: the smaller rate); diverged runs (no finite loss) lose."""
    if not runs:
        raise ValueError("no runs to choose a rate from")
    return min(runs, key=lambda r: (r["val_loss"] if finite(r["val_loss"]) else math.inf, r["lr"]))["lr"]


def sweep_rates(
    done: dict[float, float], grid: Sequence[float] = GRID, max_extensions: int = MAX_EXTENSIONS
) -> tuple[list[float], float | None]:
    """(Rates still to run, the chosen rate or None) of a sweep whose finished runs map rate -> final loss: the grid,
    then the rate past an edge that holds the best (a factor of 2), at most ``max_extensions`` times."""
    rates = sorted(grid)
    for _ in range(max_extensions + 1):
        missing = [lr for lr in rates if not any(math.isclose(lr, d) for d in done)]
        if missing:
            return missing, None
        losses = {lr: next(v for d, v in done.items() if math.isclose(lr, d)) for lr in rates}
        best = min(rates, key=lambda lr: (losses[lr] if finite(losses[lr]) else math.inf, lr))
        if best == rates[0]:
            rates.insert(0, rates[0] / 2)
        elif best == rates[-1]:
            rates.append(rates[-1] * 2)
        else:
            return [], best
    return [], best


def check_rates(chosen: float) -> list[float]:
    """The rates that check a chosen rate at another size: best, x2 and /2."""
    return [chosen / 2, chosen, chosen * 2]


class Plan:
    """Which runs the study still needs, given the finished ones: the sweep, the checks and the finals in order.

    ``recheck``: the sweeps ran on other data (``--rates-from`` a study with another ``--set``), so every size, the
    sweep's own included, checks the swept rate on this study's data."""

    def __init__(
        self,
        families: Sequence[str],
        sizes: Sequence[float],
        seeds: Sequence[int],
        steps: int,
        sweep_steps: int,
        grid: Sequence[float] = GRID,
        recheck: bool = False,
    ) -> None:
        if unknown := sorted(set(families) - set(FAMILIES)):
            raise ValueError(f"unknown families {unknown}; use some of {FAMILIES}")
        if "tt" in families and "comera" not in families:
            raise ValueError("the tt family trains at CoMERA's final ranks: add comera to the families")
        self.families, self.sizes, self.seeds = list(families), [float(s) for s in sizes], list(seeds)
        self.steps, self.sweep_steps, self.grid = steps, sweep_steps, list(grid)
        self.middle = MIDDLE if MIDDLE in self.sizes else self.sizes[len(self.sizes) // 2]
        self.recheck = recheck

    def sizes_of(self, family: str) -> list[float]:
        return [1.0] if family in FULL_WIDTH else self.sizes

    def sweep_size(self, family: str) -> float:
        return 1.0 if family in FULL_WIDTH else self.middle

    def _swept(self, runs: Sequence[dict[str, Any]], family: str) -> tuple[list[float], float | None]:
        sweep = _of(runs, "sweep", family, self.sweep_size(family))
        return sweep_rates({r["lr"]: r["val_loss"] for r in sweep}, self.grid)

    def chosen(self, runs: Sequence[dict[str, Any]], family: str, size: float) -> float | None:
        """The rate a (family, size) trains its finals at, or None while its sweep or check is unfinished.

        A rate whose final diverged (any seed) is dropped for that size: the finals run at the best short-run rate
        below it, or at half of it when none below was run."""
        _, best = self._swept(runs, family)
        if best is None:
            return None
        if size == self.sweep_size(family) and not self.recheck:
            short = _of(runs, "sweep", family, size)
        else:
            wanted = check_rates(best)
            short = [r for r in _of(runs, "check", family, size) if any(math.isclose(r["lr"], w) for w in wanted)]
            if len(short) != len(wanted):
                return None
            best = best_rate(short)
        diverged = diverged_rates(runs, family, size)
        if not diverged:
            return best
        ceiling = min(diverged)
        below = [r for r in short if r["lr"] < ceiling and not any(math.isclose(r["lr"], d) for d in diverged)]
        return best_rate(below) if below else ceiling / 2

    def pending(self, runs: Sequence[dict[str, Any]]) -> list[Job]:
        """Every job whose inputs exist and that has not run, in priority order: sweeps, the finals at the sweep
        size, the checks, the other finals."""
        jobs: list[Job] = []
        first = self.seeds[0]
        for family in self.families:
            if family == "tt" and comera_ranks(runs, self.sweep_size("comera"), first) is None:
                continue  # the tt sweep trains at CoMERA's ranks of the middle size
            sweep_size = self.sweep_size(family)
            missing, best = self._swept(runs, family)
            jobs += [Job("sweep", family, sweep_size, first, lr, self.sweep_steps) for lr in missing]
            if best is None:
                continue
            for size in self.sizes_of(family):
                if family == "tt" and comera_ranks(runs, size, first) is None:
                    continue
                if size != sweep_size or self.recheck:
                    jobs += [Job("check", family, size, first, lr, self.sweep_steps) for lr in check_rates(best)]
                lr = self.chosen(runs, family, size)
                if lr is not None:
                    jobs += [Job("final", family, size, seed, lr, self.steps) for seed in self.seeds]
        done = {Job.of(r).key for r in runs}
        todo = [j for j in dict.fromkeys(jobs) if j.key not in done]

        # the sweeps, then every seed of the sweep size (one whole comparison), then each other size in the order
        # asked for, its checks before its finals; finals seed by seed, CoMERA and its tt twin first, so a study cut
        # short still compares whole seeds at whole sizes
        def priority(job: Job) -> tuple:
            if job.phase == "sweep":
                return (0, 0, 0, self.families.index(job.family))
            if job.phase == "check" and job.size == self.sweep_size(job.family):  # a recheck gates its finals
                return (0, 1, 0, self.families.index(job.family))
            family_rank = FINAL_ORDER.index(job.family)
            if job.size == self.sweep_size(job.family):
                return (1, 0, self.seeds.index(job.seed), family_rank)
            after_check = 0 if job.phase == "check" else 1
            return (2, self.sizes.index(job.size), after_check, self.seeds.index(job.seed), family_rank)

        return sorted(todo, key=priority)


def diverged_rates(runs: Sequence[dict[str, Any]], family: str, size: float) -> list[float]:
    """The rates at which a final run of (family, size) diverged (no finite validation loss)."""
    return sorted({r["lr"] for r in _of(runs, "final", family, size) if not finite(r["val_loss"])})


def comera_ranks(runs: Sequence[dict[str, Any]], size: float, seed: int) -> dict[str, list[int]] | None:
    """The final ranks of CoMERA's seed-``seed`` final at ``size`` (what tt trains at); never a diverged run's."""
    found = [r for r in _of(runs, "final", "comera", size) if r["seed"] == seed and finite(r["val_loss"])]
    return found[0]["ranks_final"] if found else None


# ------------------------------------------------------------------------------------------------------
# models


def base_spec(task: str, corpus: str, seed: int, steps: int, quick: bool, overrides: Sequence[str] = ()):
    """The study spec of ``task`` on ``corpus`` with the protocol's clipping and validation interval, and the
    ``--set`` ``overrides`` (``SECTION.KEY=VALUE``)."""
    from benchmarks.studies import common as study

    spec = study.study_spec(task, corpus, seed, steps, quick)
    study.apply_overrides(spec, list(overrides))
    return replace(
        spec,
        grad_clip=GRAD_CLIP,
        val_every=max(1, steps // 12),
        limit_val_batches=None if spec.limit_val_batches is None else 2 * spec.limit_val_batches,
    )


def with_optim(kwargs: dict[str, Any], lr: float, steps: int) -> dict[str, Any]:
    """``kwargs`` with the protocol's optimiser settings at learning rate ``lr``."""
    optim = {
        **(kwargs.get("optim") or {}),
        "lr_cores": lr,
        "lr_other": lr,
        "lr_gates": GATE_LR,
        "warmup_steps": max(1, min(100, steps // 10)),
        "schedule": "cosine",
        "final_lr_ratio": FINAL_LR_RATIO,
    }
    return {**kwargs, "optim": optim}


def family_kwargs(spec, family: str, knob: float | None, ranks: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The model arguments of ``family`` at width, rank or start rank ``knob`` (None: the spec's own)."""
    from benchmarks.studies import common as study

    layers, kwargs = study.with_layer_options, dict(spec.task_kwargs)
    silu = {"bottleneck_activation": "silu", "activation_layers": r"(^|\.)layers\."}
    if family in FULL_WIDTH:
        return layers(kwargs, tt_linears=False, tt_embeddings=False)
    if family == "narrow":
        return layers(study.at_width(kwargs, int(knob)), tt_linears=False, tt_embeddings=False)
    if family in ("lowrank", "cola"):
        rank = int(knob)
        low = {"rank": rank, "embedding_rank": rank, "layer_ranks": None, "low_rank_linears": "."}
        low |= {"low_rank_embeddings": ".", "learn_gates": False, **(silu if family == "cola" else {})}
        return layers(kwargs, tt_linears=True, tt_embeddings=True, **low)
    if family == "comera_early":
        return family_kwargs(spec, "comera", knob)
    if family == "comera_act":
        return layers(family_kwargs(spec, "comera", knob), **silu)
    if family == "comera":
        if knob is None:
            return layers(kwargs, tt_linears=True, tt_embeddings=True)
        # a larger start rank for the sizes the default start is already below; the head keeps its 2x share
        head = {k: 2 * int(knob) for k in ((kwargs.get("layer_config") or {}).get("layer_ranks") or {})}
        rank = int(knob)
        return layers(
            kwargs, tt_linears=True, tt_embeddings=True, rank=rank, embedding_rank=rank, layer_ranks=head or None
        )
    if family == "tt":
        if ranks is None:
            raise ValueError("the tt family needs CoMERA's final ranks")
        exact = {r"(^|\.)" + re.escape(name.split("model.", 1)[-1]) + "$": list(r[1:-1]) for name, r in ranks.items()}
        return layers(family_kwargs(spec, "comera", knob), layer_ranks=exact, learn_gates=False)
    raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")


def active_parameters(spec, kwargs: dict[str, Any]) -> int:
    import torch

    from benchmarks.studies import common as study
    from comera_lightning.nn import size_report

    torch.manual_seed(0)
    return size_report(study.task_class(spec.name)(**kwargs)).active_parameters


def smallest_at_least(count: Callable[[int], int], target: float, low: int, high: int) -> int:
    """The smallest integer knob in [low, high] whose count reaches ``target`` (counts grow with the knob)."""
    if count(high) < target:
        return high
    while low < high:
        mid = (low + high) // 2
        if count(mid) >= target:
            high = mid
        else:
            low = mid + 1
    return low


def narrow_widths(spec) -> list[int]:
    """The widths up to the full one at which the narrowed model builds (``study.at_width`` keeps the head width;
    rotary embeddings need an even one)."""
    from benchmarks.studies import common as study

    widths = range(2, spec.task_kwargs["d_model"] + 1)
    heads = {w: study.at_width(spec.task_kwargs, w)["num_heads"] for w in widths}
    return [w for w in widths if w % heads[w] == 0 and (w // heads[w]) % 2 == 0]


def knob_for(spec, family: str, size: float, full: int) -> float | None:
    """The width (narrow), rank (lowrank, cola) or start rank (comera, tt) of ``family`` at ``size``."""
    width = spec.task_kwargs["d_model"]
    target = full / size

    def count(family: str, knob: int) -> int:
        return active_parameters(spec, family_kwargs(spec, family, knob))

    if family == "narrow":
        widths = narrow_widths(spec)
        return widths[smallest_at_least(lambda i: count("narrow", widths[i]), target, 0, len(widths) - 1)]
    if family in ("lowrank", "cola"):
        return smallest_at_least(lambda r: count("lowrank", r), target, 1, width)
    if family in (*COMERA, "tt"):
        return start_rank(spec, lambda r: count("comera", r), target, width)
    return None


def start_rank(spec, count: Callable[[int], int], target: float, limit: int) -> int:
    """A CoMERA model's start rank, above the target: the spec's rank when ``count(rank)`` (its active parameters)
    is at least 1.2x ``target``, else grown by half until it is (or reaches ``limit``)."""
    rank = int(spec.task_kwargs["layer_config"]["rank"])
    while count(rank) < 1.2 * target and rank < limit:
        rank += rank // 2
    return rank


# ------------------------------------------------------------------------------------------------------
# one run (in a worker process)


def training_loss(task, batch):
    """The loss a training step of ``task`` backpropagates (the tasks' own loss code, without their logging)."""
    if hasattr(task, "_loss"):  # MaskedLM
        return task._loss(batch)[0]
    return task._cross_entropy(*task._logits_and_labels(batch))


def step_flops(task, batch) -> int:
    """FLOPs of one training step's forward and backward on ``batch`` (torch's FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode

    task.train()
    with FlopCounterMode(display=False) as counter:
        training_loss(task, batch).backward()
    task.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def galore_optimizer(task):
    """``GaLoreAdamW`` over a decoder task's parameters at its optimiser settings: the blocks' 2-D linear weights
    (attention and MLP projections) projected at rank d_model / 4, as the GaLore paper's LLaMA runs."""
    import torch

    from benchmarks import bench_training_step as bts

    o, model = task.optim, task.model
    targets = [m.weight for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    settings = {"rank": max(1, model.d_model // 4), "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
    optimizer = bts.galore_optimizer(list(task.parameters()), targets, o.lr_other, o.weight_decay, settings)
    if optimizer is None:
        raise RuntimeError(bts.import_galore()[1])
    return optimizer


def galore_task(kwargs: dict[str, Any]):
    """The dense decoder task of ``kwargs`` trained by :func:`galore_optimizer`, with its warmup and schedule."""
    import torch

    from benchmarks.studies.common import with_layer_options
    from comera_lightning.lit import CausalLM
    from comera_lightning.lit.base import warmup_decay_factor

    class GaLoreCausalLM(CausalLM):
        def configure_optimizers(self):
            o, optimizer = self.optim, galore_optimizer(self)
            if o.warmup_steps == 0 and o.schedule == "constant":
                return optimizer
            total = 1 if o.schedule == "constant" else max(1, int(self.trainer.estimated_stepping_batches))
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: warmup_decay_factor(step, o.warmup_steps, total, o.schedule, o.final_lr_ratio)
            )
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return GaLoreCausalLM(**with_layer_options(kwargs, tt_linears=False, tt_embeddings=False))


def step_memory(task, batch, galore: bool) -> dict[str, int]:
    """Peak bytes of one steady training step (forward, backward, optimiser) of ``task`` (harness.peak_memory):
    float32 weights and AdamW state (GaLore's projected state for ``galore``)."""
    import torch

    from benchmarks import harness

    task.train()
    if galore:
        optimizer = galore_optimizer(task)
    else:
        from comera_lightning.optim import comera_parameter_groups

        optimizer = torch.optim.AdamW(comera_parameter_groups(task, 1e-4, 1e-4, 1e-4))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        training_loss(task, batch).backward()
        optimizer.step()

    # MemTracker hooks every parameter's gradient: frozen gates (a few hundred floats) get one for the measurement
    frozen = [p for p in task.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    step()
    peak = harness.peak_memory(step, modules=[task], optimizers=[optimizer])
    for p in frozen:
        p.requires_grad_(False)
    keys = ("parameters", "gradients", "optimizer_state_persistent", "activations", "total")
    return {k: int(peak[k]) for k in keys if k in peak}


def run_job(
    job: dict[str, Any],
    task_name: str,
    corpus: str,
    quick: bool,
    knob: float | None,
    ranks: dict[str, list[int]] | None,
    cache_dir: str,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """Train one job and return its record (the fields of a ``runs`` entry)."""
    import torch

    from benchmarks.studies import common as study
    from comera_lightning.callbacks import ScheduledLateStage

    job = Job(**job)
    spec = base_spec(task_name, corpus, job.seed, job.steps, quick, overrides)
    dm = study.worker_datamodule(spec, Path(cache_dir))
    kwargs = with_optim(family_kwargs(spec, job.family, knob, ranks), job.lr, job.steps)
    torch.manual_seed(job.seed)
    task = galore_task(kwargs) if job.family == "galore" else study.task_class(spec.name)(**kwargs)
    comera = job.family in COMERA
    if comera:
        rank = {k: v for k, v in spec.rank_kwargs.items() if k != "target_size_ratio"}
        if job.family == "comera_early":
            late_stage = ScheduledLateStage(ramp_steps=max(1, round(EARLY_RAMP_FRACTION * job.steps)))
            spec = replace(spec, late_fraction=EARLY_LATE_FRACTION)
        else:  # the library's default schedule, whatever the config's
            late_stage = ScheduledLateStage()
            spec = replace(spec, late_fraction=DEFAULT_LATE_FRACTION)
        spec = replace(spec, rank_kwargs={**rank, "target_compression": job.size, "late_stage": late_stage})
    batch = next(iter(dm.val_dataloader()))  # the same shape as a training batch; leaves the training order alone
    flops_start = step_flops(task, batch)
    run = study.run_one(spec, "comera" if comera else "dense", dm, task=task, max_other_load=1.0)
    flops_end = step_flops(task, batch)
    late = spec.late_start_step if comera else job.steps
    tokens_per_step = int(batch["input_ids"].numel())
    final = run["final"]
    record = {
        **asdict(job),
        "knob": knob,
        "tokens": job.steps * tokens_per_step,
        "params_active": int(final["params_active"]),
        "params_trainable": int(run["size_final"]["params_trainable"]),
        "val_loss": float(final["metrics"]["val/loss"]),
        "val_perplexity": float(final["metrics"]["val/perplexity"]),
        "curve": [[v["step"] * tokens_per_step, v["metrics"]["val/loss"]] for v in run["validations"]],
        "flops_per_step_start": flops_start,
        "flops_per_step_end": flops_end,
        # the start model's FLOPs until the late stage, then the mean of start and end while ranks shrink
        "train_flops": late * flops_start + (job.steps - late) * (flops_start + flops_end) / 2,
        "train_s": run["train_s"],
        "median_step_s": run["median_step_s"],
        "ranks_final": run["ranks_final"] if job.family in (*COMERA, "tt") else None,
        "late_start_step": spec.late_start_step if comera else None,
        "first_batch_hash": run["first_batch_hash"],
    }
    if job.phase == "final" and job.seed == 0:
        record["peak_memory"] = step_memory(task, batch, job.family == "galore")
    return record


# ------------------------------------------------------------------------------------------------------
# the driver


def short_runs_of(
    source: Path, out: Path, task: str, corpus: str, protocol: dict[str, Any], families: Sequence[str] = ()
) -> tuple[list[dict[str, Any]], bool]:
    """(The sweep and check runs of the study in ``source`` that a new study at ``out`` starts from; whether the new
    study must check every rate again).

    With the same ``--set`` the short runs fix every rate, so only finals run. With another ``--set`` only the sweeps
    are taken, and the new study checks their rates at every size on its own data (``Plan(recheck=True)``). The
    source must be the same task, corpus and grid, and hold a finished sweep of each of ``families`` then."""
    from benchmarks import harness

    if source.resolve() == out.resolve():
        raise ValueError(f"--rates-from {source} is the --out file itself; give the finished study another --out")
    if not source.exists():
        raise ValueError(f"--rates-from {source} does not exist; give a study written by this script")
    state = harness.read_json(source)
    old = state.get("protocol", {})
    mismatched = {
        key: (state.get(key), value) for key, value in (("task", task), ("corpus", corpus)) if state.get(key) != value
    }
    same_data = list(old.get("set", [])) == list(protocol.get("set", []))
    # on other data every rate is checked again, so the checks may be longer than the source's sweeps
    keys = ("sweep_steps", "grid", "quick") if same_data else ("grid", "quick")
    mismatched |= {key: (old.get(key), protocol[key]) for key in keys if old.get(key) != protocol[key]}
    if mismatched:
        raise ValueError(
            f"--rates-from {source} is another study (theirs, this one's: {mismatched}); its rates hold only for the"
            " same task, corpus, --quick and learning-rate grid (and --sweep-steps unless --set differs)"
        )
    phases = ("sweep", "check") if same_data else ("sweep",)
    short = [{**run, "copied_from": source.name} for run in state.get("runs", []) if run.get("phase") in phases]
    if not short:
        raise ValueError(f"--rates-from {source} holds no sweep or check runs to take the rates from")
    if not same_data:  # a sweep finished here would mix two corpora in one choice
        grid = protocol["grid"]
        swept = {f: {r["lr"]: r["val_loss"] for r in short if r["family"] == f} for f in families}
        unswept = [f for f in families if sweep_rates(swept[f], grid)[1] is None]
        if unswept:
            raise ValueError(
                f"--rates-from {source} has no finished sweep of {unswept}, and this study's --set differs from its"
                " own; finish those sweeps there first, or leave those families out"
            )
    return short, not same_data


class Study(StudyFile):
    """The study's JSON (``runs`` plus the protocol) and the plan that extends it; sets ``plan.recheck`` when the
    study's sweeps were copied from another ``--set``."""

    FORMAT = "comera-quality-study/1"
    # the final runs' length may change (each final records its steps); the sweeps' may not
    FIXED = ("sweep_steps", "grid", "quick", "set")

    def __init__(
        self,
        path: Path,
        task: str,
        corpus: str,
        plan: Plan,
        quick: bool,
        cache_dir: Path,
        rates_from: Path | None = None,
        overrides: Sequence[str] = (),
    ) -> None:
        self.task, self.corpus, self.quick, self.cache_dir = task, corpus, quick, cache_dir
        self.overrides = list(overrides)
        protocol = dict(families=plan.families, sizes=plan.sizes, seeds=plan.seeds, steps=plan.steps)
        protocol |= dict(sweep_steps=plan.sweep_steps, grid=plan.grid, gate_lr=GATE_LR, final_lr_ratio=FINAL_LR_RATIO)
        protocol |= dict(grad_clip=GRAD_CLIP, quick=quick, set=self.overrides)
        resumed = path.exists()
        super().__init__(path, plan, task, corpus, protocol)
        if rates_from is not None and not resumed:
            self.state["rates_from"] = rates_from.name
            self.state["runs"], recheck = short_runs_of(rates_from, path, task, corpus, protocol, plan.families)
            self.state["protocol"]["recheck"] = recheck
        plan.recheck = bool(self.state["protocol"].get("recheck", False))
        self.spec = base_spec(task, corpus, plan.seeds[0], plan.steps, quick, self.overrides)
        self.full = active_parameters(self.spec, family_kwargs(self.spec, "dense", None))
        self.state["full_dense_params"] = self.full
        self._knobs: dict[tuple[str, float], float | None] = {}

    def merged(self, old: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
        """Every family, size and seed asked for so far (and every family with runs of its own, not copied by
        ``--rates-from``), not only this invocation's."""
        ran = {run["family"] for run in runs if "copied_from" not in run}
        asked = {*old.get("families", []), *self.plan.families, *ran}
        return {
            "families": [f for f in FAMILIES if f in asked] + sorted(asked - set(FAMILIES)),
            "sizes": list(dict.fromkeys([*old.get("sizes", []), *self.plan.sizes])),
            "seeds": list(dict.fromkeys([*old.get("seeds", []), *self.plan.seeds])),
        }

    def knob(self, family: str, size: float) -> float | None:
        if (family, size) not in self._knobs:
            self._knobs[(family, size)] = knob_for(self.spec, family, size, self.full)
        return self._knobs[(family, size)]

    def _submit(self, pool: ProcessPoolExecutor, job: Job) -> Future:
        ranks = comera_ranks(self.runs, job.size, self.plan.seeds[0]) if job.family == "tt" else None
        knob = self.knob(job.family, job.size)
        log(f"start {job} ({job.steps} steps, knob {knob})")
        args = (self.task, self.corpus, self.quick, knob, ranks, str(self.cache_dir), self.overrides)
        return pool.submit(run_job, asdict(job), *args)

    def failed(self, job: Job) -> dict[str, Any]:
        return {"knob": self.knob(job.family, job.size), "tokens": 0, "params_active": 0, "curve": []}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--task", default="lm", choices=("lm", "mlm"), help="lm: configs/llm_cpu.yaml's decoder; mlm: the masked LM")
    add("--corpus", default="stdlib", help="stdlib, site:PACKAGE (installed sources) or a folder")
    add("--families", nargs="+", choices=FAMILIES, help="default: all (without galore for mlm)")
    add("--sizes", nargs="+", type=float, default=list(SIZES), help="compressions of the full dense model")
    add("--seeds", nargs="+", type=int, default=[0, 1, 2])
    add("--steps", type=int, default=1500, help="optimiser steps of a final run")
    add("--sweep-steps", type=int, default=500, help="steps of a sweep or check run")
    add("--workers", type=int, default=2, help="runs at once, of one torch thread each")
    add("--hours", type=float, help="start no run after this many hours")
    add("--quick", action="store_true", help="a tiny model and data: a smoke run")
    add("--set", dest="overrides", nargs="+", default=[], metavar="SECTION.KEY=VALUE", help="config values (YAML)")
    add("--out", type=Path, help="default docs/data/<task>_<corpus>.json")
    add("--rates-from", type=Path, help="start --out from this study's sweeps and checks: only finals run")
    args = parser.parse_args(argv)
    if args.families is None:
        args.families = [f for f in FAMILIES if args.task == "lm" or f != "galore"]
    if args.task == "mlm" and "galore" in args.families:
        parser.error("the galore family is built for the decoder (--task lm) only: leave it out of --families")
    corpus = args.corpus.replace("site:", "").replace("/", "_").strip("_") or "corpus"
    out = args.out or REPO / "docs" / "data" / f"{args.task}_{corpus}.json"
    try:
        plan = Plan(args.families, args.sizes, args.seeds, args.steps, args.sweep_steps)
        cache = REPO / ".cache" / "comera"
        study = Study(out, args.task, args.corpus, plan, args.quick, cache, args.rates_from, args.overrides)
    except ValueError as err:
        parser.error(str(err))
    study.run(args.workers, args.hours)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
