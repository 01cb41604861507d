"""The GPU checks in one run, each in its own process under a time limit, cheapest first, the summary rewritten after
every check (a run cut off still returns what it finished):

1. ``cuda_graphs``: ``bench_cuda_graphs --quick``, fp32 and bf16-mixed: identity, speed-up at batch 1 and 32;
2. ``training_step``: ``bench_training_step`` in bf16-mixed on CUDA, with allocator peaks and profiles;
3. ``fit_resume``: a bf16 ``comera fit`` of the quickstart with the tuned study's early late stage that truncates, has
   a finite validation loss and resumes from its last checkpoint;
4. ``fsdp2``: the same under ``callbacks/fsdp2.yaml`` (one GPU), resumed from its distributed checkpoint folder;
5. ``compile``: quickstart fits eager, with ``Compile`` and with ``mode: reduce-overhead``: steps/s, graphs, breaks;
6. ``width_clock``: the width study's finals (``docs/data/width_stdlib.json``) timed on the GPU in bf16-mixed by
   ``studies.width_clock``: does CoMERA reach a lower loss than dense's front at equal training time on a GPU?

``--out`` gets ``summary.md`` and ``summary.json`` (a check that failed or timed out is FAILED), ``checks.log`` and
``results.tar.gz``. Without CUDA the checks are skipped (exit 0); ``--cpu-dry-run`` runs tiny versions on the CPU.
``benchmarks/gpu_checks.sh`` installs the carried wheels and calls this.

    python -m benchmarks.gpu_checks --out /tmp/gpu_checks                 # on a GPU machine
    python -m benchmarks.gpu_checks --cpu-dry-run --out /tmp/gpu_dry      # the plumbing, on a CPU (about 10 minutes)
    python -m benchmarks.gpu_checks --only width_clock --out /tmp/gpu_w   # some checks only (the whole deadline)
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer

from benchmarks import harness
from benchmarks.studies import width_report
from benchmarks.studies.tuned import EARLY_LATE_FRACTION, EARLY_RAMP_FRACTION

REPO = Path(__file__).resolve().parents[1]
# CoMERA's bf16 step vs dense at batch 32, dense + GaLore's peak memory over CoMERA's at batch 1, graphs vs eager
TARGET_STEP_SPEEDUP, TARGET_MEMORY_VS_GALORE, TARGET_GRAPHS_SPEEDUP = 2.0, 9.0, 1.3
FIT_STEPS, RESUME_STEPS = 200, 250  # the fit checks' first fit, then the resume (validated every 50 steps)
FIT_CHECKS = ("fit_resume", "fsdp2")
CHECK_NAMES = ("cuda_graphs", "training_step", "fit_resume", "fsdp2", "compile", "width_clock")  # in order
WIDTH_STUDY = REPO / "docs" / "data" / "width_stdlib.json"
# the compile check's fits, in order: None is the eager reference, else Compile's mode ("default": torch's)
COMPILE_VARIANTS: dict[str, str | None] = {"eager": None, "default": "default", "reduce-overhead": "reduce-overhead"}
COMPILE_STEPS, COMPILE_WARMUP = 120, 30  # dry: 40 and 10
CHECK_FAILED = ("failed", "timed out")


@dataclass
class Check:
    """One check: a name, the command lines it runs (in order, in its own folder) and its time limit."""

    name: str
    commands: list[list[str]]
    limit_s: float


def _python(command: str, *args: str) -> list[str]:
    """``python -m benchmarks.<module> ...`` of ``command`` (the module and its fixed arguments, space-separated)."""
    module, *fixed = command.split()
    return [sys.executable, "-m", f"benchmarks.{module}", *fixed, *args]


def _env() -> dict[str, str]:
    """Unbuffered logs, and the repository importable (``comera fit`` imports ``benchmarks.gpu_checks.FitProbe``)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


def checks(work: Path, dry: bool) -> list[Check]:
    """The six checks, on CUDA in bf16 (``dry``: tiny versions on the CPU)."""
    # the quickstart size only: launch-bound, where graphs matter (the base size would take minutes)
    cuda_graphs = _python("bench_cuda_graphs --quick", "--out-dir", str(work / "cuda_graphs"))
    cuda_graphs += ["--backend", "replay"] if dry else ["--repeats", "3"]
    step = _python("bench_training_step --precision bf16-mixed --profile always")
    step += ["--out-dir", str(work / "training_step")]
    step += ["--quick"] if dry else ["--device", "cuda", "--min-total-s", "5"]
    dry_flag = ["--cpu-dry-run"] if dry else []
    fit = _python("gpu_checks", "--fit-check", str(work / "fit_resume"), *dry_flag)
    fsdp2 = _python("gpu_checks", "--fit-check", str(work / "fsdp2"), "--fit-config", "callbacks/fsdp2", *dry_flag)
    compiled = _python("gpu_checks", "--compile-check", str(work / "compile"), *dry_flag)
    width = _python("studies.width_clock", "--out", str(WIDTH_STUDY), "--cache-dir", str(work / "cache"))
    width += ["--write-to", str(work / "width_clock" / WIDTH_STUDY.name), "--wait-quiet", "0"]
    # the stdlib corpus is tokenised first; dry: the smallest widths' 4 shapes, on the CPU
    width += ["--widths", "128", "--repeats", "1"] if dry else ["--device", "cuda", "--precision", "bf16-mixed"]
    # GPU limits (s) of the first five add up to the run's deadline (540); the width clock takes what they leave. A
    # fit costs 10-20 s of start-up; fit_resume and fsdp2 run two fits each, compile three and inductor's
    # compilations. dry: bf16 is emulated on a CPU, and the step check alone takes about 4 minutes on 2 cores
    return [
        Check("cuda_graphs", [cuda_graphs], 300 if dry else 120),
        Check("training_step", [step], 600 if dry else 150),
        Check("fit_resume", [fit], 300 if dry else 75),
        Check("fsdp2", [fsdp2], 300 if dry else 70),
        Check("compile", [compiled], 300 if dry else 125),
        Check("width_clock", [width], 600 if dry else 300),
    ]


# ------------------------------------------------------------------------------------------------------
# checks 3-5: comera fits of the quickstart (plain, FSDP2, compiled)


class FitProbe(Callback):
    """What a check's ``comera fit`` did, one JSON line appended to ``path`` at its end (rank 0): steps, the median
    step after ``warmup_steps``, the last losses, strategy, precision, peak CUDA memory and what ``Compile`` did."""

    def __init__(self, path: str, warmup_steps: int = 20) -> None:
        self.path = Path(path)
        self.warmup_steps = warmup_steps
        self._ends: list[float] = []
        self._val: dict[str, float] = {}
        self._val_step: int | None = None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self._ends.append(time.perf_counter())

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            self._val_step = trainer.global_step

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        steps = [b - a for a, b in pairwise(self._ends[self.warmup_steps :])]
        median = statistics.median(steps) if steps else None
        metrics = trainer.callback_metrics
        record: dict[str, Any] = {
            "global_step": trainer.global_step,
            "max_steps": trainer.max_steps,
            "steps_run": len(self._ends),
            "timed_steps": len(steps),
            "median_step_s": median,
            "steps_per_s": 1.0 / median if median else None,
            "val": self._val,
            "val_step": self._val_step,
            "val_loss": self._val.get("val/loss"),
            "train_losses": {k: float(v) for k, v in metrics.items() if "loss" in k and not k.startswith("val/")},
            "strategy": type(trainer.strategy).__name__,
            "precision": str(trainer.precision),
            "device": str(pl_module.device),
        }
        if pl_module.device.type == "cuda":
            record["peak_cuda_mb"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**20
        compiler = next((c for c in trainer.callbacks if type(c).__name__ == "Compile"), None)
        if compiler is not None:
            from torch._dynamo.utils import counters

            record["compile"] = {
                "compiled": list(compiler.compiled),
                "kwargs": {k: v for k, v in compiler.compile_kwargs.items() if k != "options"},
                "resets": compiler.resets,
                "graphs": counters["stats"]["unique_graphs"],
                "graph_breaks": sum(counters["graph_break"].values()),
                "graph_break_reasons": list(counters["graph_break"])[:5],
                "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
            }
        with open(self.path, "a") as out:
            out.write(json.dumps(record) + "\n")


def read_probes(path: Path) -> list[dict[str, Any]]:
    """The :class:`FitProbe` records of ``path``, one per finished fit, in order."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def rank_callbacks(
    steps: int, probe: Path, *, truncate: bool = True, checkpoint: bool = True, warmup_steps: int = 20
) -> str:
    """The fits' callbacks: ``RankAdaptation`` on the tuned study's ``comera_early`` schedule, truncating every 20
    steps (``truncate``; else mask mode), the planner, RankMonitor, the :class:`FitProbe`, the last ``checkpoint``."""
    ramp = {"ramp_steps": max(1, round(EARLY_RAMP_FRACTION * steps))}
    late_stage = {"class_path": "comera_lightning.callbacks.ScheduledLateStage", "init_args": ramp}
    rank = {"gamma": 0.005, "late_start_step": round(EARLY_LATE_FRACTION * steps), "target_compression": 20.0}
    rank.update(truncate_every_n_steps=20 if truncate else None, min_dead_fraction=0.2, late_stage=late_stage)
    probe_args = {"path": str(probe), "warmup_steps": warmup_steps}
    callbacks: list[dict[str, Any]] = [
        {"class_path": "RankAdaptation", "init_args": rank},
        {"class_path": "ContractionPlanner", "init_args": {"verbose": False}},
        {"class_path": "RankMonitor", "init_args": {"log_every_n_steps": 10}},
        {"class_path": "benchmarks.gpu_checks.FitProbe", "init_args": probe_args},
    ]
    if checkpoint:
        callbacks.append({"class_path": "ModelCheckpoint", "init_args": {"save_last": True}})
    return yaml.safe_dump({"trainer": {"callbacks": callbacks}}, sort_keys=False)


def fit_command(folder: Path, dry: bool, configs: Sequence[str | Path], *args: str) -> list[str]:
    """``comera fit`` of the quickstart, ``configs`` and ``args``: bf16-mixed on CUDA (``dry``: 32-true on the CPU,
    where bf16 is emulated and many times slower, 40 files), its data cached in the work folder's ``cache``."""
    cli = [sys.executable, "-m", "comera_lightning", "fit", "--config", "quickstart"]
    cli += [arg for config in configs for arg in ("--config", str(config))]
    precision, accelerator = ("32-true", "cpu") if dry else ("bf16-mixed", "cuda")
    cli += ["--trainer.precision", precision, "--trainer.accelerator", accelerator]
    cli += ["--trainer.default_root_dir", str(folder), "--data.cache_dir", str(folder.parent / "cache" / "quickstart")]
    return cli + (["--data.max_files", "40", "--data.max_sequences", "2000"] if dry else []) + list(args)


def _fit(command: list[str], folder: Path) -> float:
    """Run one fit in ``folder``; returns its wall seconds (``CalledProcessError`` when it fails)."""
    print("fit:", " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, cwd=folder, env=_env(), check=True)
    return time.perf_counter() - started


def fit_check(folder: Path, dry: bool, configs: Sequence[str] = ()) -> dict[str, Any]:
    """A quickstart fit of ``FIT_STEPS`` with :func:`rank_callbacks` and ``configs``, resumed from its last checkpoint
    to ``RESUME_STEPS``; :func:`inspect_fit` of both with their :class:`FitProbe` records go to ``fit_check.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("fit_check.json", "fit_probe.jsonl"):
        (folder / stale).unlink(missing_ok=True)
    callbacks = folder / "early_late_stage.yaml"
    callbacks.write_text(rank_callbacks(FIT_STEPS, folder / "fit_probe.jsonl"))
    validation = ("--trainer.val_check_interval", "50", "--trainer.limit_val_batches", "2")
    cli = fit_command(folder, dry, [callbacks, *configs], *validation)
    wall = _fit([*cli, "--trainer.max_steps", str(FIT_STEPS)], folder)
    first = {**inspect_fit(folder), "wall_s": wall}
    wall = _fit([*cli, "--trainer.max_steps", str(RESUME_STEPS), "--ckpt_path", first["checkpoint"]], folder)
    resumed = {**inspect_fit(folder), "wall_s": wall}
    if resumed["checkpoint"] == first["checkpoint"] and resumed["global_step"] == first["global_step"]:
        raise RuntimeError(f"the resumed fit wrote no new last checkpoint under {folder}")
    probes = read_probes(folder / "fit_probe.jsonl")
    if len(probes) != 2:
        raise RuntimeError(f"expected a FitProbe record of each of the 2 fits, found {len(probes)} under {folder}")
    first["probe"], resumed["probe"] = probes
    result = {"configs": list(configs), "first": first, "resumed": resumed}
    harness.write_json(folder / "fit_check.json", result)
    return result


def inspect_fit(folder: Path) -> dict[str, Any]:
    """Ranks, truncations and steps of the fit's last checkpoint (a ``.ckpt`` file, or a distributed checkpoint
    folder under FSDP2) against a fresh model of the same config."""
    from comera_lightning.lit import MaskedLM
    from comera_lightning.nn import tt_layers
    from comera_lightning.training.checkpoint_io import read_checkpoint

    found = sorted(folder.rglob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no last.ckpt under {folder}: the fit wrote no checkpoint")
    ckpt = read_checkpoint(found[-1])
    fresh = MaskedLM(**{k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")})
    state = ckpt["state_dict"]
    rank_state = next((v for k, v in ckpt.get("callbacks", {}).items() if "RankAdaptation" in k), {})
    ranks_now = {
        n: layer.check_core_shapes([state[f"{n}.cores.{k}"].shape for k in range(len(layer.cores))], f"{n}.")
        for n, layer in tt_layers(fresh)
    }
    return {
        "checkpoint": str(found[-1]),
        "global_step": int(ckpt["global_step"]),
        "truncations": rank_state.get("truncations"),
        "stage": rank_state.get("stage"),
        "rank_sum_start": sum(sum(layer.ranks) for _, layer in tt_layers(fresh)),
        "rank_sum_end": sum(map(sum, ranks_now.values())),
        "ranks_end": ranks_now,
    }


def compile_check(folder: Path, dry: bool) -> dict[str, Any]:
    """Quickstart fits, one per :data:`COMPILE_VARIANTS` entry (``Compile`` on inductor; ``dry``: ``aot_eager``), rank
    callbacks in mask mode (no recompilation) and no validation. Each :class:`FitProbe` record goes to
    ``compile_check.json``; a failed fit is recorded, the next runs, and the check fails at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "compile_check.json").unlink(missing_ok=True)
    steps, warmup = (40, 10) if dry else (COMPILE_STEPS, COMPILE_WARMUP)
    results: dict[str, Any] = {}
    for variant, mode in COMPILE_VARIANTS.items():
        sub = folder / variant
        sub.mkdir(exist_ok=True)
        probe = sub / "fit_probe.jsonl"
        probe.unlink(missing_ok=True)
        callbacks = sub / "callbacks.yaml"
        callbacks.write_text(rank_callbacks(steps, probe, truncate=False, checkpoint=False, warmup_steps=warmup))
        configs: list[str | Path] = [callbacks]
        if mode is not None:  # callbacks/compile.yaml with these init_args
            init = {"backend": "aot_eager" if dry else "inductor", "mode": None if mode == "default" else mode}
            compile_callback = {"class_path": "comera_lightning.training.Compile", "init_args": init}
            configs.append(sub / "compile.yaml")
            configs[-1].write_text(yaml.safe_dump({"trainer": {"callbacks+": [compile_callback]}}, sort_keys=False))
        options = {"max_steps": steps, "limit_val_batches": 0, "enable_checkpointing": "false", "logger": "false"}
        command = fit_command(sub, dry, configs, *(a for k, v in options.items() for a in (f"--trainer.{k}", str(v))))
        try:
            wall = _fit(command, sub)
        except subprocess.CalledProcessError as failure:
            results[variant] = {"mode": mode, "error": f"exit {failure.returncode}"}
        else:
            found = read_probes(probe)
            results[variant] = {"mode": mode, "wall_s": wall, **(found[-1] if found else {"error": "no FitProbe"})}
        harness.write_json(folder / "compile_check.json", results)
    failed = [v for v, r in results.items() if "error" in r]
    if failed:
        raise RuntimeError(f"compile check: {failed} did not finish: {[results[v]['error'] for v in failed]}")
    return results


# ------------------------------------------------------------------------------------------------------
# reading the checks' results


def _load(pattern: Path) -> dict | None:
    """The last JSON file matching ``pattern`` (a glob), None when there is none."""
    paths = sorted(glob.glob(str(pattern)))
    return json.loads(Path(paths[-1]).read_text()) if paths else None


def read_results(work: Path) -> dict[str, Any]:
    """The targets and headline numbers from what the checks wrote (missing parts stay None)."""
    out: dict[str, Any] = {}
    graphs = _load(work / "cuda_graphs" / "cuda_graphs.json")
    if graphs and not graphs.get("skipped"):
        timing = graphs.get("timing", [])
        out["cuda_graphs_identical"] = all(c["identical"] for c in graphs["identity"])
        out["cuda_graphs_speedup_batch1"] = min((t["speedup"] for t in timing if t.get("batch") == 1), default=None)
        names = [f"{t['size']} {t['precision']} batch {t.get('batch')}" for t in timing]
        out["cuda_graphs_speedups"] = {n: t["speedup"] for n, t in zip(names, timing, strict=True)}
    step = _load(work / "training_step" / "training_step*.json")
    if step:
        results = step["results"]
        realistic = max(results, key=int)
        out["step_speedup_dense_over_comera"] = results[realistic]["ratios"]["time dense/CoMERA"]
        out["step_batch"] = int(realistic)
        if "1" in results:
            # MemTracker's peak of the candidate's own live tensors (the measure of every CPU row): the allocator's
            # max_memory_allocated counts the other candidates resident beside it (kept in the archive)
            cands = results["1"]["candidates"]
            peak = {n: e["memory"]["total"] for n, e in cands.items() if not e.get("skipped")}
            galore, comera = peak.get("dense+GaLore"), peak.get("CoMERA r30")
            out["memory_galore_over_comera_batch1"] = galore / comera if galore and comera else None
        out["step_profiles"] = {b: p.get("why") for b, p in step.get("profiles", {}).items()}
    for name, file in (*((n, "fit_check.json") for n in FIT_CHECKS), ("compile", "compile_check.json")):
        if (work / name / file).exists():
            out[name] = harness.read_json(work / name / file)
    width = _load(work / "width_clock" / WIDTH_STUDY.name)
    if width and "clock_alone" in width:
        out["width_step_s"] = width["clock_alone"]["step_s"]
        against = width_report.compare(width, "comera", "train_s_alone")
        keys = ("width", "loss", "dense", "wins")
        out["width_comera_at_equal_time"] = [dict(zip(keys, row, strict=True)) for row in against]
    return out


def _judged(verdict: str, check: str, status: dict[str, dict]) -> str:
    """``verdict``, or FAILED when ``check`` failed or timed out in this run (n/a when it did not run): a row never
    passes on what a failed check, or an earlier run in the same folder, left behind."""
    state = status.get(check, {}).get("status")
    if state in CHECK_FAILED:
        return f"FAILED ({state})"
    return "n/a" if state is not None and state.startswith("not run") else verdict


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def fit_row(fit: dict[str, Any]) -> tuple[str, str]:
    """Measured and verdict of a fit check's ``fit_check.json``: ranks shrank, truncations happened, both fits'
    final validation losses are finite, and the resume went on past the first fit's steps."""
    if not fit:
        return "-", "n/a"
    first, resumed = fit["first"], fit["resumed"]
    losses = [(part.get("probe") or {}).get("val_loss") for part in (first, resumed)]
    ok = (
        (first.get("truncations") or 0) > 0
        and first["rank_sum_end"] < first["rank_sum_start"]
        and resumed["global_step"] > first["global_step"]
        and all(_finite(v) for v in losses)
    )
    shown = ", ".join(f"{v:.3f}" if _finite(v) else str(v) for v in losses)
    measured = (
        f"rank sum {first['rank_sum_start']} -> {first['rank_sum_end']}, {first['truncations']} truncations by "
        f"step {first['global_step']}, val loss {shown}, resumed to step {resumed['global_step']}"
    )
    return measured, "met" if ok else "MISSED"


def compile_rows(compiled: dict[str, Any], status: dict[str, dict]) -> list[list[str]]:
    """A row per compiled variant: it finished and torch compiled graphs (the verdict; 0 graphs: the compiled
    modules never ran through their forward); its steps/s against the eager fit's, graph, break and skip counts."""
    eager = compiled.get("eager") or {}
    rows = []
    for variant in [v for v, mode in COMPILE_VARIANTS.items() if mode is not None]:
        run = compiled.get(variant)
        label = f"Compile ({variant} mode): the bf16 fit finishes; steps/s against eager"
        if not run or "error" in run:
            rows.append([label, run["error"], "FAILED"] if run else [label, "-", _judged("n/a", "compile", status)])
            continue
        ratio = harness.ratio(run.get("steps_per_s") or None, eager.get("steps_per_s") or None)
        info = run.get("compile") or {}
        measured = (
            f"{harness.times(ratio)} eager's steps/s ({run.get('steps_per_s') or 0:.1f} vs "
            f"{eager.get('steps_per_s') or 0:.1f}), {run.get('global_step')} steps, {info.get('graphs')} graphs, "
            f"{info.get('graph_breaks')} breaks, {info.get('cudagraph_skips')} CUDA-graph skips, "
            f"{info.get('resets')} resets"
        )
        finished = run.get("global_step") == run.get("max_steps")
        rows.append([label, measured, "met" if finished and info.get("graphs") else "MISSED"])
    return rows


def summary_markdown(results: dict[str, Any], status: dict[str, dict], machine: dict) -> str:
    """The summary: what ran, then the targets with verdicts (FAILED where the check failed)."""
    rows = [[name, s["status"], f"{s['wall_s']:.0f} s", s.get("detail", "")] for name, s in status.items()]
    where = machine.get("cuda") or f"no GPU ({machine.get('cpu', '')})"
    lines = [f"## GPU checks on {where}", "", harness.table("check|status|wall|detail", rows), ""]
    width_rows = results.get("width_comera_at_equal_time") or []
    wins = [r["wins"] for r in width_rows if r["wins"] is not None]  # None: outside dense's range, not judged
    width = "n/a" if not wins else "met" if any(wins) else "MISSED"
    width_measured = "; ".join(width_report.beside_dense(r["width"], r["loss"], r["dense"]) for r in width_rows) or "-"
    fit_what = "ranks shrink, truncations, val loss finite, the checkpoint"
    keys = ("step_speedup_dense_over_comera", "memory_galore_over_comera_batch1", "cuda_graphs_speedup_batch1")
    step, memory, graphs = (results.get(k) for k in keys)
    step_what = f"CoMERA step >= 2x faster than dense (bf16, batch {results.get('step_batch', 32)})"
    memory_what = "CoMERA >= 9x less peak memory than dense + GaLore (batch 1)"
    graphs_what = "CUDA graphs >= 1.3x faster than eager (batch 1)"
    targets = [  # (target, measured, verdict, the check that measures it)
        (step_what, harness.times(step), harness.verdict(step, TARGET_STEP_SPEEDUP), "training_step"),
        (memory_what, harness.times(memory), harness.verdict(memory, TARGET_MEMORY_VS_GALORE), "training_step"),
        (graphs_what, harness.times(graphs), harness.verdict(graphs, TARGET_GRAPHS_SPEEDUP), "cuda_graphs"),
        (f"bf16 fit, early late stage: {fit_what} resumes", *fit_row(results.get("fit_resume") or {}), "fit_resume"),
        (f"FSDP2 on one GPU (bf16): {fit_what} folder resumes", *fit_row(results.get("fsdp2") or {}), "fsdp2"),
        ("width study, timed on this GPU: CoMERA below dense at equal time", width_measured, width, "width_clock"),
    ]
    rows = [[target, measured, _judged(judged, check, status)] for target, measured, judged, check in targets]
    rows[5:5] = compile_rows(results.get("compile") or {}, status)
    lines += [harness.table("target|measured|verdict", rows)]
    if results.get("width_step_s"):
        steps = ", ".join(f"{name} {harness.ms(seconds)} ms" for name, seconds in results["width_step_s"].items())
        lines += ["", f"The width study's training steps on this GPU: {steps}"]
    for batch, why in (results.get("step_profiles") or {}).items():
        lines += ["", f"Training-step profile at batch {batch}: {why}"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------
# running


def _run(check: Check, folder: Path, stop_at: float, log: Callable[[str], None]) -> tuple[str, str]:
    """Run ``check``'s commands in ``folder`` until one fails or ``stop_at``; returns ``(state, detail)``."""
    t0 = time.perf_counter()
    with open(folder / "log.txt", "w") as out_log:
        for command in check.commands:
            log(f"{check.name}: {' '.join(command)}")
            # its own process group: a check stopped at its limit takes its children (a fit, loader workers)
            proc = subprocess.Popen(
                command, cwd=folder, env=_env(), stdout=out_log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=max(stop_at - time.perf_counter(), 1.0))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return "timed out", f"after {time.perf_counter() - t0:.0f} s"
            if rc != 0:
                return "failed", f"exit {rc}: see {check.name}/log.txt"
    return "ok", ""


def run_checks(
    out: Path,
    dry: bool,
    deadline_s: float,
    log: Callable[[str], None],
    only: Sequence[str] | None = None,
) -> dict[str, dict]:
    """Run every check (or those named in ``only``) in order within ``deadline_s``, rewriting the summary after
    each; returns their status."""
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    status: dict[str, dict] = {}
    machine = harness.machine_info()
    for check in checks(work, dry):
        if only is not None and check.name not in only:
            continue
        left = deadline_s - (time.perf_counter() - started)
        folder = work / check.name
        folder.mkdir(parents=True, exist_ok=True)
        if left < 30:
            status[check.name] = {"status": "not run (deadline)", "wall_s": 0.0}
            log(f"{check.name}: not run, {left:.0f} s left of the deadline")
            continue
        t0 = time.perf_counter()
        state, detail = _run(check, folder, t0 + min(check.limit_s, left), log)
        status[check.name] = {"status": state, "wall_s": time.perf_counter() - t0, "detail": detail}
        log(f"{check.name}: {state} in {status[check.name]['wall_s']:.0f} s {detail}")
        write_summary(out, work, status, machine)
    return status


def _worth_keeping(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """The archive's filter: results and logs, not checkpoints, weights or data caches."""
    name = info.name
    if name.endswith((".ckpt", ".safetensors", ".bin", ".pt")) or "/cache" in name or "/.cache" in name:
        return None
    return info


def write_summary(out: Path, work: Path, status: dict[str, dict], machine: dict) -> None:
    """summary.json, summary.md and results.tar.gz from what the checks wrote so far."""
    results = read_results(work)
    harness.write_json(out / "summary.json", {"machine": machine, "status": status, "results": results})
    (out / "summary.md").write_text(summary_markdown(results, status, machine))
    partial = out / "results.tar.gz.tmp"
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(work, arcname="gpu_checks", filter=_worth_keeping)
    partial.replace(out / "results.tar.gz")


def main(argv: list[str] | None = None) -> int:
    """Run the checks (or skip them without CUDA); exit 1 when a check failed or timed out."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    out = Path(os.environ.get("OUT") or REPO / "benchmarks" / "results" / "gpu_checks")
    add = parser.add_argument
    add("--out", type=Path, default=out, help="summary and archive (default $OUT, else %(default)s)")
    add("--cpu-dry-run", action="store_true", help="tiny versions of every check on the CPU")
    add("--only", nargs="+", choices=CHECK_NAMES, default=None, help="these checks only, in order")
    deadline = "every check ends by then; the last takes what the others leave (default 540; dry run 2100)"
    add("--deadline-s", type=float, default=None, help=deadline)
    # the fit checks (3: plain, 4: --fit-config callbacks/fsdp2) and the compile check (5), each in its own process
    add("--fit-check", type=Path, default=None, help=argparse.SUPPRESS)
    add("--fit-config", action="append", default=[], help=argparse.SUPPRESS)
    add("--compile-check", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fit_check is not None:
        fit_check(args.fit_check, args.cpu_dry_run, args.fit_config)
        return 0
    if args.compile_check is not None:
        compile_check(args.compile_check, args.cpu_dry_run)
        return 0
    if args.deadline_s is None:
        args.deadline_s = 2100.0 if args.cpu_dry_run else 540.0
    if args.deadline_s <= 0:
        parser.error(f"--deadline-s must be a positive number of seconds, got {args.deadline_s}")
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "checks.log", "a") as log_file:

        def log(line: str) -> None:
            stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
            print(stamped, flush=True)
            log_file.write(stamped + "\n")
            log_file.flush()

        if not torch.cuda.is_available() and not args.cpu_dry_run:
            log("no CUDA device: skipped (torch.cuda.is_available() is False); --cpu-dry-run tests the plumbing")
            harness.write_json(args.out / "summary.json", {"skipped": True, "machine": harness.machine_info()})
            return 0
        status = run_checks(args.out, args.cpu_dry_run, args.deadline_s, log, args.only)
    print("\n" + (args.out / "summary.md").read_text())
    return 0 if all(s["status"] == "ok" for s in status.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
