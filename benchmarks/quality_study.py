"""Quality study at CPU scale: dense vs CoMERA training on real (code) and synthetic (CTR) data.

Studies ``mlm`` (masked-LM on the standard library), ``pairs`` (docstring/body pairs) and ``dlrm`` (synthetic
Criteo), each trained by every method from one seed on identical batches, by the protocols of ``study.py``;
``matched`` first times the dense and CoMERA steps against each other, then gives CoMERA the same wall-clock in
steps. benchmarks/README.md has the sizes; output: ``quality_<study><tag>.{json,png}`` and
``quality_study<tag>.md`` in ``--out-dir`` (a rerun resumes).

    python benchmarks/quality_study.py --wait-quiet 30      # mlm, pairs and dlrm, both protocols
    python benchmarks/quality_study.py --quick              # tiny models, 30 steps, 6 s budgets
    python benchmarks/quality_study.py --study mlm --d-model 512 --protocol matched
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import harness
import study
import torch
from study import DEFAULT_CACHE, METHODS, PROTOCOLS, StudySpec, build_task

STUDIES = ("mlm", "pairs", "dlrm")
DEFAULT_METHODS = ("dense", "comera")
DEFAULT_PROTOCOLS = ("steps", "time")

# the DLRM tables of configs/dlrm_criteo.yaml (Criteo Kaggle cardinalities capped at 100k rows)
DLRM_TABLES = [
    1460,
    583,
    100000,
    100000,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    100000,
    3194,
    27,
    14992,
    100000,
    10,
    5652,
    2173,
    4,
    100000,
    18,
    15,
    100000,
    105,
    100000,
]


def _quick(spec: StudySpec, task: dict, data: dict, rank: dict, tt_rank: int = 8) -> StudySpec:
    """``spec`` shrunk for a smoke run: 30 steps, 6 s budgets, validation every 10 steps on 4 batches."""
    layer = spec.task_kwargs["layer_config"]
    spec.task_kwargs.update(task, layer_config={**layer, "rank": tt_rank, "embedding_rank": tt_rank})
    if "optim" in spec.task_kwargs and "warmup_steps" in spec.task_kwargs["optim"]:
        spec.task_kwargs["optim"] = {**spec.task_kwargs["optim"], "warmup_steps": 5}
    spec.data_kwargs.update(data)
    spec.rank_kwargs.update(rank)
    spec.steps, spec.budget_s, spec.val_every, spec.limit_val_batches = 30, 6.0, 10, 4
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
        budget_s=120.0,
        val_every=200,
        limit_val_batches=16,
        metric="val/mlm_accuracy",
        secondary="val/loss",
        higher_is_better=True,
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


def dlrm_spec(quick: bool = False) -> StudySpec:
    """The DLRM study: configs/dlrm_criteo.yaml's tables, CPU-sized MLPs, synthetic Criteo-like rows."""
    # lr_gates 5e-3 as in the quickstart: with the config's 1e-3 an Adam step moves a gate by at most ~1e-3, so no
    # slice can reach the 0.01 threshold before step ~1000 (in a 1200-step trial the first cut came at 1050)
    task = dict(
        table_sizes=list(DLRM_TABLES),
        embedding_dim=16,
        bottom_mlp=[128, 64, 16],
        top_mlp=[128, 64],
        layer_config=dict(rank=16, embedding_rank=16, min_embedding_rows=1000),
        optim=dict(lr_cores=1e-3, lr_gates=5e-3, lr_other=1e-3),
    )
    # about one epoch in the same-steps protocol, as CTR models are trained: with several epochs over 200k rows
    # the dense tables memorised their rows (validation AUC 0.72 -> 0.69 from epoch 4 to 6 in a trial)
    data = dict(
        synthetic=True, num_samples=1_000_000, table_sizes=list(DLRM_TABLES), batch_size=1024, val_fraction=0.05
    )
    # dlrm_criteo.yaml's gamma 0.01; the late stage aims at the paper's DLRM compression (99x; the TT model starts
    # at 61x). A fifth of the size at the switch (the research code's 0.2) reached 314x within 100 steps in a
    # trial and cost 0.05 AUC
    rank = dict(gamma=0.01, target_compression=100.0, truncate_every_n_steps=25, min_dead_fraction=0.2)
    spec = StudySpec(
        "dlrm",
        task,
        data,
        rank,
        steps=1000,
        budget_s=75.0,
        val_every=100,
        limit_val_batches=20,
        metric="val/auc",
        secondary="val/logloss",
        higher_is_better=True,
        late_fraction=0.4,
    )
    if quick:
        tables = [min(s, 5000) for s in DLRM_TABLES]
        # with 5000-row tables even rank 1 everywhere stays below 100x: aim at half the size at the switch
        _quick(
            spec,
            dict(table_sizes=tables, bottom_mlp=[64, 16], top_mlp=[64]),
            dict(table_sizes=tables, num_samples=20_000, batch_size=256),
            dict(truncate_every_n_steps=5, target_compression=None, target_size_ratio=0.5),
        )
    return spec


def pairs_spec(quick: bool = False) -> StudySpec:
    """The pair task: configs/code_pairs.yaml's classifier on docstring/body pairs of the standard library.

    Two encoder layers instead of the config's six, so that three seeds of every method fit the CPU budget.
    """
    task = dict(
        vocab_size=2048,
        num_classes=3,
        d_model=128,
        num_heads=4,
        d_ff=512,
        num_layers=2,
        max_len=128,
        dropout=0.1,
        layer_config=dict(
            rank=32,
            embedding_rank=32,
            min_features=64,
            dense_layers="position_embeddings|token_type_embeddings|classifier",
        ),
        optim=dict(lr_cores=1e-3, lr_gates=5e-3, lr_other=1e-3, warmup_steps=100),
    )
    data = dict(vocab_size=2048, seq_len=128, batch_size=32)
    rank = dict(gamma=0.005, target_compression=20.0, truncate_every_n_steps=50, min_dead_fraction=0.2)
    spec = StudySpec(
        "pairs",
        task,
        data,
        rank,
        steps=2000,
        budget_s=240.0,
        val_every=200,
        limit_val_batches=20,
        metric="val/accuracy",
        secondary="val/loss",
        higher_is_better=True,
        late_fraction=0.4,
    )
    if quick:
        _quick(
            spec,
            dict(vocab_size=512, d_model=64, d_ff=128, num_layers=1, max_len=64),
            dict(vocab_size=512, seq_len=64, batch_size=16, max_files=40),
            dict(truncate_every_n_steps=5, target_compression=None, target_size_ratio=0.5),
        )
    return spec


SPECS: dict[str, Callable[[bool], StudySpec]] = {"mlm": mlm_spec, "pairs": pairs_spec, "dlrm": dlrm_spec}


def make_specs(
    study_name: str,
    quick: bool = False,
    steps: int | None = None,
    budget_s: float | None = None,
    val_every: int | None = None,
    seed: int = 0,
) -> list[StudySpec]:
    """The specs ``--study`` selects, with command-line overrides applied and checked."""
    if study_name not in (*STUDIES, "all"):
        raise ValueError(f"unknown study {study_name!r}; use one of {(*STUDIES, 'all')}")
    specs = []
    for name in STUDIES if study_name == "all" else (study_name,):
        spec = SPECS[name](quick)
        spec = replace(
            spec,
            seed=seed,
            steps=spec.steps if steps is None else steps,
            budget_s=spec.budget_s if budget_s is None else budget_s,
            val_every=spec.val_every if val_every is None else val_every,
        )
        spec.check()
        specs.append(spec)
    return specs


# ------------------------------------------------------------------------------------------------------
# the study


def baseline_metrics(spec: StudySpec, dm) -> dict[str, float]:
    """What a model without inputs scores on the same validation batches: the floor a run must beat.

    MLM: accuracy of always predicting the most frequent (non-special) training token. Pairs: of always
    predicting the most frequent training label. DLRM: log-loss of predicting the training click rate
    everywhere (AUC 0.5).
    """
    if spec.name == "dlrm":
        p = float(dm.train_dataset.tensors["labels"].float().mean())
        y = dm.val_dataset.tensors["labels"].float()
        if spec.limit_val_batches is not None:
            y = y[: spec.limit_val_batches * spec.data_kwargs["batch_size"]]
        logloss = float(-(y * math.log(p) + (1 - y) * math.log(1 - p)).mean())
        return {"train_click_rate": p, "constant_logloss": logloss, "val_rows": int(y.numel())}
    train = dm.train_dataset.tensors
    if spec.name == "mlm":
        ids = train["input_ids"].long().flatten()
        mode = int(torch.bincount(ids[~torch.isin(ids, torch.as_tensor(dm.special_ids.all()))]).argmax())
    else:
        mode = int(torch.bincount(train["labels"].long()).argmax())
    hits = total = 0
    for i, batch in enumerate(dm.val_dataloader()):
        if spec.limit_val_batches is not None and i >= spec.limit_val_batches:
            break
        labels = batch["labels"][batch["labels"] != -100]  # MLM: the masked positions only
        hits += int((labels == mode).sum())
        total += labels.numel()
    if spec.name == "mlm":
        return {"unigram_accuracy": hits / max(total, 1), "val_masked_tokens": total}
    return {"majority_accuracy": hits / max(total, 1), "val_pairs": total}


def measure_step_ratio(spec: StudySpec, dm, **timing: Any) -> dict[str, Any]:
    """Dense step time over CoMERA step time at the start of training, timed interleaved in this process
    (``timing``: :func:`harness.interleave`'s repeats, max_other_load, wait_quiet_s).

    A step is what training repeats: forward and loss on one real training batch, backward, AdamW over the
    task's parameter groups (RankAdaptation's per-step work, under a millisecond, is left out).
    """
    batch = next(iter(dm.train_dataloader()))
    steps = {}
    for method in ("dense", "comera"):
        task = build_task(spec, method)
        optimizer = task.configure_optimizers()
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer

        def step(task=task, optimizer=optimizer) -> None:
            optimizer.zero_grad(set_to_none=True)
            task.training_step(batch, 0).backward()
            optimizer.step()

        steps[method] = step
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.trainer. reference is not registered.*")
        timing = harness.interleave(steps, min_sample_s=0.5, seed=spec.seed, **timing)
    return {
        "ratio_dense_over_comera": timing.ratio("dense", "comera"),
        "paired_ratios": timing.paired_ratios("dense", "comera"),
        **timing.summary(),
    }


def run_study(
    spec: StudySpec,
    *,
    cache_dir: Path = DEFAULT_CACHE,
    protocols: tuple[str, ...] = PROTOCOLS,
    methods: tuple[str, ...] = DEFAULT_METHODS,
    max_other_load: float = 0.15,
    wait_quiet_s: float = 0.0,
    repeats: int = 5,
    log: Callable[[str], None] = print,
    progress: study.Progress | None = None,
) -> dict[str, Any]:
    """All (protocol, method) runs of ``spec``, strictly one after the other; returns the study's JSON.

    ``progress`` writes the JSON after every run, and the runs it already holds are not run again.
    """
    spec.check()
    for protocol in protocols:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}; use one of {PROTOCOLS}")
    progress = progress or study.Progress(None, spec.json())
    t0 = time.perf_counter()
    dm = study.build_datamodule(spec, cache_dir)
    data_s = time.perf_counter() - t0
    runs: list[dict[str, Any]] = progress.state.get("runs", [])
    step_ratio = progress.state.get("step_ratio")
    if "matched" in protocols and step_ratio is None:
        step_ratio = measure_step_ratio(
            spec, dm, repeats=repeats, max_other_load=max_other_load, wait_quiet_s=wait_quiet_s
        )
        log(
            f"[{spec.name}] dense step / CoMERA step = {step_ratio['ratio_dense_over_comera']:.3f} "
            f"({step_ratio['rounds_clean']}/{step_ratio['rounds_total']} clean rounds)"
        )
    fixed = {
        "study": spec.name,
        "machine": harness.machine_info(),
        "data": {"setup_s": data_s, "train_rows": len(dm.train_dataset), "val_rows": len(dm.val_dataset)},
        "baseline": baseline_metrics(spec, dm),
        "max_other_load": max_other_load,
        "step_ratio": step_ratio,
        "late_start_step": spec.late_start_step,
    }

    def save() -> dict[str, Any]:
        return progress.save(**fixed, runs=runs, summary=summarise(spec, runs), total_s=time.perf_counter() - t0)

    for protocol, method in study.pending_runs(runs, protocols, methods, progress.path, log, f"[{spec.name}]"):
        steps = None
        if protocol == "matched" and method != "dense":  # the dense run's wall-clock in CoMERA steps
            steps = max(1, round(spec.steps * step_ratio["ratio_dense_over_comera"]))
        log(f"[{spec.name}] {method} / {protocol}")
        runs.append(
            study.run_one(
                spec, method, protocol, dm, steps=steps, max_other_load=max_other_load, wait_quiet_s=wait_quiet_s
            )
        )
        log(study.run_log_line(runs[-1], spec.metric))
        save()
    return save()


def summarise(spec: StudySpec, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """CoMERA against dense per protocol: metric difference, compression, step-time ratio, data order."""
    out: dict[str, Any] = {}
    for protocol in PROTOCOLS:
        by = {r["method"]: r for r in runs if r["protocol"] == protocol}
        if "dense" not in by:
            continue
        d = by["dense"]
        for method in sorted(set(by) - {"dense"}):
            c = by[method]
            metric_d, metric_c = d["final"]["metrics"].get(spec.metric), c["final"]["metrics"].get(spec.metric)
            out[protocol if method == "comera" else f"{protocol} ({method})"] = {
                "metric_dense": metric_d,
                "metric_comera": metric_c,
                "metric_delta": None if metric_d is None or metric_c is None else metric_c - metric_d,
                "compression_comera": c["final"]["compression_ratio"],
                "step_time_ratio_dense_over_comera": (
                    d["median_step_s"] / c["median_step_s"] if d["median_step_s"] and c["median_step_s"] else None
                ),
                "steps_dense": d["steps"],
                "steps_comera": c["steps"],
                "same_data_order": d["first_batch_hash"] == c["first_batch_hash"],
            }
    return out


def markdown(result: dict[str, Any]) -> str:
    """The study's table: one row per method x protocol, the floor, then CoMERA against dense per protocol."""
    spec = result["spec"]
    metric = spec["metric"]
    table = study.runs_table(
        result["runs"],
        [
            "method",
            "protocol",
            "steps",
            "train s",
            "median step ms",
            (metric, study.metric_cell(metric)),
            (spec["secondary"], study.metric_cell(spec["secondary"])),
            "compression",
            "active params",
            "dense-equiv params",
            "other load",
        ],
    )
    lines = [f"### {result['study']}: dense vs CoMERA", "", table, ""]
    base = result["baseline"]
    if result["study"] == "mlm":
        lines.append(
            f"Floor: always predicting the most frequent token scores accuracy "
            f"{base['unigram_accuracy']:.4f} on the same {base['val_masked_tokens']} masked tokens."
        )
    elif result["study"] == "pairs":
        lines.append(
            f"Floor: always predicting the most frequent label scores accuracy "
            f"{base['majority_accuracy']:.4f} on the same {base['val_pairs']} pairs."
        )
    elif result["study"] == "dlrm":
        lines.append(
            f"Floor: predicting the training click rate ({base['train_click_rate']:.3f}) everywhere gives "
            f"log-loss {base['constant_logloss']:.4f} and AUC 0.5 on the same {base['val_rows']} rows."
        )
    for protocol, s in result["summary"].items():
        delta = s["metric_delta"]
        lines.append(
            f"- {protocol}: CoMERA {metric} {'-' if delta is None else f'{delta:+.4f}'} vs dense at "
            f"{s['compression_comera']:.2f}x compression; dense step / CoMERA step = "
            f"{harness.times(s['step_time_ratio_dense_over_comera'])}; steps {s['steps_dense']} (dense) vs "
            f"{s['steps_comera']} (CoMERA); same data order: {s['same_data_order']}"
        )
    if any(r["contended"] for r in result["runs"]):
        lines.append(
            f"- '!': other processes took more than {result['max_other_load']:.0%} of the CPUs during "
            "that run; its times (and, under the time budget, its step count) are not trustworthy."
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# entry point


def _parser():
    p = study.study_parser(__doc__)
    p.add_argument("--study", default="all", choices=[*STUDIES, "all"], help="which study to run (default all)")
    p.add_argument(
        "--protocol",
        default=["both"],
        nargs="+",
        choices=[*PROTOCOLS, "both"],
        help="which protocol(s) to run; both = steps and time",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        choices=METHODS,
        help="dense, comera (the default late stage), comera-paper (the research code's late stage), "
        "comera-norm (the scheduled late stage ranking slices by core norms)",
    )
    p.add_argument("--late-fraction", type=float, default=None, help="late stage from this share of the run")
    p.add_argument("--target-compression", type=float, default=None, help="late-stage size target")
    p.add_argument(
        "--d-model",
        type=int,
        default=None,
        help="encoder width, head width and FFN ratio kept (heads d/32, d_ff 4d); default 128",
    )
    p.add_argument(
        "--batch-size", type=harness.positive_int, default=None, help="training batch size; default the study's"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the selected studies, print their tables and write JSON, PNG and markdown into ``--out-dir``."""
    parser = _parser()
    args = study.parse(parser, argv)
    try:
        specs = make_specs(args.study, args.quick, args.steps, args.budget_s, args.val_every, args.seed)
        for spec in specs:
            if args.late_fraction is not None:
                spec.late_fraction = args.late_fraction
            if args.batch_size is not None:
                spec.data_kwargs.update(batch_size=args.batch_size)
            if args.target_compression is not None:
                spec.rank_kwargs.update(target_compression=args.target_compression)
            if args.d_model is not None:
                if "d_model" not in spec.task_kwargs:
                    raise ValueError(f"--d-model applies to the transformer studies, not {spec.name}")
                spec.task_kwargs = study.at_width(spec.task_kwargs, args.d_model)
            spec.check()
    except ValueError as err:
        parser.error(str(err))
    protocols = tuple(dict.fromkeys(p for c in args.protocol for p in (DEFAULT_PROTOCOLS if c == "both" else (c,))))
    tables = []
    for spec in specs:
        stem = f"quality_{spec.name}{args.tag}"
        partial = args.out_dir / f"{stem}.partial.json"
        try:
            progress = study.Progress(partial, spec.json())
        except ValueError as err:
            parser.error(str(err))
        progress.state["settings"] = harness.settings(args)
        result = run_study(
            spec,
            cache_dir=args.cache_dir,
            protocols=protocols,
            methods=tuple(args.methods),
            max_other_load=args.max_other_load,
            wait_quiet_s=args.wait_quiet,
            repeats=args.repeats,
            progress=progress,
        )
        tables.append(markdown(result))
        print("\n" + tables[-1], flush=True)
        fig = study.plot_curves(
            result["runs"], spec.metric, title=f"{spec.name}: dense vs CoMERA (same steps: solid, same time: dashed)"
        )
        harness.emit(args.out_dir / f"{stem}.json", result, fig=fig)
        partial.unlink(missing_ok=True)
    (args.out_dir / f"quality_study{args.tag}.md").write_text("\n\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
