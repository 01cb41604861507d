"""Quality at equal size: CoMERA against the models a user would train instead (a Pareto study).

Three families trained by the protocol of ``study.py`` (one seed, the same batches and steps): ``dense:W`` (the
architecture narrowed to d_model W), ``lowrank:R`` (plain ``A B`` factors of rank R) and ``comera:T`` (cut towards
T-times compression; ``:floor=F``, ``:head=R``), each at its active parameters at the end. ``--aggregate`` reads
several seeds' JSONs into the table, the plot and the comparison with each baseline curve at the same size.
benchmarks/README.md and docs/results.md ("Quality at equal size") have the details.

    python benchmarks/pareto_study.py --task mlm --seed 0 --threads 1
    python benchmarks/pareto_study.py --quick                                    # smoke run, under a minute
    python benchmarks/pareto_study.py --aggregate results/pareto/pareto_mlm_stdlib_s*.json --out results/mlm
    bash benchmarks/pareto_seeds.sh                                              # the study of docs/results.md
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import harness
import quality_study as qs
import study
import torch
from llm_study import spec_from_config
from study import StudySpec

TASKS = ("mlm", "lm")
KINDS = ("dense", "lowrank", "comera")
# the full dense model first (the reference of "free compression"), then each family across CoMERA's range
DEFAULT_POINTS = [
    "dense:128",
    "comera:5",
    "comera:10",
    "comera:20",
    "comera:50",
    "dense:64",
    "dense:32",
    "dense:16",
    "dense:8",
    "lowrank:32",
    "lowrank:16",
    "lowrank:8",
    "lowrank:4",
]
QUICK_POINTS = ["dense:64", "dense:16", "lowrank:4", "comera:4", "comera:4:floor=1"]


@dataclass(frozen=True)
class Point:
    """One model of the study: a family and its size knob (width, rank or compression target).

    CoMERA points take options: ``floor=F`` (``ScheduledLateStage(layer_floor=F)``; without it, the policy's
    default at run time, recorded in the JSON), ``ramp=F`` (``ScheduledLateStage(ramp_fraction=F)``: the share of
    the late stage the size schedule takes) and ``head=R`` (the MLM's output decoder as a gated low-rank product
    of rank ``R`` instead of a TT over split token ids).
    """

    kind: str
    value: float
    layer_floor: float | None = None
    head_rank: int | None = None
    ramp_fraction: float | None = None

    @classmethod
    def parse(cls, text: str) -> Point:
        """``dense:W``, ``lowrank:R``, ``comera:T`` or ``comera:T:floor=F:ramp=F:head=R``."""
        kind, _, rest = text.partition(":")
        size, *options = rest.split(":") if rest else [""]
        if kind not in KINDS or not size:
            raise ValueError(
                f"point {text!r}: write dense:WIDTH, lowrank:RANK or comera:TARGET[:floor=F][:ramp=F][:head=R]"
            )
        try:
            value = float(size)
        except ValueError:
            raise ValueError(f"point {text!r}: {size!r} is not a number") from None
        if value <= 0 or (kind != "comera" and value != int(value)):
            raise ValueError(f"point {text!r}: widths and ranks are positive integers, targets positive numbers")
        found: dict[str, float] = {}
        for option in options:
            key, _, number = option.partition("=")
            if kind != "comera" or key not in ("floor", "ramp", "head"):
                raise ValueError(
                    f"point {text!r}: only comera points take options, and only floor=F, ramp=F and head=R"
                )
            try:
                found[key] = float(number)
            except ValueError:
                raise ValueError(f"point {text!r}: {key} needs a number, got {number!r}") from None
        if not 0 < found.get("ramp", 1.0) <= 1:
            raise ValueError(f"point {text!r}: ramp is the late stage's share for the schedule, in (0, 1]")
        head = found.get("head")
        return cls(kind, value, found.get("floor"), None if head is None else int(head), found.get("ramp"))

    @property
    def name(self) -> str:
        """The point as written on the command line (its key in the JSON)."""
        if self.kind != "comera":
            return f"{self.kind}:{int(self.value)}"
        return (
            f"comera:{self.value:g}"
            + ("" if self.layer_floor is None else f":floor={self.layer_floor:g}")
            + ("" if self.ramp_fraction is None else f":ramp={self.ramp_fraction:g}")
            + ("" if self.head_rank is None else f":head={self.head_rank}")
        )

    @property
    def family(self) -> str:
        """The curve the point belongs to: the kind, with a CoMERA point's options (a curve of their own)."""
        return self.kind if self.kind != "comera" else ":".join(["comera", *self.name.split(":")[2:]])


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
        raise ValueError(f"unknown task {task!r}; use one of {TASKS}")
    spec = spec_from_config(quick=quick) if task == "lm" else qs.SPECS[task](quick)
    spec = replace(spec, seed=seed, steps=spec.steps if steps is None else steps)
    if d_model is not None:
        if d_model < 1:
            raise ValueError(f"d_model must be >= 1, got {d_model}")
        spec.task_kwargs = study.at_width(spec.task_kwargs, d_model)
    spec.data_kwargs = {**spec.data_kwargs, "root": corpus_root(corpus)}
    spec.check()
    return spec


def task_kwargs(spec: StudySpec, point: Point) -> dict[str, Any]:
    """The model arguments of ``point``: the spec's model, narrowed (dense) or re-factorised (low-rank)."""
    kwargs = dict(spec.task_kwargs)
    layer = dict(kwargs.get("layer_config") or {})
    if point.kind == "dense":
        kwargs = study.at_width(kwargs, int(point.value))
        layer.update(tt_linears=False, tt_embeddings=False)
    elif point.kind == "lowrank":
        rank = int(point.value)
        layer.update(
            tt_linears=True,
            tt_embeddings=True,
            rank=rank,
            embedding_rank=rank,
            layer_ranks=None,
            low_rank_linears=".",
            low_rank_embeddings=".",
        )
    else:
        layer.update(tt_linears=True, tt_embeddings=True)
        if point.head_rank is not None:
            if spec.name != "mlm":
                raise ValueError(
                    f"point {point.name}: head=R is for the MLM's decoder; the decoder LM's head is "
                    "set in configs/llm_cpu.yaml"
                )
            layer.update(low_rank_linears="head.decoder", layer_ranks={"head.decoder": point.head_rank})
    kwargs["layer_config"] = layer
    return kwargs


def build_point(spec: StudySpec, point: Point):
    """(LightningModule, spec for ``study.run_one``, method name) of one point, seeded as the study is."""
    from comera_lightning.nn import tt_layers

    torch.manual_seed(spec.seed)
    task = study.task_class(spec.name)(**task_kwargs(spec, point))
    if point.kind == "lowrank":
        for _, layer in tt_layers(task):
            for gate in layer.gates:
                gate.requires_grad_(False)  # a plain A B: nothing decides ranks, the gates stay at 1
    if point.kind != "comera":
        return task, spec, "dense"
    from comera_lightning.callbacks import ScheduledLateStage

    rank = {k: v for k, v in spec.rank_kwargs.items() if k != "target_size_ratio"}
    rank["target_compression"] = point.value
    options = {"layer_floor": point.layer_floor, "ramp_fraction": point.ramp_fraction}
    rank["late_stage"] = ScheduledLateStage(**{k: v for k, v in options.items() if v is not None})
    return task, replace(spec, rank_kwargs=rank), "comera"


def run_points(
    spec: StudySpec,
    points: list[Point],
    progress: study.Progress,
    cache_dir: Path = study.DEFAULT_CACHE,
    **run_options: Any,
) -> dict[str, Any]:
    """Train every point ``progress`` does not hold yet, saving the study's JSON after each run; returns it."""
    runs: dict[str, Any] = progress.state.setdefault("runs", {})
    dm = study.build_datamodule(spec, cache_dir)
    late_start = spec.late_start_step
    for point in points:
        if point.name in runs:
            print(f"[{spec.name} s{spec.seed}] {point.name}: already in {progress.path}, skipped", flush=True)
            continue
        task, run_spec, method = build_point(spec, point)
        print(f"[{spec.name} s{spec.seed}] {point.name}: training {spec.steps} steps", flush=True)
        run = study.run_one(run_spec, method, "steps", dm, task=task, **run_options)
        final = run["final"]
        runs[point.name] = {
            "point": point.name,
            "kind": point.kind,
            "family": point.family,
            "value": point.value,
            "layer_floor": run_spec.rank_kwargs["late_stage"].layer_floor if point.kind == "comera" else None,
            "ramp_fraction": run_spec.rank_kwargs["late_stage"].ramp_fraction if point.kind == "comera" else None,
            "ramp_steps": run_spec.rank_kwargs["late_stage"].ramp if point.kind == "comera" else None,
            "head_rank": point.head_rank,
            "metric": spec.metric,
            "final_metric": final["metrics"].get(spec.metric),
            "params_active": final["params_active"],
            "compression_ratio": final["compression_ratio"],
            "params_dense_equivalent": final["params_dense_equivalent"],
            "ranks_final": run["ranks_final"],
            "validations": run["validations"],
            "steps": run["steps"],
            "train_s": run["train_s"],
            "median_step_s": run["median_step_s"],
            "other_load": run["other_load"],
            "first_batch_hash": run["first_batch_hash"],
            "late_dip": (
                study.late_dip(run["validations"], spec.metric, late_start, spec.higher_is_better)
                if point.kind == "comera"
                else None
            ),
        }
        print(
            f"    {spec.metric} {runs[point.name]['final_metric']:.4f} at {final['params_active']:,} active "
            f"parameters ({final['compression_ratio']:.2f}x of its own dense twin), {run['train_s']:.0f} s",
            flush=True,
        )
        progress.save(
            task=spec.name,
            seed=spec.seed,
            late_start_step=late_start,
            higher_is_better=spec.higher_is_better,
            machine=harness.machine_info(),
            runs=runs,
        )
    return progress.state


# ------------------------------------------------------------------------------------------------------
# aggregation over seeds


def aggregate(studies: list[dict[str, Any]]) -> dict[str, Any]:
    """Per point: mean, min and max of the metric and the active parameters over the seeds; the CoMERA
    comparisons at equal size; the free compression."""
    if not studies:
        raise ValueError("nothing to aggregate: no study JSON given")
    tasks = {s["task"] for s in studies}
    if len(tasks) != 1:
        raise ValueError(f"the JSONs mix tasks {sorted(tasks)}; aggregate one task and corpus at a time")
    higher = studies[0]["higher_is_better"]
    points = {}
    for name in dict.fromkeys(name for s in studies for name in s["runs"]):
        runs = [s["runs"][name] for s in studies if name in s["runs"]]
        metric = study.spread([r["final_metric"] for r in runs])
        params = study.spread([r["params_active"] for r in runs])
        dips = [r["late_dip"] for r in runs if r.get("late_dip") is not None]
        points[name] = {
            "family": runs[0]["family"],
            "kind": runs[0]["kind"],
            "seeds": [s["seed"] for s in studies if name in s["runs"]],
            **{f"metric_{k}": metric[k] for k in ("mean", "min", "max")},
            **{f"params_{k}": params[k] for k in ("mean", "min", "max")},
            "compression_mean": study.spread([r["compression_ratio"] for r in runs])["mean"],
            "late_dip_max": max(dips) if dips else None,
            "per_seed": [r["final_metric"] for r in runs],
        }
    full = max((p for p in points.values() if p["kind"] == "dense"), key=lambda p: p["params_mean"], default=None)
    comparisons = {}
    for name, p in points.items():
        if p["kind"] != "comera":
            continue
        row = {"params": p["params_mean"], "metric": p["metric_mean"]}
        for family in ("dense", "lowrank"):
            curve = sorted((q["params_mean"], q["metric_mean"]) for q in points.values() if q["family"] == family)
            baseline, larger = baseline_at(curve, p["params_mean"])
            row[f"{family}_at_same_size"] = baseline
            row[f"{family}_is_larger"] = larger
            row[f"vs_{family}"] = (
                None
                if baseline is None
                else (p["metric_mean"] - baseline if higher else baseline / p["metric_mean"] - 1.0)
            )
            # the per-seed check: every seed's CoMERA above that seed's baseline curve
            row[f"seeds_above_{family}"] = _seeds_above(studies, name, family, higher)
        if full is not None:
            row["compression_vs_full_dense"] = full["params_mean"] / p["params_mean"]
        comparisons[name] = row
    free = (
        None
        if full is None
        else max(
            (
                (full["params_mean"] / p["params_mean"], name)
                for name, p in points.items()
                if p["kind"] == "comera" and _within(p["metric_mean"], full["metric_mean"], higher)
            ),
            default=None,
        )
    )
    return {
        "task": studies[0]["task"],
        "higher_is_better": higher,
        "seeds": sorted(s["seed"] for s in studies),
        "metric": next(iter(studies[0]["runs"].values()))["metric"],
        "points": points,
        "full_dense": None if full is None else {"params": full["params_mean"], "metric": full["metric_mean"]},
        "comparisons": comparisons,
        "free_compression": None if free is None else {"compression": free[0], "point": free[1]},
        "steps": studies[0]["spec"]["steps"],
        "late_start_step": studies[0]["late_start_step"],
    }


def _within(value: float, reference: float, higher_is_better: bool) -> bool:
    """Within 1 point of accuracy (0.01) or 5 % of perplexity of the reference."""
    return value >= reference - 0.01 if higher_is_better else value <= reference * 1.05


def interpolate_log(curve: list[tuple[float, float]], params: float) -> float | None:
    """The baseline's metric at ``params``, linear in log-parameters between its two nearest points (None
    outside the curve's range: no extrapolation)."""
    for (p0, m0), (p1, m1) in pairwise(curve):
        if p0 <= params <= p1:
            if p1 == p0:
                return m0
            t = (math.log(params) - math.log(p0)) / (math.log(p1) - math.log(p0))
            return m0 + t * (m1 - m0)
    return None


def baseline_at(curve: list[tuple[float, float]], params: float) -> tuple[float | None, bool]:
    """(the baseline's metric at ``params``, whether it is the smallest baseline model instead).

    Within the curve: :func:`interpolate_log`. Below it: the smallest baseline model's metric, a model with more
    parameters than the point, so beating it is the stronger claim (as long as the curve improves with size).
    Above it: None (a larger CoMERA model against a smaller baseline says nothing).
    """
    if curve and params < curve[0][0]:
        return curve[0][1], True
    return interpolate_log(curve, params), False


def _seeds_above(studies: list[dict[str, Any]], name: str, family: str, higher: bool) -> str:
    wins = total = 0
    for s in studies:
        if name not in s["runs"]:
            continue
        curve = sorted((r["params_active"], r["final_metric"]) for r in s["runs"].values() if r["family"] == family)
        base, _ = baseline_at(curve, s["runs"][name]["params_active"])
        if base is None:
            continue
        total += 1
        value = s["runs"][name]["final_metric"]
        wins += (value > base) if higher else (value < base)
    return f"{wins}/{total}"


def markdown(agg: dict[str, Any], title: str) -> str:
    """The aggregate as markdown: every point, then CoMERA against the curves at equal size."""
    m = agg["metric"]
    lines = [
        f"### {title}",
        "",
        f"{agg['steps']} steps per run, CoMERA's late stage from step {agg['late_start_step']}; seeds "
        f"{agg['seeds']}; mean and min..max over the seeds.",
        "",
    ]
    rows = []
    for name, p in sorted(agg["points"].items(), key=lambda kv: (kv[1]["family"], -kv[1]["params_mean"])):
        rows.append(
            [
                name,
                f"{p['params_mean']:,.0f}",
                f"{p['metric_mean']:.4f}",
                f"{p['metric_min']:.4f}..{p['metric_max']:.4f}",
                len(p["seeds"]),
                "-" if p["late_dip_max"] is None else f"{p['late_dip_max']:.4f}",
            ]
        )
    lines += [harness.table(["model", "active params", m, "min..max", "seeds", "worst late dip"], rows), ""]
    rows = []
    for name, c in agg["comparisons"].items():

        def fmt(family, c=c):
            v = c[f"vs_{family}"]
            if v is None:
                return "above the curve"
            text = f"{v:+.4f}" if agg["higher_is_better"] else f"{v:+.1%}"
            return text + (" (vs its smallest, larger model)" if c[f"{family}_is_larger"] else "")

        rows.append(
            [
                name,
                f"{c['params']:,.0f}",
                f"{c.get('compression_vs_full_dense', float('nan')):.1f}x",
                f"{c['metric']:.4f}",
                fmt("dense"),
                c["seeds_above_dense"],
                fmt("lowrank"),
                c["seeds_above_lowrank"],
            ]
        )
    better = "CoMERA minus baseline" if agg["higher_is_better"] else "baseline / CoMERA - 1 (perplexity)"
    lines += [
        harness.table(
            [
                "CoMERA point",
                "active params",
                "vs full dense",
                m,
                f"vs dense-narrowed ({better})",
                "seeds above",
                "vs low-rank",
                "seeds above",
            ],
            rows,
        ),
        "",
    ]
    free = agg["free_compression"]
    tol = "1 point" if agg["higher_is_better"] else "5 % perplexity"
    lines.append(
        f"Free compression (largest CoMERA compression within {tol} of the full dense model, "
        f"mean over seeds): "
        + ("none of the CoMERA points" if free is None else f"{free['compression']:.1f}x ({free['point']})")
    )
    return "\n".join(lines)


def plot(agg: dict[str, Any], title: str):
    """Metric against active parameters (log), one line per family, min..max over seeds as error bars."""
    fig, [ax] = harness.new_figure(1, width=6.5, height=4.5)
    families = dict.fromkeys(p["family"] for p in agg["points"].values())
    for i, family in enumerate(families):
        pts = sorted((p for p in agg["points"].values() if p["family"] == family), key=lambda p: p["params_mean"])
        x = [p["params_mean"] for p in pts]
        y = [p["metric_mean"] for p in pts]
        err = [[p["metric_mean"] - p["metric_min"] for p in pts], [p["metric_max"] - p["metric_mean"] for p in pts]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=family, color=study.COLOURS.get(family, f"C{i + 3}"))
    harness.label_axes(
        ax,
        "active parameters at the end of training",
        agg["metric"],
        xlog=True,
        ylog=not agg["higher_is_better"],
        title=title,
    )
    return fig


# ------------------------------------------------------------------------------------------------------
# entry point


def main(argv: list[str] | None = None) -> int:
    """Train one (task, corpus, seed) over its points, or ``--aggregate`` seeds' JSONs into a table and a plot."""
    parser = study.study_parser(__doc__, out_dir=harness.RESULTS_DIR / "pareto", budget=False)
    parser.add_argument("--task", default="mlm", choices=TASKS)
    parser.add_argument("--corpus", default="stdlib", help="stdlib, site:PACKAGE (installed sources) or a folder")
    parser.add_argument(
        "--d-model",
        type=int,
        default=None,
        help="width of the full model (CoMERA's and the widest dense point); default the study's 128",
    )
    parser.add_argument(
        "--points",
        nargs="+",
        default=None,
        help="dense:W, lowrank:R, comera:T[:floor=F][:head=R] (default: DEFAULT_POINTS)",
    )
    parser.add_argument("--aggregate", nargs="+", type=Path, default=None, help="study JSONs of one task and corpus")
    parser.add_argument("--out", type=Path, default=None, help="with --aggregate: path stem of the .md/.json/.png")
    parser.add_argument("--title", default=None, help="with --aggregate: the table's and plot's title")
    args = study.parse(parser, argv)
    if args.aggregate:
        if args.out is None:
            parser.error("--aggregate needs --out (the path stem of the table, JSON and plot)")
        agg = aggregate([harness.read_json(p) for p in args.aggregate])
        title = args.title or f"{agg['task']}: CoMERA vs dense-narrowed vs low-rank"
        text = markdown(agg, title)
        print(text)
        harness.emit(args.out.with_suffix(".json"), agg, fig=plot(agg, title), markdown=text)
        return 0
    corpus = args.corpus.replace("site:", "").replace("/", "_").strip("_") or "corpus"
    width = "" if args.d_model is None else f"_d{args.d_model}"
    out = args.out_dir / f"pareto_{args.task}_{corpus}{width}_s{args.seed}{'_quick' if args.quick else ''}.json"
    try:
        points = [Point.parse(t) for t in (args.points or (QUICK_POINTS if args.quick else DEFAULT_POINTS))]
        spec = study_spec(args.task, args.corpus, args.seed, args.steps, args.quick, args.d_model)
        progress = study.Progress(out, spec.json())
    except ValueError as err:
        parser.error(str(err))
    progress.state["settings"] = harness.settings(args)
    run_points(spec, points, progress, args.cache_dir, max_other_load=args.max_other_load, wait_quiet_s=args.wait_quiet)
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
