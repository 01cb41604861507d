"""Decoder pre-training: dense + AdamW vs dense + GaLore vs CoMERA on ``configs/llm_cpu.yaml`` (or ``--config``).

The three train by the protocol of ``study.py`` (``steps``: the same tokens, ``time``: the same training seconds,
``matched``: the same training seconds as steps decided before training, so that learning-rate schedules run their
whole course: each method trains ``--budget-s`` over its own measured step time, and the config's warmup,
truncation interval and validation interval keep their share of the run). First their training steps are timed
interleaved with peak memory, at the config's width, at batch 1 and at ``--widths``. ``--accelerator cuda
--precision bf16-mixed`` runs it all on a GPU; ``--set data.root=stdlib`` changes one config value. GaLore needs
``pip install -e .[galore]`` (else reported as skipped). benchmarks/README.md has the details; output:
``llm_study<tag>.{json,md,png}`` in ``--out-dir`` (a rerun resumes).

    python benchmarks/llm_study.py --threads 1                         # the config's 1500 steps, both protocols
    python benchmarks/llm_study.py --protocols steps --widths --tag steps
    python benchmarks/llm_study.py --quick                             # smoke run: tiny model, a few steps
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import bench_training_step as bts
import harness
import study
import torch
import yaml
from study import StudySpec

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "llm_cpu.yaml"
METHODS = ("dense", "galore", "comera")
PROTOCOLS = ("steps", "time", "matched")
# --set SECTION.KEY=VALUE: which part of the study a config section's values go to
SECTIONS = {"model": "task_kwargs", "data": "data_kwargs", "rank": "rank_kwargs"}
GALORE_GAP, GALORE_SCALE = 200, 0.25


def spec_from_config(path: Path = CONFIG, quick: bool = False) -> StudySpec:
    """The study of a CausalLM config: its model, data and RankAdaptation settings (``quick``: a tiny version)."""
    config = yaml.safe_load(Path(path).read_text())
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
    datamodule = config["data"]["class_path"].rsplit(".", 1)[-1]
    spec = StudySpec(
        "lm",
        task,
        dict(config["data"]["init_args"]),
        rank,
        steps=steps,
        budget_s=180.0,
        val_every=int(trainer["val_check_interval"]),
        limit_val_batches=trainer.get("limit_val_batches"),
        metric="val/perplexity",
        secondary="val/loss",
        higher_is_better=False,
        late_fraction=late_fraction,
        datamodule=datamodule,
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
        spec.data_kwargs.update(vocab_size=512, seq_len=32, batch_size=8)
        if datamodule == "CodeLMDataModule":
            spec.data_kwargs.update(max_files=30, max_sequences=400)
        else:
            spec.data_kwargs.update(tokenizer_sample_mb=1.0)
        spec.rank_kwargs.update(truncate_every_n_steps=3, target_compression=None, target_size_ratio=0.5)
        spec.steps, spec.budget_s, spec.val_every, spec.limit_val_batches = 6, 2.0, 3, 2
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
    return replace(
        spec,
        steps=steps,
        val_every=max(1, round(spec.val_every * scale)),
        rank_kwargs=rank,
        task_kwargs={**spec.task_kwargs, "optim": optim},
    )


def wide_task_kwargs(spec: StudySpec, d_model: int) -> dict[str, Any]:
    """The config's decoder at another width: heads d/64, ffn 8/3 d rounded up to a multiple of 32."""
    return {
        **spec.task_kwargs,
        "d_model": d_model,
        "num_heads": max(1, d_model // 64),
        "d_ff": 32 * math.ceil(8 * d_model / 3 / 32),
    }


def galore_targets(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The decoder blocks' 2-D linear weights (attention and MLP projections): what GaLore projects."""
    return [m.weight for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]


def galore_settings(d_model: int) -> dict[str, Any]:
    """GaLore's projection at this width: rank d/4, as the GaLore paper's LLaMA runs."""
    return {"rank": max(1, d_model // 4), "update_proj_gap": GALORE_GAP, "scale": GALORE_SCALE, "proj_type": "std"}


def build_task(spec: StudySpec, method: str, task_kwargs: dict[str, Any] | None = None):
    """The LightningModule of ``method``: the same decoder, TT (comera) or dense (dense, galore)."""
    if method != "galore":
        return study.build_task(spec, method, task_kwargs)
    from comera_lightning.lit import CausalLM
    from comera_lightning.lit.base import warmup_decay_factor

    class GaLoreCausalLM(CausalLM):
        """CausalLM whose optimiser is GaLoreAdamW, with the config's warmup and schedule."""

        def configure_optimizers(self):
            o = self.optim
            optimizer = bts.galore_optimizer(
                list(self.parameters()),
                galore_targets(self.model),
                o.lr_other,
                o.weight_decay,
                galore_settings(self.model.d_model),
            )
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


def step_candidates(spec: StudySpec, task_kwargs: dict[str, Any], batch: dict[str, torch.Tensor]) -> list:
    """The three methods' training steps on ``batch`` (``bench_training_step.Candidate``s), each primed once, on the
    spec's device; forward and loss under bf16 autocast with ``precision="bf16-mixed"``, as Lightning does."""
    from comera_lightning.optim import comera_parameter_groups

    run = execution(spec)
    cands = []
    for method in METHODS:
        task = build_task(spec, "dense" if method == "galore" else method, task_kwargs).to(run.device)

        def loss(task=task) -> torch.Tensor:
            with run.autocast():
                return task._cross_entropy(*task._logits_and_labels(batch))

        o = task.optim
        if method == "galore":
            cands.append(
                bts.galore_candidate(
                    method,
                    task,
                    galore_targets(task.model),
                    loss,
                    o.lr_other,
                    o.weight_decay,
                    galore_settings(task.model.d_model),
                )
            )
            continue
        optimizer = torch.optim.AdamW(comera_parameter_groups(task, o.lr_cores, o.lr_gates, o.lr_other))
        if method == "comera":  # RankAdaptation's per-step work, around optimizer.step()
            cands.append(bts.comera_candidate(method, task, optimizer, loss, spec.rank_kwargs.get("gamma", 0.01)))
        else:
            cands.append(bts.Candidate(method, task, optimizer, bts.train_step(optimizer, loss)).prime())
    return cands


def measure_steps(
    spec: StudySpec, task_kwargs: dict[str, Any], batch: dict[str, torch.Tensor], min_sample_s: float, **timing: Any
) -> dict[str, Any]:
    """Interleaved step times, peak memory and parameters of the three methods on ``batch``
    (``bench_training_step.measure``), with their active parameters and compression."""
    from comera_lightning.nn import size_report

    batch = {k: v.to(execution(spec).device) for k, v in batch.items()}
    cands = step_candidates(spec, task_kwargs, batch)
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
        "d_model": task_kwargs["d_model"],
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


def synthetic_batch(vocab: int, batch: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ids for the width study (the step's cost does not depend on the ids)."""
    ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


# ------------------------------------------------------------------------------------------------------
# the study


def run_study(
    spec: StudySpec,
    progress: study.Progress,
    *,
    methods: tuple[str, ...] = METHODS,
    protocols: tuple[str, ...] = PROTOCOLS,
    widths: tuple[int, ...] = (1024,),
    cache_dir: Path = study.DEFAULT_CACHE,
    min_sample_s: float = 0.5,
    max_other_load: float = 0.15,
    wait_quiet_s: float = 0.0,
    repeats: int = 5,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Step/memory measurements first (interleaved), then every (protocol, method) run, one after the other;
    ``progress`` holds what a cut-off earlier call finished, and gets the study's JSON after every part."""
    spec.check()
    t0 = time.perf_counter()
    dm = study.build_datamodule(spec, cache_dir)
    if "galore" in methods and bts.import_galore()[1]:
        log(f"galore skipped: {bts.GALORE_MISSING}")
        methods = tuple(m for m in methods if m != "galore")
    fixed = {
        "machine": harness.machine_info(),
        "methods": list(methods),
        "max_other_load": max_other_load,
        "data": {"train_rows": len(dm.train_dataset), "val_rows": len(dm.val_dataset)},
    }
    steps = progress.state.get("step_measurements")
    if steps is None:
        timing = dict(repeats=repeats, max_other_load=max_other_load, wait_quiet_s=wait_quiet_s)
        batch_sizes = (spec.data_kwargs["batch_size"], 1)
        steps = []
        for width in (None, *widths):
            kwargs = spec.task_kwargs if width is None else wide_task_kwargs(spec, width)
            for size in batch_sizes:
                log(f"[step] {'config width' if width is None else f'd_model {width}'}, batch {size}")
                batch = (
                    first_rows(dm, size)
                    if width is None
                    else synthetic_batch(kwargs["vocab_size"], size, spec.data_kwargs["seq_len"], spec.seed)
                )
                steps.append(measure_steps(spec, kwargs, batch, min_sample_s, **timing))
        progress.save(**fixed, step_measurements=steps, runs=[])
    runs = progress.state.get("runs", [])
    schedule = (spec.task_kwargs.get("optim") or {}).get("schedule", "constant")
    if "time" in protocols and schedule != "constant":
        log(
            f"note: the time protocol trains up to 1,000,000 steps, so the {schedule} schedule barely decays "
            "within the budget; --protocols matched runs it to its end within the same seconds"
        )
    for protocol, method in study.pending_runs(runs, protocols, methods, progress.path, log, "[train]"):
        run_spec = spec
        if protocol == "matched":  # the budget in this method's steps, timed at the config's width and batch
            step_s = steps[0]["methods"][method]["median_s"]
            run_spec = run_length(spec, max(1, round(spec.budget_s / step_s)))
        log(f"[train] {method} / {protocol}" + (f": {run_spec.steps} steps" if protocol == "matched" else ""))
        run = study.run_one(
            run_spec,
            method,
            protocol,
            dm,
            task=build_task(run_spec, method),
            max_other_load=max_other_load,
            wait_quiet_s=wait_quiet_s,
        )
        run["tokens"] = run["steps"] * spec.data_kwargs["batch_size"] * spec.data_kwargs["seq_len"]
        runs.append(run)
        log(study.run_log_line(run, spec.metric))
        progress.save(**fixed, runs=runs)
    return progress.save(**fixed, step_measurements=steps, runs=runs, total_s=time.perf_counter() - t0)


def markdown(result: dict[str, Any]) -> str:
    """Training runs (perplexity, parameters, time) and the interleaved step/memory table."""
    config = Path(result.get("settings", {}).get("config", CONFIG)).name
    runs = study.runs_table(
        result["runs"],
        [
            "method",
            "protocol",
            "steps",
            "tokens",
            "train s",
            ("tokens/s", lambda r: f"{r['tokens'] / r['train_s']:,.0f}"),
            "median step ms",
            ("val perplexity", study.metric_cell("val/perplexity", 3)),
            ("val loss", study.metric_cell("val/loss")),
            "trainable params",
            "compression",
            "other load",
        ],
    )
    rows = []
    for s in result["step_measurements"]:
        for method, v in s["methods"].items():
            if v.get("skipped"):
                rows.append([s["d_model"], s["batch"], method, "skipped", "-", "-", "-", "-"])
                continue
            rows.append(
                [
                    s["d_model"],
                    s["batch"],
                    method,
                    harness.ms(v["median_s"]),
                    harness.mib(v["memory"]["total"]),
                    f"{v['params_trainable']:,}",
                    harness.times(v.get("dense_step_over_this", 1.0)),
                    harness.times(v.get("dense_peak_over_this", 1.0)),
                ]
            )
    steps = harness.table(
        [
            "d_model",
            "batch",
            "method",
            "step ms",
            "peak MiB",
            "trainable params",
            "dense step / this",
            "dense peak / this",
        ],
        rows,
    )
    return "\n".join(
        [
            f"### Decoder pre-training ({config}): dense + AdamW vs dense + GaLore vs CoMERA",
            "",
            runs,
            "",
            "#### Training step, interleaved in one process",
            "",
            steps,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Run the study, print its tables and write JSON, PNG and markdown into ``--out-dir``."""
    parser = study.study_parser(__doc__, repeats=(2, 5))
    parser.add_argument("--config", type=Path, default=CONFIG, help="a CausalLM config (default configs/llm_cpu.yaml)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--protocols",
        nargs="+",
        default=["steps", "time"],
        choices=PROTOCOLS,
        help="steps, time and/or matched (default: steps time)",
    )
    parser.add_argument(
        "--widths",
        type=int,
        nargs="*",
        default=None,
        help="extra d_model widths for the step timing (default 1024; quick none)",
    )
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu", help="where everything runs")
    parser.add_argument(
        "--precision",
        choices=["32-true", "bf16-mixed"],
        default="32-true",
        help="the Trainer's precision; the step timing autocasts the same way",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="change one value of the config's model, data or RankAdaptation settings (a YAML "
        "value; repeatable), e.g. --set data.root=stdlib --set rank.gamma=0.01",
    )
    args = study.parse(parser, argv)
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--accelerator cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
            "run on a GPU machine or leave --accelerator at cpu"
        )
    spec = spec_from_config(args.config, args.quick)
    spec.seed, spec.steps = args.seed, args.steps or spec.steps
    spec.budget_s, spec.val_every = args.budget_s or spec.budget_s, args.val_every or spec.val_every
    spec.accelerator, spec.precision = args.accelerator, args.precision
    widths = tuple(([] if args.quick else [1024]) if args.widths is None else args.widths)
    stem = f"llm_study{args.tag}"
    partial = args.out_dir / f"{stem}.partial.json"
    try:
        apply_overrides(spec, args.overrides)
        spec.check()
        progress = study.Progress(partial, {**spec.json(), "widths": list(widths)})
    except ValueError as err:
        parser.error(str(err))
    progress.state["settings"] = harness.settings(args)
    result = run_study(
        spec,
        progress,
        methods=tuple(args.methods),
        protocols=tuple(args.protocols),
        widths=widths,
        cache_dir=args.cache_dir,
        min_sample_s=0.05 if args.quick else 0.5,
        repeats=args.repeats,
        max_other_load=args.max_other_load,
        wait_quiet_s=args.wait_quiet,
    )
    text = markdown(result)
    print("\n" + text, flush=True)
    fig = study.plot_curves(result["runs"], "val/perplexity", compression=False, log_metric=True)
    harness.emit(args.out_dir / f"{stem}.json", result, fig=fig, markdown=text)
    partial.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
