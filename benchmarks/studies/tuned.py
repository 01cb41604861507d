"""The tuned quality protocol: every method at its own learning rate, perplexity at a stated token budget.

A comparison at one shared, untuned rate measures which model leaves the unigram plateau first, not what a model
of that size learns. This study gives each family its own rate and only then compares:

1. **Sweep.** Each family at its middle size (5x; the full-width models at 1x) trains ``--sweep-steps`` at every
   rate of a log grid a factor of 2 apart (:data:`GRID`). When the best rate sits at an edge, the grid grows past
   that edge (at most :data:`MAX_EXTENSIONS` times).
2. **Check.** At every other size the chosen rate is checked at best, x2 and /2 (short runs); the best of the three
   is that size's rate.
3. **Final.** Each (family, size) trains ``--steps`` at its rate for every seed of ``--seeds``. A rate whose final
   diverges (no finite validation loss, any seed) is dropped for that size, and every seed runs again at the best
   short-run rate below it; the diverged run stays in the data and the report names it.

Every run: AdamW, one learning rate for every weight (cores and other parameters alike; CoMERA's gates keep their
own 5e-3), linear warm-up, cosine decay to a tenth, gradient clipping at 1.0, the same batches for every method
(one datamodule per seed). Families, each sized to the full dense model's active parameters over ``size``:

- ``dense``: the full-width model (the reference); ``narrow``: the same architecture at a smaller d_model;
- ``lowrank``: every linear and embedding a plain ``A B`` (frozen gates); ``cola``: the same with SiLU between the
  factors of every block linear (CoLA, Liu et al. 2025: ``B silu(A x)``);
- ``tt``: a TT with CoMERA's final ranks (seed 0, same size) trained from scratch without gates: what rank
  adaptation adds; ``comera``: the full-width TT cut by the scheduled late stage to ``size``; ``comera_act``: the
  same with SiLU on the middle bond of every block linear (CoLA's idea inside CoMERA); ``comera_early``: CoMERA
  whose late stage starts at 10 % of the steps and reaches the size by 50 %, so half the run trains at the final
  ranks (the default schedule cuts until nearly the end);
- ``galore``: the full-width model trained with GaLore (the memory reference: its parameters are not reduced).

Rivals are sized to at least CoMERA's target (the closest width or rank at or above it), so a CoMERA win is at
the same or fewer active parameters. Each run records its validation curve, the training FLOPs (torch's
FlopCounterMode on one step at the start and at the end) and, for seed 0, the peak memory of a training step.
Runs go to ``docs/data/<task>_<corpus>.json`` (the format ``report.py`` reads), rewritten after every run; a
rerun resumes. Two worker processes of one torch thread each train at once.

    python -m benchmarks.studies.tuned                           # the decoder LM on the standard library
    python -m benchmarks.studies.tuned --corpus site:sqlalchemy --seeds 0
    python -m benchmarks.studies.tuned --task mlm --sizes 5 20     # the masked LM (docs/data/mlm_stdlib.json)
    python -m benchmarks.studies.tuned --quick --out /tmp/q.json
    python -m benchmarks.studies.tuned --rates-from docs/data/lm_stdlib.json --steps 2000 --seeds 3 4 \
        --out docs/data/lm_stdlib_2k.json                      # the same rates and data, finals only, twice the budget
    python -m benchmarks.studies.tuned --rates-from docs/data/lm_stdlib.json --sweep-steps 1000 --steps 4520 \
        --seeds 0 --sizes 5 --families dense narrow lowrank cola tt comera comera_early \
        --set data.include_tests=true data.max_files=null data.max_sequences=null data.max_val_sequences=640 \
        --out docs/data/lm_stdlib_10tpp.json                   # 10 tokens per parameter on the whole standard library:
                                                               # the swept rates checked again on the new data
    python -m benchmarks.studies.report --write                # tables and plots into docs/results.md
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

FAMILIES = ("dense", "narrow", "lowrank", "cola", "tt", "comera", "comera_act", "comera_early", "galore")
COMERA = ("comera", "comera_act", "comera_early")  # trained with the rank callbacks
FULL_WIDTH = ("dense", "galore")  # trained at the full model's size only
FINAL_ORDER = ("dense", "comera", "tt", "comera_act", "comera_early", "narrow", "lowrank", "cola", "galore")
# comera_early: the late stage starts at this share of the steps and reaches the target this share later, so the
# model trains the second half at its final ranks (what the tt family does from the start)
EARLY_LATE_FRACTION, EARLY_RAMP_FRACTION = 0.1, 0.4
DEFAULT_LATE_FRACTION = 0.4  # comera and comera_act: the late stage at 40 % of the run, ScheduledLateStage's ramp
SIZES = (2.0, 5.0, 20.0)
MIDDLE = 5.0
GRID = (1.25e-3, 2.5e-3, 5e-3, 1e-2, 2e-2)
MAX_EXTENSIONS = 2
GATE_LR = 5e-3
FINAL_LR_RATIO = 0.1
GRAD_CLIP = 1.0
PHASES = ("sweep", "check", "final")
FORMAT = "comera-quality-study/1"


@dataclass(frozen=True)
class Job:
    """One training run of the study."""

    phase: str
    family: str
    size: float
    seed: int
    lr: float
    steps: int

    @property
    def key(self) -> tuple:
        return (self.phase, self.family, float(self.size), int(self.seed), round(float(self.lr), 12), int(self.steps))


def job_of(run: dict[str, Any]) -> Job:
    return Job(run["phase"], run["family"], float(run["size"]), int(run["seed"]), float(run["lr"]), int(run["steps"]))


# ------------------------------------------------------------------------------------------------------
# the protocol's decisions (pure functions of the finished runs, so a resumed study decides alike)


def best_rate(runs: Sequence[dict[str, Any]]) -> float:
    """The rate of the lowest final validation loss (ties: the smaller rate); diverged runs (no finite loss) lose."""
    if not runs:
        raise ValueError("no runs to choose a rate from")
    return min(runs, key=lambda r: (r["val_loss"] if _finite(r["val_loss"]) else math.inf, r["lr"]))["lr"]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def sweep_rates(
    done: dict[float, float], grid: Sequence[float] = GRID, max_extensions: int = MAX_EXTENSIONS
) -> tuple[list[float], float | None]:
    """(rates still to run, the chosen rate or None) of a sweep whose finished runs map rate -> final loss.

    The grid runs first; when its best rate is at an edge, the next rate past that edge (a factor of 2) is added,
    at most ``max_extensions`` times in all. The choice is made once nothing is left to run.
    """
    rates = sorted(grid)
    for _ in range(max_extensions + 1):
        missing = [lr for lr in rates if not any(math.isclose(lr, d) for d in done)]
        if missing:
            return missing, None
        losses = {lr: next(v for d, v in done.items() if math.isclose(lr, d)) for lr in rates}
        best = min(rates, key=lambda lr: (losses[lr] if _finite(losses[lr]) else math.inf, lr))
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
    """Which runs the study still needs, given the finished ones: the sweep, the checks and the finals in order."""

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
        unknown = sorted(set(families) - set(FAMILIES))
        if unknown:
            raise ValueError(f"unknown families {unknown}; use some of {FAMILIES}")
        if "tt" in families and "comera" not in families:
            raise ValueError("the tt family trains at CoMERA's final ranks: add comera to the families")
        self.families, self.sizes, self.seeds = list(families), [float(s) for s in sizes], list(seeds)
        self.steps, self.sweep_steps, self.grid = steps, sweep_steps, list(grid)
        self.middle = MIDDLE if MIDDLE in self.sizes else self.sizes[len(self.sizes) // 2]
        # the sweeps ran on other data (--rates-from a study without this one's --set): every size, the sweep's
        # own included, checks the swept rate on this study's data
        self.recheck = recheck

    def sizes_of(self, family: str) -> list[float]:
        return [1.0] if family in FULL_WIDTH else self.sizes

    def sweep_size(self, family: str) -> float:
        return 1.0 if family in FULL_WIDTH else self.middle

    def chosen(self, runs: Sequence[dict[str, Any]], family: str, size: float) -> float | None:
        """The rate a (family, size) trains its finals at, or None while its sweep or check is unfinished.

        A rate whose final diverged (any seed: no finite validation loss) is dropped for that size: the finals run
        at the best short-run rate below it, or at half of it when none below was run (a short run can pass at a
        rate that a run twice as long, whose late stage cuts later, does not survive)."""
        sweep_size = self.sweep_size(family)
        sweep = {
            r["lr"]: r["val_loss"]
            for r in runs
            if r["phase"] == "sweep" and r["family"] == family and r["size"] == sweep_size
        }
        _, best = sweep_rates(sweep, self.grid)
        if best is None:
            return None
        if size == sweep_size and not self.recheck:
            short = [r for r in runs if r["phase"] == "sweep" and r["family"] == family and r["size"] == size]
        else:
            checks = [r for r in runs if r["phase"] == "check" and r["family"] == family and r["size"] == size]
            wanted = check_rates(best)
            short = [r for r in checks if any(math.isclose(r["lr"], lr) for lr in wanted)]
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
        for family in self.families:
            if family == "tt" and not self._comera_ranks_known(runs, self.sweep_size("comera")):
                continue  # the tt sweep trains at CoMERA's ranks of the middle size
            sweep_size = self.sweep_size(family)
            sweep = {
                r["lr"]: r["val_loss"]
                for r in runs
                if r["phase"] == "sweep" and r["family"] == family and r["size"] == sweep_size
            }
            missing, best = sweep_rates(sweep, self.grid)
            jobs += [Job("sweep", family, sweep_size, self.seeds[0], lr, self.sweep_steps) for lr in missing]
            if best is None:
                continue
            for size in self.sizes_of(family):
                if family == "tt" and not self._comera_ranks_known(runs, size):
                    continue
                if size != sweep_size or self.recheck:
                    jobs += [
                        Job("check", family, size, self.seeds[0], lr, self.sweep_steps) for lr in check_rates(best)
                    ]
                lr = self.chosen(runs, family, size)
                if lr is not None:
                    jobs += [Job("final", family, size, seed, lr, self.steps) for seed in self.seeds]
        done = {job_of(r).key for r in runs}
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

    def _comera_ranks_known(self, runs: Sequence[dict[str, Any]], size: float) -> bool:
        return comera_ranks(runs, size, self.seeds[0]) is not None


def diverged_rates(runs: Sequence[dict[str, Any]], family: str, size: float) -> list[float]:
    """The rates at which a final run of (family, size) diverged (no finite validation loss)."""
    return sorted(
        {
            r["lr"]
            for r in runs
            if r["phase"] == "final" and r["family"] == family and r["size"] == size and not _finite(r["val_loss"])
        }
    )


def comera_ranks(runs: Sequence[dict[str, Any]], size: float, seed: int) -> dict[str, list[int]] | None:
    """The final ranks of CoMERA's seed-``seed`` final run at ``size`` (what the tt family trains at); a diverged
    run's ranks (its late stage stopped cutting) never count."""
    found = [
        r
        for r in runs
        if r["phase"] == "final"
        and r["family"] == "comera"
        and r["size"] == size
        and r["seed"] == seed
        and _finite(r["val_loss"])
    ]
    return found[0]["ranks_final"] if found else None


# ------------------------------------------------------------------------------------------------------
# models


def base_spec(task: str, corpus: str, seed: int, steps: int, quick: bool, overrides: Sequence[str] = ()):
    """The study spec of ``task`` on ``corpus`` with the protocol's clipping and ``--set`` ``overrides``
    (``SECTION.KEY=VALUE``; models come from :func:`task_kwargs`)."""
    from benchmarks.studies import common as study

    spec = study.study_spec(task, corpus, seed, steps, quick)
    study.apply_overrides(spec, list(overrides))
    val_every = max(1, steps // 12)
    return replace(
        spec,
        grad_clip=GRAD_CLIP,
        val_every=val_every,
        limit_val_batches=None if spec.limit_val_batches is None else 2 * spec.limit_val_batches,
    )


def with_optim(kwargs: dict[str, Any], lr: float, steps: int) -> dict[str, Any]:
    """``kwargs`` with the protocol's optimiser settings at learning rate ``lr``."""
    warmup = max(1, min(100, steps // 10))
    optim = {
        **(kwargs.get("optim") or {}),
        "lr_cores": lr,
        "lr_other": lr,
        "lr_gates": GATE_LR,
        "warmup_steps": warmup,
        "schedule": "cosine",
        "final_lr_ratio": FINAL_LR_RATIO,
    }
    return {**kwargs, "optim": optim}


def _layers(kwargs: dict[str, Any], **options: Any) -> dict[str, Any]:
    return {**kwargs, "layer_config": {**(kwargs.get("layer_config") or {}), **options}}


def family_kwargs(spec, family: str, knob: float | None, ranks: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The model arguments of ``family`` at width, rank or start rank ``knob`` (None: the spec's own)."""
    from benchmarks.studies import common as study

    kwargs = dict(spec.task_kwargs)
    if family in FULL_WIDTH:
        return _layers(kwargs, tt_linears=False, tt_embeddings=False)
    if family == "narrow":
        return _layers(study.at_width(kwargs, int(knob)), tt_linears=False, tt_embeddings=False)
    if family in ("lowrank", "cola"):
        rank = int(knob)
        low = dict(
            tt_linears=True,
            tt_embeddings=True,
            rank=rank,
            embedding_rank=rank,
            layer_ranks=None,
            low_rank_linears=".",
            low_rank_embeddings=".",
            learn_gates=False,
        )
        if family == "cola":
            low.update(bottleneck_activation="silu", activation_layers=r"(^|\.)layers\.")
        return _layers(kwargs, **low)
    if family == "comera_early":
        return family_kwargs(spec, "comera", knob)
    if family == "comera_act":
        return _layers(
            family_kwargs(spec, "comera", knob), bottleneck_activation="silu", activation_layers=r"(^|\.)layers\."
        )
    if family == "comera":
        layer = kwargs.get("layer_config") or {}
        if knob is None:
            return _layers(kwargs, tt_linears=True, tt_embeddings=True)
        # a larger start rank for the sizes the default start is already below; the head keeps its 2x share
        head = {k: 2 * int(knob) for k in (layer.get("layer_ranks") or {})}
        return _layers(
            kwargs,
            tt_linears=True,
            tt_embeddings=True,
            rank=int(knob),
            embedding_rank=int(knob),
            layer_ranks=head or None,
        )
    if family == "tt":
        if ranks is None:
            raise ValueError("the tt family needs CoMERA's final ranks")
        exact = {r"(^|\.)" + re.escape(name.split("model.", 1)[-1]) + "$": list(r[1:-1]) for name, r in ranks.items()}
        base = family_kwargs(spec, "comera", knob)
        return _layers(base, layer_ranks=exact, learn_gates=False)
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
    """The widths up to the full one at which the narrowed model builds: ``study.at_width`` keeps the head width,
    and each head's width must be even (rotary embeddings rotate channel pairs)."""
    from benchmarks.studies import common as study

    widths = []
    for width in range(2, spec.task_kwargs["d_model"] + 1):
        kwargs = study.at_width(spec.task_kwargs, width)
        if width % kwargs["num_heads"] == 0 and (width // kwargs["num_heads"]) % 2 == 0:
            widths.append(width)
    return widths


def knob_for(spec, family: str, size: float, full: int) -> float | None:
    """The width (narrow), rank (lowrank, cola) or start rank (comera, tt) of ``family`` at ``size``."""
    width = spec.task_kwargs["d_model"]
    target = full / size
    if family == "narrow":
        widths = narrow_widths(spec)
        index = smallest_at_least(
            lambda i: active_parameters(spec, family_kwargs(spec, "narrow", widths[i])), target, 0, len(widths) - 1
        )
        return widths[index]
    if family in ("lowrank", "cola"):
        return smallest_at_least(lambda r: active_parameters(spec, family_kwargs(spec, "lowrank", r)), target, 1, width)
    if family in (*COMERA, "tt"):
        # start above the target: the default rank when its model is at least 1.2x the target, else larger
        rank = int(spec.task_kwargs["layer_config"]["rank"])
        while active_parameters(spec, family_kwargs(spec, "comera", rank)) < 1.2 * target and rank < width:
            rank += rank // 2
        return rank
    return None


# ------------------------------------------------------------------------------------------------------
# one run (in a worker process)

_DATAMODULES: dict[tuple, Any] = {}


def training_loss(task, batch):
    """The loss a training step of ``task`` backpropagates: the masked LM's over its masked positions, the decoder's
    over every next token (the tasks' own loss code, without their logging)."""
    if hasattr(task, "_loss"):  # MaskedLM
        return task._loss(batch)[0]
    return task._cross_entropy(*task._logits_and_labels(batch))


def step_flops(task, batch) -> int:
    """FLOPs of one training step's forward and backward on ``batch`` (torch's FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode

    task.train()
    with FlopCounterMode(display=False) as counter:
        loss = training_loss(task, batch)
        loss.backward()
    task.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def step_memory(task, batch, galore: bool) -> dict[str, int]:
    """Peak bytes of one steady training step (forward, backward, optimiser) of ``task`` (harness.peak_memory);
    float32 weights and AdamW state (GaLore's projected state for ``galore``)."""
    import torch

    from benchmarks import harness

    task.train()
    if galore:
        from benchmarks import bench_training_step as bts
        from benchmarks.studies import llm as llm_study

        o = task.optim
        optimizer = bts.galore_optimizer(
            list(task.parameters()),
            llm_study.galore_targets(task.model),
            o.lr_other,
            o.weight_decay,
            llm_study.galore_settings(task.model.d_model),
        )
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
    from benchmarks.studies import llm as llm_study
    from comera_lightning.callbacks import ScheduledLateStage

    job = Job(**job)
    spec = base_spec(task_name, corpus, job.seed, job.steps, quick, overrides)
    key = (task_name, corpus, job.seed, quick, tuple(overrides))
    if key not in _DATAMODULES:
        _DATAMODULES.clear()
        _DATAMODULES[key] = study.build_datamodule(spec, Path(cache_dir))
    dm = _DATAMODULES[key]
    kwargs = with_optim(family_kwargs(spec, job.family, knob, ranks), job.lr, job.steps)
    method = "dense"
    if job.family == "galore":
        task = llm_study.build_task(replace(spec, task_kwargs=kwargs), "galore", kwargs)
    else:
        torch.manual_seed(job.seed)
        task = study.task_class(spec.name)(**kwargs)
    if job.family in COMERA:
        method = "comera"
        rank = {k: v for k, v in spec.rank_kwargs.items() if k != "target_size_ratio"}
        if job.family == "comera_early":
            late_stage = ScheduledLateStage(ramp_steps=max(1, round(EARLY_RAMP_FRACTION * job.steps)))
            spec = replace(spec, late_fraction=EARLY_LATE_FRACTION)
        else:  # the library's default schedule, whatever the config's
            late_stage = ScheduledLateStage()
            spec = replace(spec, late_fraction=DEFAULT_LATE_FRACTION)
        rank.update(target_compression=job.size, late_stage=late_stage)
        spec = replace(spec, rank_kwargs=rank)
    batch = next(iter(dm.val_dataloader()))  # the same shape as a training batch; leaves the training order alone
    flops_start = step_flops(task, batch)
    run = study.run_one(spec, method, "steps", dm, task=task, max_other_load=1.0)
    flops_end = step_flops(task, batch)
    late = spec.late_start_step if job.family in COMERA else job.steps
    # FLOPs: the start model's until the late stage, then the mean of start and end while ranks shrink
    train_flops = late * flops_start + (job.steps - late) * (flops_start + flops_end) / 2
    tokens_per_step = int(batch["input_ids"].numel())
    curve = [[v["step"] * tokens_per_step, v["metrics"]["val/loss"]] for v in run["validations"]]
    final = run["final"]
    record = {
        **asdict(job),
        "knob": knob,
        "tokens": job.steps * tokens_per_step,
        "params_active": int(final["params_active"]),
        "params_trainable": int(run["size_final"]["params_trainable"]),
        "val_loss": float(final["metrics"]["val/loss"]),
        "val_perplexity": float(final["metrics"]["val/perplexity"]),
        "curve": curve,
        "flops_per_step_start": flops_start,
        "flops_per_step_end": flops_end,
        "train_flops": train_flops,
        "train_s": run["train_s"],
        "median_step_s": run["median_step_s"],
        "ranks_final": run["ranks_final"] if job.family in (*COMERA, "tt") else None,
        "late_start_step": spec.late_start_step if job.family in COMERA else None,
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
    """(The sweep and check runs of the study in ``source``, which a new study at ``out`` starts from; whether the
    new study must check every rate again).

    With the same ``--set`` they fix every (family, size)'s rate, so the new study runs only finals: the same rates
    at another budget (``--steps``) or other seeds. With another ``--set`` (say more data) only the sweeps are
    taken: they choose each family's rate, which the new study checks at every size on its own data
    (``Plan(recheck=True)``), in runs of its own ``--sweep-steps``. The source must be the same task, corpus and
    learning-rate grid, and hold a finished sweep of every one of ``families`` when the data differ."""
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
        unswept = [
            f
            for f in families
            if sweep_rates({r["lr"]: r["val_loss"] for r in short if r["family"] == f}, grid)[1] is None
        ]
        if unswept:
            raise ValueError(
                f"--rates-from {source} has no finished sweep of {unswept}, and this study's --set differs from its"
                " own; finish those sweeps there first, or leave those families out"
            )
    return short, not same_data


def _union(first: Sequence[Any], second: Sequence[Any]) -> list[Any]:
    """The items of ``first`` then those of ``second`` not in it, each once, in order."""
    out: list[Any] = []
    for item in [*first, *second]:
        if item not in out:
            out.append(item)
    return out


class Study:
    """The study's JSON (``runs`` plus the protocol) and the plan that extends it, two runs at a time."""

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
        """``plan.recheck`` is set here: it holds when the study's sweeps were copied from another ``--set``."""
        from benchmarks import harness

        self.path, self.task, self.corpus, self.plan = path, task, corpus, plan
        self.overrides = list(overrides)
        self.quick, self.cache_dir = quick, cache_dir
        protocol = {
            "families": plan.families,
            "sizes": plan.sizes,
            "seeds": plan.seeds,
            "steps": plan.steps,
            "sweep_steps": plan.sweep_steps,
            "grid": plan.grid,
            "gate_lr": GATE_LR,
            "final_lr_ratio": FINAL_LR_RATIO,
            "grad_clip": GRAD_CLIP,
            "quick": quick,
            "set": self.overrides,
        }
        if path.exists():
            state = harness.read_json(path)
            old = state.get("protocol", {})
            # the final runs' length may change (each final records its steps); the sweeps' may not
            if any({"set": [], **old}.get(k) != protocol[k] for k in ("sweep_steps", "grid", "quick", "set")):
                raise ValueError(
                    f"{path} holds a study with another protocol ({ {k: old.get(k) for k in protocol} });"
                    " give another --out, or move that file away"
                )
            # a resumed invocation may ask for fewer families, sizes or seeds than the file holds: the protocol
            # lists every one asked for so far (and every family with runs of its own, not copied by --rates-from),
            # not only this invocation's
            ran = {run["family"] for run in state.get("runs", []) if "copied_from" not in run}
            asked = {*old.get("families", []), *protocol["families"], *ran}
            merged = {
                "families": [f for f in FAMILIES if f in asked] + sorted(asked - set(FAMILIES)),
                "sizes": _union(old.get("sizes", []), protocol["sizes"]),
                "seeds": _union(old.get("seeds", []), protocol["seeds"]),
            }
            self.state = {**state, "protocol": {**old, **protocol, **merged}}
        else:
            self.state = {"format": FORMAT, "task": task, "corpus": corpus, "protocol": protocol, "runs": []}
            if rates_from is not None:
                self.state["rates_from"] = rates_from.name
                self.state["runs"], recheck = short_runs_of(rates_from, path, task, corpus, protocol, plan.families)
                self.state["protocol"]["recheck"] = recheck
        plan.recheck = bool(self.state["protocol"].get("recheck", False))
        self.spec = base_spec(task, corpus, plan.seeds[0], plan.steps, quick, self.overrides)
        self.full = active_parameters(self.spec, family_kwargs(self.spec, "dense", None))
        self.state["full_dense_params"] = self.full
        self._knobs: dict[tuple[str, float], float | None] = {}

    @property
    def runs(self) -> list[dict[str, Any]]:
        return self.state["runs"]

    def knob(self, family: str, size: float) -> float | None:
        if (family, size) not in self._knobs:
            self._knobs[(family, size)] = knob_for(self.spec, family, size, self.full)
        return self._knobs[(family, size)]

    def save(self) -> None:
        from benchmarks import harness

        self.state["machine"] = harness.machine_info()
        tmp = self.path.with_suffix(".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        import json

        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.path)

    def run(self, workers: int, threads: int, deadline: float | None) -> None:
        from benchmarks.studies.common import run_pool

        run_pool(lambda: self.plan.pending(self.runs), self._submit, self._finish, workers, threads, deadline)

    def _submit(self, pool: ProcessPoolExecutor, job: Job) -> Future:
        ranks = comera_ranks(self.runs, job.size, self.plan.seeds[0]) if job.family == "tt" else None
        knob = self.knob(job.family, job.size)
        print(
            f"[{time.strftime('%H:%M:%S')}] start {job.phase} {job.family} x{job.size:g} seed "
            f"{job.seed} lr {job.lr:.3g} ({job.steps} steps, knob {knob})",
            flush=True,
        )
        args = (self.task, self.corpus, self.quick, knob, ranks, str(self.cache_dir), self.overrides)
        return pool.submit(run_job, asdict(job), *args)

    def _finish(self, job: Job, outcome: dict[str, Any] | BaseException, wall_s: float) -> None:
        if isinstance(outcome, BaseException):
            print(f"    FAILED {job}: {outcome!r}", flush=True)
            outcome = {
                **asdict(job),
                "knob": self.knob(job.family, job.size),
                "error": repr(outcome),
                "val_loss": math.nan,
                "tokens": 0,
                "params_active": 0,
                "curve": [],
            }
        self.runs.append(outcome)
        self.save()
        print(
            f"[{time.strftime('%H:%M:%S')}] done  {job.phase} {job.family} x{job.size:g} seed {job.seed}"
            f" lr {job.lr:.3g}: val loss {outcome['val_loss']:.4f}, {outcome['params_active']:,} params",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--task",
        default="lm",
        choices=("lm", "mlm"),
        help="lm: the decoder LM of configs/llm_cpu.yaml; mlm: the masked LM of the quality study (GaLore: lm only)",
    )
    parser.add_argument("--corpus", default="stdlib", help="stdlib, site:PACKAGE (installed sources) or a folder")
    parser.add_argument(
        "--families", nargs="+", default=None, choices=FAMILIES, help="default: all (without galore for mlm)"
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=float,
        default=list(SIZES),
        help="compressions of the full dense model's active parameters",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1500, help="optimiser steps of a final run")
    parser.add_argument("--sweep-steps", type=int, default=500, help="steps of a sweep or check run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--hours", type=float, default=None, help="start no run after this many hours")
    parser.add_argument("--quick", action="store_true", help="a tiny model and data: a smoke run")
    parser.add_argument(
        "--set",
        dest="overrides",
        nargs="+",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="change the study's model, data or rank settings (values read as YAML), e.g. data.max_files=null",
    )
    parser.add_argument("--out", type=Path, default=None, help="default docs/data/<task>_<corpus>.json")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "comera")
    parser.add_argument(
        "--rates-from",
        type=Path,
        default=None,
        help="start a new --out from this study's sweeps and checks, so only finals run (e.g. a longer --steps)",
    )
    args = parser.parse_args(argv)
    if args.families is None:
        args.families = [f for f in FAMILIES if args.task == "lm" or f != "galore"]
    if args.task == "mlm" and "galore" in args.families:
        parser.error("the galore family is built for the decoder (--task lm) only: leave it out of --families")
    corpus = args.corpus.replace("site:", "").replace("/", "_").strip("_") or "corpus"
    out = args.out or REPO / "docs" / "data" / f"{args.task}_{corpus}.json"
    try:
        plan = Plan(args.families, args.sizes, args.seeds, args.steps, args.sweep_steps)
        study = Study(out, args.task, args.corpus, plan, args.quick, args.cache_dir, args.rates_from, args.overrides)
    except ValueError as err:
        parser.error(str(err))
    deadline = None if args.hours is None else time.time() + 3600 * args.hours
    study.run(args.workers, args.threads, deadline)
    left = plan.pending(study.runs)
    print(f"JSON: {out} ({len(study.runs)} runs; {len(left)} runnable runs left)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
