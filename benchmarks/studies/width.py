"""The width and compute fronts: dense, CoMERA and a fixed-rank TT trained at four or more widths, one token budget.

The tuned study compares methods at one width (d_model 128). Structured layers are claimed to win elsewhere: a
structured model can be much wider for the same compute, when its init and rates are scaled for its structure.
This study trains the decoder of ``configs/llm_cpu.yaml`` on the whole standard library (tests included) at several
widths (the head width and the FFN's ratio kept), every run the same number of steps and tokens, and records what
each point costs: training FLOPs counted step by step while the ranks shrink, the training clock, the active
parameters and the peak memory of a training step. Families:

- ``dense``: the plain model at d_model ``64 .. 512`` (the standard parameterisation: one rate, torch's init);
- ``comera``: the TT model cut to a tenth of the same-width dense model's parameters by the shipped early schedule
  (late stage from 10 % of the run, reaching the target by 55 %), starting at the smallest rank (the config's 32,
  grown by half) whose model has 1.2x the target, its low-rank head at twice that rank;
- ``tt``: a TT at one uniform rank (head included), the smallest with the target's parameters, gates frozen: no
  rank adaptation, and not CoMERA's final ranks (no oracle).

The tensorised families use ``--parameterization`` (default ``mup``: per-core init and rates from each core's
fan-in, :mod:`comera_lightning.tt.parameterization`). Rates transfer across widths, as muP intends:

1. **sweep**: each family at its smallest width over a grid a factor of 2 apart, grown past an edge (at most twice);
2. **check**: at its largest width, the swept rate at /2, x1 and x2, grown past an edge the same way;
3. **transfer**: the ``tt`` family swept over the whole grid at d_model 512 and, at 128, under the other
   parameterisation too: how far the best rate moves under each (``report.py`` plots it); these run before
   the finals, which they test the parameterisation of;
4. **final**: every width at the rate interpolated between the two choices (log rate linear in log width, rounded
   to the grid's factors of 2), for every seed of ``--seeds``.

AdamW, warm-up, cosine to a tenth, clipping at 1.0, gates at 5e-3, as the tuned study. Two worker processes of one
torch thread train at once, so a run's clock is that of a machine with one other run on it; the JSON is rewritten
after every run and a rerun of the same command resumes.

    python -m benchmarks.studies.width                                  # docs/data/partial/width_stdlib.json
    python -m benchmarks.studies.width --out docs/data/width_stdlib.json --seeds 0 1 2 --seed-widths 768 \
        --seed-families comera tt                                       # extend the finished study
    python -m benchmarks.studies.width --seeds 0 1 2 --hours 2          # more seeds, stop starting runs after 2 h
    python -m benchmarks.studies.width --seeds 0 1 2 --seed-widths 128 --seed-families comera tt   # where it is close
    python -m benchmarks.studies.width --quick --out /tmp/w.json         # smoke run, a few minutes
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.studies import tuned as ts
from benchmarks.studies.driver import StudyFile, StudyJob, log

REPO = Path(__file__).resolve().parents[2]

FAMILIES = ("dense", "comera", "tt")
TENSORISED = ("comera", "tt")
WIDTHS = {"dense": (64, 128, 256, 512), "comera": (128, 256, 512, 768), "tt": (128, 256, 512, 768)}
QUICK_WIDTHS = {"dense": (16, 32), "comera": (32, 48), "tt": (32, 48)}
TARGET_COMPRESSION = 10.0  # the shipped config's: a tenth of the same-width dense model
TRANSFER_FAMILY, TRANSFER_WIDTHS = "tt", (128, 512)
QUICK_TRANSFER_WIDTHS = (32, 48)
DATA = (
    "data.include_tests=true",
    "data.max_files=null",
    "data.max_sequences=null",
    "data.max_val_sequences=640",
)
PHASES = ("sweep", "check", "transfer", "final")
# a check starts at the swept rate /2, x1 and x2 and may have to move far (dense's rate falls 8x from d 64 to 512):
# it grows past its edge this many times before a rate still at the edge is taken
CHECK_EXTENSIONS = 5


def data_settings(quick: bool) -> tuple[str, ...]:
    """The study's changes to the config's data: the whole standard library (none for a smoke run)."""
    return () if quick else DATA


@dataclass(frozen=True)
class Job(StudyJob):
    """One training run of the study."""

    phase: str
    family: str
    width: int
    parameterization: str
    seed: int
    lr: float
    steps: int


def interpolated_rate(width: int, low: tuple[int, float], high: tuple[int, float], base: float) -> float:
    """The rate at ``width`` on the line through ``low`` and ``high`` (log rate against log width), rounded to the
    nearest ``base * 2**k``."""
    (w0, lr0), (w1, lr1) = low, high
    if w0 == w1:
        return lr0
    t = (math.log(width) - math.log(w0)) / (math.log(w1) - math.log(w0))
    log_lr = math.log(lr0) + t * (math.log(lr1) - math.log(lr0))
    return base * 2.0 ** round((log_lr - math.log(base)) / math.log(2.0))


def final_widths(
    widths: Sequence[int],
    family: str,
    seed: int,
    seeds: Sequence[int],
    seed_widths: Sequence[int] | None = None,
    seed_families: Sequence[str] | None = None,
) -> list[int]:
    """The widths at which ``family`` trains a final of ``seed``: every width for the first seed; for a later one,
    those in ``seed_widths`` of the families in ``seed_families`` (None: no restriction)."""
    if seed == seeds[0]:
        return list(widths)
    if seed_families is not None and family not in seed_families:
        return []
    return [w for w in widths if seed_widths is None or w in seed_widths]


class Plan:
    """Which runs are still needed, given the finished ones (a pure function of them, so a resume decides alike)."""

    def __init__(
        self,
        families: Sequence[str],
        widths: dict[str, Sequence[int]],
        parameterization: str,
        seeds: Sequence[int],
        steps: int,
        sweep_steps: int,
        transfer_widths: Sequence[int] = TRANSFER_WIDTHS,
        grid: Sequence[float] = ts.GRID,
        seed_widths: Sequence[int] | None = None,
        seed_families: Sequence[str] | None = None,
    ) -> None:
        unknown = sorted(set(families) - set(FAMILIES))
        if unknown:
            raise ValueError(f"unknown families {unknown}; use some of {FAMILIES}")
        self.families, self.widths = list(families), {f: sorted(widths[f]) for f in families}
        if any(len(w) < 2 for w in self.widths.values()):
            raise ValueError("every family needs at least two widths: the rate is swept at one and checked at another")
        self.parameterization, self.seeds = parameterization, list(seeds)
        self.steps, self.sweep_steps, self.grid = steps, sweep_steps, list(grid)
        self.transfer_widths = list(transfer_widths)
        self.seed_widths = None if seed_widths is None else sorted(seed_widths)
        self.seed_families = None if seed_families is None else list(seed_families)

    def final_widths(self, family: str, seed: int) -> list[int]:
        return final_widths(self.widths[family], family, seed, self.seeds, self.seed_widths, self.seed_families)

    def param_of(self, family: str) -> str:
        return self.parameterization if family in TENSORISED else "standard"

    def _short(self, runs: Sequence[dict[str, Any]], phases: Sequence[str], family: str, width: int, param: str):
        return {
            r["lr"]: r["val_loss"]
            for r in runs
            if r["phase"] in phases and r["family"] == family and r["width"] == width and r["parameterization"] == param
        }

    def rates(self, runs: Sequence[dict[str, Any]], family: str) -> tuple[list[Job], dict[int, float] | None]:
        """(The short runs still needed for ``family``'s rates, its rate at every width or None while unknown)."""
        param, widths = self.param_of(family), self.widths[family]
        small, large = widths[0], widths[-1]
        done = self._short(runs, ("sweep", "transfer"), family, small, param)
        missing, best_small = ts.sweep_rates(done, self.grid)
        jobs = [Job("sweep", family, small, param, self.seeds[0], lr, self.sweep_steps) for lr in missing]
        if best_small is None:
            return jobs, None
        checked = self._short(runs, ("check", "transfer"), family, large, param)
        missing, best_large = ts.sweep_rates(checked, ts.check_rates(best_small), CHECK_EXTENSIONS)
        jobs += [Job("check", family, large, param, self.seeds[0], lr, self.sweep_steps) for lr in missing]
        if best_large is None:
            return jobs, None
        chosen = {w: interpolated_rate(w, (small, best_small), (large, best_large), self.grid[0]) for w in widths}
        return jobs, chosen

    def transfer_jobs(self, runs: Sequence[dict[str, Any]]) -> list[Job]:
        """The whole-grid sweeps of the transfer plot: both parameterisations at both transfer widths."""
        if TRANSFER_FAMILY not in self.families:
            return []
        jobs = []
        for param in ("standard", "mup"):
            for width in self.transfer_widths:
                if (width, param) == (self.widths[TRANSFER_FAMILY][0], self.param_of(TRANSFER_FAMILY)):
                    continue  # the protocol's own sweep
                done = self._short(runs, ("sweep", "check", "transfer"), TRANSFER_FAMILY, width, param)
                missing, _ = ts.sweep_rates(done, self.grid)
                jobs += [
                    Job("transfer", TRANSFER_FAMILY, width, param, self.seeds[0], lr, self.sweep_steps)
                    for lr in missing
                ]
        return jobs

    def pending(self, runs: Sequence[dict[str, Any]]) -> list[Job]:
        """Every job whose inputs exist and that has not run: the sweeps and checks, the transfer sweeps (they test the
        parameterisation the finals use), then the finals seed by seed: within a seed dense's, smallest width first,
        then the tensorised ones, largest width first."""
        jobs: list[Job] = []
        for family in self.families:
            short, chosen = self.rates(runs, family)
            jobs += short
            if chosen is not None:
                param = self.param_of(family)
                jobs += [
                    Job("final", family, w, param, seed, chosen[w], self.steps)
                    for seed in self.seeds
                    for w in self.final_widths(family, seed)
                ]
        jobs += self.transfer_jobs(runs)
        done = {Job.of(r).key for r in runs}
        todo = [j for j in dict.fromkeys(jobs) if j.key not in done]

        def priority(job: Job) -> tuple:
            if job.phase in ("sweep", "check"):
                return (0, PHASES.index(job.phase), self.families.index(job.family), job.lr)
            if job.phase == "transfer":
                return (1, job.width, job.parameterization, job.lr)
            # dense's front first, cheapest first: every tensorised final is read against it
            dense = job.family == "dense"
            return (2, self.seeds.index(job.seed), not dense, job.width if dense else -job.width, job.family)

        return sorted(todo, key=priority)


# ------------------------------------------------------------------------------------------------------
# models


def model_kwargs(spec, family: str, width: int, parameterization: str, rank: int | None) -> dict[str, Any]:
    """The decoder's arguments for ``family`` at ``width`` (``rank``: CoMERA's start rank or the TT's uniform one)."""
    from benchmarks.studies import common as study

    kwargs = study.at_width(dict(spec.task_kwargs), width)
    layer = dict(kwargs.get("layer_config") or {})
    if family == "dense":
        return {**kwargs, "layer_config": {**layer, "tt_linears": False, "tt_embeddings": False}}
    if rank is None:
        raise ValueError(f"the {family} family needs a rank")
    head = 2 * rank if family == "comera" else rank
    layer.update(
        tt_linears=True,
        tt_embeddings=True,
        rank=rank,
        embedding_rank=rank,
        layer_ranks={"lm_head": head},
        learn_gates=family == "comera",
        parameterization=parameterization,
    )
    return {**kwargs, "layer_config": layer}


def rank_for(spec, family: str, width: int, parameterization: str) -> int | None:
    """CoMERA's start rank or the TT's uniform rank at ``width`` (None for dense); see the module docstring."""
    if family == "dense":
        return None
    target = ts.active_parameters(spec, model_kwargs(spec, "dense", width, "standard", None)) / TARGET_COMPRESSION

    def count(rank: int) -> int:
        return ts.active_parameters(spec, model_kwargs(spec, family, width, parameterization, rank))

    if family == "tt":
        return ts.smallest_at_least(count, target, 1, width)
    return ts.start_rank(spec, count, target, width)


# ------------------------------------------------------------------------------------------------------
# one run (in a worker process)


def _rank_signature(task) -> tuple:
    from comera_lightning.nn import tt_layers

    return tuple(tuple(layer.ranks) for _, layer in tt_layers(task))


def flop_meter(batch):
    """A callback that counts every training step's FLOPs: measured (torch's FlopCounterMode, forward and backward
    on ``batch``) at the start and again whenever a truncation changes the stored ranks, so a run's total follows
    its ranks down instead of interpolating between the two ends."""
    from lightning.pytorch import Callback

    class FlopMeter(Callback):
        def __init__(self) -> None:
            self.changes: list[tuple[int, int]] = []  # (first step, FLOPs per step from there on)
            self._signature: tuple | None = None

        def _measure(self, trainer, pl_module) -> None:
            signature = _rank_signature(pl_module)
            if signature != self._signature:
                self._signature = signature
                self.changes.append((int(trainer.global_step), ts.step_flops(pl_module, batch)))

        def on_train_start(self, trainer, pl_module) -> None:
            self._measure(trainer, pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch_, batch_idx) -> None:
            self._measure(trainer, pl_module)  # the step just taken ran at the ranks before; the next at these

        def flops_until(self, step: int) -> float:
            total = 0.0
            for (start, per_step), (end, _) in zip(self.changes, [*self.changes[1:], (None, 0)], strict=True):
                stop = step if end is None else min(end, step)
                total += max(0, stop - start) * per_step
            return total

    return FlopMeter()


def run_job(job: dict[str, Any], rank: int | None, quick: bool, cache_dir: str) -> dict[str, Any]:
    """Train one job and return its record (a ``runs`` entry)."""
    import torch

    from benchmarks.studies import common as study

    job_ = Job(**job)
    spec = ts.base_spec("lm", "stdlib", job_.seed, job_.steps, quick, data_settings(quick))
    dm = study.worker_datamodule(spec, Path(cache_dir))
    kwargs = ts.with_optim(
        model_kwargs(spec, job_.family, job_.width, job_.parameterization, rank), job_.lr, job_.steps
    )
    spec = replace(spec, task_kwargs=kwargs)
    method = "comera" if job_.family == "comera" else "dense"
    if job_.family == "comera":
        rank_kwargs = {k: v for k, v in spec.rank_kwargs.items() if k != "target_size_ratio"}
        rank_kwargs["target_compression"] = TARGET_COMPRESSION
        spec = replace(spec, rank_kwargs=rank_kwargs)  # the config's early schedule and its start share
    torch.manual_seed(job_.seed)
    task = study.task_class(spec.name)(**kwargs)
    batch = next(iter(dm.val_dataloader()))  # a training batch's shape; leaves the training order alone
    measure_memory = job_.phase == "final" and job_.seed == 0
    memory_start = ts.step_memory(copy.deepcopy(task), batch, False) if measure_memory else None
    meter = flop_meter(batch)
    run = study.run_one(spec, method, dm, task=task, max_other_load=1.0, extra_callbacks=[meter])
    tokens_per_step = int(batch["input_ids"].numel())
    curve = [
        [v["step"] * tokens_per_step, v["metrics"]["val/loss"], meter.flops_until(v["step"]), v["train_s"]]
        for v in run["validations"]
    ]
    final = run["final"]
    record = {
        **asdict(job_),
        "rank": rank,
        "d_model": job_.width,
        "tokens": job_.steps * tokens_per_step,
        "params_active": int(final["params_active"]),
        "params_at_start": int(run["size_at_start"]["params_active"]),
        "val_loss": float(final["metrics"]["val/loss"]),
        "val_perplexity": float(final["metrics"]["val/perplexity"]),
        "curve": curve,
        "flops_per_step": meter.changes,
        "train_flops": meter.flops_until(job_.steps),
        "train_s": run["train_s"],
        "median_step_s": run["median_step_s"],
        "other_load": run["other_load"],
        "ranks_final": run["ranks_final"] if job_.family in TENSORISED else None,
        "late_start_step": spec.late_start_step if job_.family == "comera" else None,
        "first_batch_hash": run["first_batch_hash"],
    }
    if measure_memory:
        end = ts.step_memory(task, batch, False)
        record["peak_memory_start"], record["peak_memory_end"] = memory_start, end
        record["peak_memory"] = max(memory_start["total"], end["total"])  # type: ignore[index]
    return record


# ------------------------------------------------------------------------------------------------------
# the driver


class Study(StudyFile):
    """The study's JSON (``runs`` plus the protocol) and the plan that extends it."""

    FORMAT = "comera-width-study/1"
    FIXED = ("sweep_steps", "grid", "quick", "set", "parameterization", "target_compression")
    WALL_S = True

    def __init__(self, path: Path, plan: Plan, quick: bool, cache_dir: Path) -> None:
        self.quick, self.cache_dir = quick, cache_dir
        protocol = {
            "families": plan.families,
            "widths": plan.widths,
            "parameterization": plan.parameterization,
            "seeds": plan.seeds,
            "steps": plan.steps,
            "sweep_steps": plan.sweep_steps,
            "grid": plan.grid,
            "transfer_widths": plan.transfer_widths,
            "seed_widths": plan.seed_widths,
            "seed_families": plan.seed_families,
            "check_extensions": CHECK_EXTENSIONS,
            "target_compression": TARGET_COMPRESSION,
            "gate_lr": ts.GATE_LR,
            "final_lr_ratio": ts.FINAL_LR_RATIO,
            "grad_clip": ts.GRAD_CLIP,
            "quick": quick,
            "set": list(data_settings(quick)),
        }
        super().__init__(path, plan, "lm", "stdlib", protocol)
        self.spec = ts.base_spec("lm", "stdlib", plan.seeds[0], plan.steps, quick, data_settings(quick))
        self._ranks: dict[tuple[str, int, str], int | None] = {}

    def rank(self, job: Job) -> int | None:
        key = (job.family, job.width, job.parameterization)
        if key not in self._ranks:
            self._ranks[key] = rank_for(self.spec, *key)
        return self._ranks[key]

    def save(self) -> None:
        self.state["worker_hours"] = sum(float(r.get("wall_s", 0.0)) for r in self.runs) / 3600
        super().save()

    def _submit(self, pool: ProcessPoolExecutor, job: Job) -> Future:
        rank = self.rank(job)
        log(f"start {job} rank {rank}")
        return pool.submit(run_job, asdict(job), rank, self.quick, str(self.cache_dir))

    def failed(self, job: Job) -> dict[str, Any]:
        return {"rank": self.rank(job)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--parameterization", default="mup", choices=("standard", "mup"), help="of the TT families")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument(
        "--seed-widths", nargs="+", type=int, default=None, help="the widths at which seeds after the first run"
    )
    parser.add_argument(
        "--seed-families", nargs="+", default=None, choices=FAMILIES, help="the families whose later seeds run"
    )
    parser.add_argument("--steps", type=int, default=2000, help="optimiser steps of a final run (2048 tokens each)")
    parser.add_argument("--sweep-steps", type=int, default=500, help="steps of a sweep, check or transfer run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--hours", type=float, default=None, help="start no run after this many hours")
    parser.add_argument("--quick", action="store_true", help="tiny models and data: a smoke run")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "data" / "partial" / "width_stdlib.json")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "comera")
    args = parser.parse_args(argv)
    widths = QUICK_WIDTHS if args.quick else WIDTHS
    try:
        plan = Plan(
            args.families,
            {f: widths[f] for f in args.families},
            args.parameterization,
            args.seeds,
            args.steps,
            args.sweep_steps,
            QUICK_TRANSFER_WIDTHS if args.quick else TRANSFER_WIDTHS,
            seed_widths=args.seed_widths,
            seed_families=args.seed_families,
        )
        study = Study(args.out, plan, args.quick, args.cache_dir)
    except ValueError as err:
        parser.error(str(err))
    study.run(args.workers, args.hours, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
