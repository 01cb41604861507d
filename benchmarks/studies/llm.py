"""Decoder pre-training: dense + AdamW, dense + GaLore and CoMERA on a CausalLM config, at equal tokens or at equal
training seconds (the GPU checks' ``llm_60m`` comparison).

The methods' training steps are timed interleaved, with their peak memory, at the config's batch and at batch 1; then
each method trains from one seed on the same batches by a protocol: ``steps`` (the config's: the same tokens) or
``matched`` (``--budget-s`` training seconds as a step count fixed before training from the step just timed, the
config's intervals scaled with it, :func:`run_length`). GaLore needs ``pip install -e .[galore]`` (else skipped).
Writes ``llm_study<tag>.{json,md}`` to ``--out-dir``; the JSON after every part, and a rerun resumes.

    python -m benchmarks.studies.llm --protocols steps                # configs/llm_cpu.yaml, the same tokens
    python -m benchmarks.studies.llm --config configs/llm_60m.yaml --protocols matched --budget-s 75 \
        --methods dense comera --accelerator cuda --precision bf16-mixed --set data.root=stdlib
    python -m benchmarks.studies.llm --quick                          # smoke run: tiny model, a few steps
"""

from __future__ import annotations

import argparse
import logging
import math
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import bench_training_step as bts
from benchmarks import harness
from benchmarks.studies import common as study
from benchmarks.studies.common import CONFIG, PROTOCOLS, StudySpec

METHODS = ("dense", "galore", "comera")
GALORE_GAP, GALORE_SCALE = 200, 0.25


def run_length(spec: StudySpec, steps: int) -> StudySpec:
    """``spec`` resized to ``steps``: warmup, truncation interval and validation interval keep their share of the run
    (the late stage starts at ``late_fraction`` of it anyway)."""
    scale = steps / spec.steps
    optim = dict(spec.task_kwargs.get("optim") or {})
    if optim.get("warmup_steps"):
        optim["warmup_steps"] = max(1, round(optim["warmup_steps"] * scale))
    rank = dict(spec.rank_kwargs)
    if rank.get("truncate_every_n_steps"):
        rank["truncate_every_n_steps"] = max(1, round(rank["truncate_every_n_steps"] * scale))
    val_every = max(1, round(spec.val_every * scale))
    return replace(
        spec, steps=steps, val_every=val_every, rank_kwargs=rank, task_kwargs={**spec.task_kwargs, "optim": optim}
    )


def galore_targets(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The decoder blocks' 2-D linear weights (attention and MLP projections): what GaLore projects."""
    return [m.weight for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]


def galore_settings(d_model: int) -> dict[str, Any]:
    """GaLore's projection at this width: rank d/4, as the GaLore paper's LLaMA runs."""
    return {"rank": max(1, d_model // 4), "update_proj_gap": GALORE_GAP, "scale": GALORE_SCALE, "proj_type": "std"}


def galore_optimizer(task) -> torch.optim.Optimizer | None:
    """``GaLoreAdamW`` over a decoder task's parameters at its optimiser settings (None without galore-torch)."""
    o, model = task.optim, task.model
    return bts.galore_optimizer(
        list(task.parameters()), galore_targets(model), o.lr_other, o.weight_decay, galore_settings(model.d_model)
    )


def build_task(spec: StudySpec, method: str, task_kwargs: dict[str, Any] | None = None):
    """The LightningModule of ``method``: the same decoder, TT (comera) or dense (dense, galore)."""
    if method != "galore":
        return study.build_task(spec, method, task_kwargs)
    from comera_lightning.lit import CausalLM
    from comera_lightning.lit.base import warmup_decay_factor

    class GaLoreCausalLM(CausalLM):
        """CausalLM whose optimiser is GaLoreAdamW, with the config's warmup and schedule."""

        def configure_optimizers(self):
            o, optimizer = self.optim, galore_optimizer(self)
            if o.warmup_steps == 0 and o.schedule == "constant":
                return optimizer
            total = 1 if o.schedule == "constant" else max(1, int(self.trainer.estimated_stepping_batches))
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: warmup_decay_factor(step, o.warmup_steps, total, o.schedule, o.final_lr_ratio)
            )
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    torch.manual_seed(spec.seed)
    kwargs = spec.task_kwargs if task_kwargs is None else task_kwargs
    return GaLoreCausalLM(**study.with_layer_options(kwargs, tt_linears=False, tt_embeddings=False))


# ------------------------------------------------------------------------------------------------------
# step time and memory, interleaved in this process


def execution(spec: StudySpec) -> bts.Execution:
    """Where and in which precision the spec trains, for the step timing."""
    return bts.Execution("cuda" if spec.accelerator in ("cuda", "gpu") else "cpu", spec.precision)


def step_candidates(spec: StudySpec, batch: dict[str, torch.Tensor]) -> list:
    """The three methods' training steps on ``batch`` (``bench_training_step.Candidate``s), each primed once, on the
    spec's device; forward and loss under bf16 autocast with ``precision="bf16-mixed"``, as Lightning does."""
    from comera_lightning.optim import comera_parameter_groups

    run = execution(spec)
    cands = []
    for method in METHODS:
        task = build_task(spec, "dense" if method == "galore" else method).to(run.device)

        def loss(task=task) -> torch.Tensor:
            with run.autocast():
                return task._cross_entropy(*task._logits_and_labels(batch))

        o = task.optim
        if method == "galore":
            settings = galore_settings(task.model.d_model)
            targets = galore_targets(task.model)
            cands.append(bts.galore_candidate(method, task, targets, loss, o.lr_other, o.weight_decay, settings))
            continue
        optimizer = torch.optim.AdamW(comera_parameter_groups(task, o.lr_cores, o.lr_gates, o.lr_other))
        if method == "comera":  # RankAdaptation's per-step work, around optimizer.step()
            cands.append(bts.comera_candidate(method, task, optimizer, loss, spec.rank_kwargs.get("gamma", 0.01)))
        else:
            cands.append(bts.Candidate(method, task, optimizer, bts.train_step(optimizer, loss)).prime())
    return cands


def measure_steps(spec: StudySpec, batch: dict[str, torch.Tensor], min_sample_s: float, **timing) -> dict[str, Any]:
    """Interleaved step times, peak memory, active parameters and compression of the three methods on ``batch``
    (``bench_training_step.measure``)."""
    from comera_lightning.nn import size_report

    batch = {k: v.to(execution(spec).device) for k, v in batch.items()}
    cands = step_candidates(spec, batch)
    timing, methods = bts.measure(cands, batch.values(), seed=spec.seed, min_sample_s=min_sample_s, **timing)
    for c in cands:
        if not c.skipped:
            report, entry = size_report(c.model), methods[c.name]
            entry.update(
                params_trainable=entry.pop("parameters"),
                params_active=report.active_parameters,
                compression_ratio=report.compression_ratio,
                dense_step_over_this=timing.ratio("dense", c.name),
                dense_peak_over_this=methods["dense"]["memory"]["total"] / entry["memory"]["total"],
            )
    out: dict[str, Any] = {
        "batch": int(batch["input_ids"].shape[0]),
        "seq_len": int(batch["input_ids"].shape[1]),
        "d_model": spec.task_kwargs["d_model"],
        "timing": timing.summary(),
        "methods": methods,
    }
    if not methods["galore"]["skipped"]:
        out["galore_over_comera"] = {
            "step": timing.ratio("galore", "comera"),
            "peak_memory": methods["galore"]["memory"]["total"] / methods["comera"]["memory"]["total"],
        }
    return out


def first_rows(dm, size: int) -> dict[str, torch.Tensor]:
    """The first ``size`` training sequences as a batch."""
    rows = dm.train_dataset.__getitems__(list(range(size)))
    return {"input_ids": rows["input_ids"].long(), "labels": rows["labels"].long()}


# ------------------------------------------------------------------------------------------------------
# the study


def run_study(spec: StudySpec, state: dict[str, Any], path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Step/memory measurements first (interleaved), then every (protocol, method) run, one after the other;
    ``state`` holds what a cut-off earlier call finished, and goes to ``path`` after every part."""

    def save(**fields: Any) -> dict[str, Any]:
        state.update(fields)
        harness.write_json(path, state)
        return state

    t0 = time.perf_counter()
    dm = study.build_datamodule(spec, args.cache_dir)
    methods = tuple(args.methods)
    if "galore" in methods and bts.import_galore()[1]:
        print(f"galore skipped: {bts.GALORE_MISSING}")
        methods = tuple(m for m in methods if m != "galore")
    fixed = {"machine": harness.machine_info(), "methods": list(methods), "max_other_load": args.max_other_load}
    fixed["data"] = {"train_rows": len(dm.train_dataset), "val_rows": len(dm.val_dataset)}
    steps = state.get("step_measurements")
    if steps is None:
        steps = []
        for size in (spec.data_kwargs["batch_size"], 1):
            print(f"[step] batch {size}")
            min_sample_s = 0.05 if args.quick else 0.5
            steps.append(measure_steps(spec, first_rows(dm, size), min_sample_s, **harness.timing_options(args)))
        save(**fixed, step_measurements=steps, runs=[])
    runs = state.get("runs", [])
    done = {(r["protocol"], r["method"]) for r in runs}
    for protocol, method in [(p, m) for p in args.protocols for m in methods if (p, m) not in done]:
        run_spec = spec
        if protocol == "matched":  # the budget in this method's steps, timed at the config's width and batch
            run_spec = run_length(spec, max(1, round(spec.budget_s / steps[0]["methods"][method]["median_s"])))
        print(f"[train] {method} / {protocol}" + (f": {run_spec.steps} steps" if protocol == "matched" else ""))
        quiet = {"max_other_load": args.max_other_load, "wait_quiet_s": args.wait_quiet}
        run = study.run_one(run_spec, method, protocol, dm, task=build_task(run_spec, method), **quiet)
        run["tokens"] = run["steps"] * spec.data_kwargs["batch_size"] * spec.data_kwargs["seq_len"]
        runs.append(run)
        print(
            f"    {run['steps']} steps, {run['train_s']:.1f} s training, {spec.metric} "
            f"{run['final']['metrics'].get(spec.metric, math.nan):.4f}, compression "
            f"{run['final']['compression_ratio']:.2f}x"
        )
        save(**fixed, runs=runs)
    return save(**fixed, step_measurements=steps, runs=runs, total_s=time.perf_counter() - t0)


def markdown(result: dict[str, Any]) -> str:
    """Training runs (perplexity, parameters, time) and the interleaved step/memory table."""
    config = Path(result.get("settings", {}).get("config", CONFIG)).name
    runs = []
    for r in result["runs"]:
        final, metrics = r["final"], r["final"]["metrics"]
        cells = [r["method"], r["protocol"], r["steps"], f"{r['tokens']:,}", f"{r['train_s']:.1f}"]
        cells += [f"{r['tokens'] / r['train_s']:,.0f}", harness.ms(r["median_step_s"]) if r["median_step_s"] else "-"]
        cells += [f"{metrics.get('val/perplexity', math.nan):.3f}", f"{metrics.get('val/loss', math.nan):.4f}"]
        cells += [f"{final['params_trainable']:,}", f"{final['compression_ratio']:.2f}x"]
        load = f"{r['other_load']:.0%}" if r["other_load"] is not None else "n/a"
        runs.append([*cells, load + (" !" if r["contended"] else "")])
    steps = []
    for s in result["step_measurements"]:
        for method, v in s["methods"].items():
            cells = ["skipped", "-", "-", "-", "-"]
            if not v.get("skipped"):
                cells = [harness.ms(v["median_s"]), harness.mib(v["memory"]["total"]), f"{v['params_trainable']:,}"]
                cells += [harness.times(v.get(f"dense_{k}_over_this", 1.0)) for k in ("step", "peak")]
            steps.append([s["d_model"], s["batch"], method, *cells])
    run_headers = "method|protocol|steps|tokens|train s|tokens/s|median step ms|val perplexity|val loss|"
    run_headers += "trainable params|compression|other load"
    step_headers = "d_model|batch|method|step ms|peak MiB|trainable params|dense step / this|dense peak / this"
    title = f"### Decoder pre-training ({config}): dense + AdamW vs dense + GaLore vs CoMERA"
    steps_title = "#### Training step, interleaved in one process"
    return "\n\n".join([title, harness.table(run_headers, runs), steps_title, harness.table(step_headers, steps)])


def build_parser() -> argparse.ArgumentParser:
    p = harness.bench_parser(__doc__, repeats=(2, 5))
    add = p.add_argument
    add("--config", type=Path, default=CONFIG, help="a CausalLM config (default configs/llm_cpu.yaml)")
    add("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add("--protocols", nargs="+", default=["steps"], choices=PROTOCOLS, help="default: steps")
    add("--seed", type=int, default=0)
    add("--steps", type=harness.positive_int, default=None, help="optimiser steps (default: the config's)")
    add("--budget-s", type=float, default=None, help="training seconds of the matched protocol")
    add("--tag", default="", help="suffix of the output files (e.g. the seed)")
    add("--cache-dir", type=Path, default=study.DEFAULT_CACHE, help="tokenizer / encoded corpus cache")
    add("--accelerator", choices=["cpu", "cuda"], default="cpu", help="where everything runs")
    add("--precision", choices=["32-true", "bf16-mixed"], default="32-true", help="also the step timing's")
    help_set = "one value (YAML) of the config's model, data or rank settings; repeatable, e.g. --set data.root=stdlib"
    add("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help_set)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the study, print its tables and write JSON and markdown into ``--out-dir``."""
    parser = build_parser()
    args = harness.parse(parser, argv)
    if args.budget_s is not None and not (math.isfinite(args.budget_s) and args.budget_s > 0):
        parser.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--accelerator cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
            "run on a GPU machine or leave --accelerator at cpu"
        )
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "comera_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)  # Lightning's banners stay out of the report
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
    spec = study.spec_from_config(args.config, args.quick)
    spec.seed, spec.steps, spec.budget_s = args.seed, args.steps or spec.steps, args.budget_s or spec.budget_s
    spec.accelerator, spec.precision = args.accelerator, args.precision
    stem = f"llm_study{args.tag}"
    partial = args.out_dir / f"{stem}.partial.json"
    try:
        study.apply_overrides(spec, args.overrides)
        spec.check()
    except ValueError as err:
        parser.error(str(err))
    state = harness.read_json(partial) if partial.exists() else {}  # a rerun of the same spec resumes
    if state and state.get("spec") != spec.json():
        parser.error(f"{partial} holds runs of another spec: delete it, or write elsewhere (--out-dir, --tag)")
    result = run_study(spec, {**state, "spec": spec.json(), "settings": harness.settings(args)}, partial, args)
    text = markdown(result)
    print("\n" + text, flush=True)
    harness.emit(args.out_dir / f"{stem}.json", result, markdown=text)
    partial.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
