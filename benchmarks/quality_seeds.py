"""Aggregate quality-study runs over seeds: mean and spread per method, the late-stage dip, plots.

Reads the JSON files ``quality_study.py`` wrote (one per seed, e.g. ``--tag _s0``, ``_s1``, ...) for one
study and protocol, groups the runs by method, and reports per method over the seeds:

* the final headline metric (mean, min, max) and its difference to dense *of the same seed* (the methods
  of one seed saw identical batches);
* the final compression ratio (RankMonitor's ``compression_ratio``: dense-equivalent / active parameters);
* the late-stage dip: the largest fall of the metric below its value at the switch, over the validations
  after the switch (in points, i.e. metric x 100); the switch must fall on a validation step;
* steps and median step time.

It writes ``<out>.md`` (the table), ``<out>.json`` (every number) and ``<out>.png`` (metric against steps,
mean over seeds with the min-max band, switch marked; compression against steps).

    python benchmarks/quality_seeds.py benchmarks/results/q11/quality_mlm_s*.json --protocol steps \\
        --out benchmarks/results/q11/mlm_steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def late_stage_dip(run: dict[str, Any], metric: str, switch_step: int) -> float | None:
    """Largest fall (metric units) below the value at ``switch_step`` among later validations; None if the
    switch is not a validation step or the run has no late stage."""
    by_step = {v["step"]: v["metrics"].get(metric) for v in run["validations"]}
    at_switch = by_step.get(switch_step)
    after = [value for step, value in by_step.items() if step > switch_step and value is not None]
    if at_switch is None or not after:
        return None
    return max(0.0, at_switch - min(after))


def aggregate(results: list[dict[str, Any]], protocol: str) -> dict[str, Any]:
    """Per-method statistics over the seeds of ``results`` (one study)."""
    studies = {r["study"] for r in results}
    if len(studies) != 1:
        raise ValueError(f"pass the runs of one study, got {sorted(studies)}")
    metric = results[0]["spec"]["metric"]
    per_method: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        seed = result["spec"]["seed"]
        runs = {r["method"]: r for r in result["runs"] if r["protocol"] == protocol}
        dense = runs.get("dense")
        for method, run in runs.items():
            switch = run.get("rank_adaptation", {}).get("switch_step")
            final = run["final"]["metrics"][metric]
            per_method.setdefault(method, []).append({
                "seed": seed,
                "final": final,
                "delta_vs_dense": None if dense is None else final - dense["final"]["metrics"][metric],
                "compression": run["final"]["compression_ratio"],
                "switch_step": switch,
                "at_switch": None if switch is None else {v["step"]: v["metrics"].get(metric)
                                                          for v in run["validations"]}.get(switch),
                "dip": None if switch is None else late_stage_dip(run, metric, switch),
                "steps": run["steps"],
                "median_step_s": run["median_step_s"],
                "curve": [(v["step"], v["metrics"].get(metric), v["compression_ratio"]) for v in run["validations"]],
            })
    summary = {}
    for method, rows in per_method.items():
        def stats(key: str) -> dict[str, float] | None:
            values = [r[key] for r in rows if r[key] is not None]
            if not values:
                return None
            return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}

        summary[method] = {"final": stats("final"), "delta_vs_dense": stats("delta_vs_dense"),
                           "compression": stats("compression"), "dip": stats("dip"), "steps": stats("steps"),
                           "median_step_s": stats("median_step_s"), "seeds": sorted(r["seed"] for r in rows)}
    return {"study": results[0]["study"], "protocol": protocol, "metric": metric, "summary": summary,
            "runs": per_method}


def _cell(stats: dict[str, float] | None, scale: float = 1.0, fmt: str = "{:.2f}", signed: bool = False) -> str:
    if stats is None:
        return "-"
    f = ("{:+" + fmt[2:]) if signed else fmt
    return f"{f.format(stats['mean'] * scale)} ({fmt.format(stats['min'] * scale)} .. {fmt.format(stats['max'] * scale)})"


def markdown(agg: dict[str, Any]) -> str:
    """One row per method: means over seeds with (min .. max); metric and its differences in points."""
    headers = ["method", "seeds", "steps", f"final {agg['metric']} (x100)", "vs dense, same seed (points)",
               "compression", "largest dip after the switch (points)"]
    rows = []
    order = sorted(agg["summary"], key=lambda m: (m != "dense", m))
    for method in order:
        s = agg["summary"][method]
        rows.append([method, ",".join(map(str, s["seeds"])), _cell(s["steps"], fmt="{:.0f}"),
                     _cell(s["final"], 100.0), _cell(s["delta_vs_dense"], 100.0, signed=True),
                     _cell(s["compression"], fmt="{:.1f}"), _cell(s["dip"], 100.0)])
    return f"### {agg['study']}, protocol {agg['protocol']}\n\n" + harness.table(headers, rows)


def plot(agg: dict[str, Any], path: Path) -> Path:
    """Metric and compression against steps: mean over seeds, min-max band, the switch as a dotted line."""
    fig, axes = harness.new_figure(2, width=5.5, height=3.8)
    colours = {"dense": "tab:blue", "comera": "tab:red", "comera-paper": "tab:orange", "comera-norm": "tab:purple"}
    for method, rows in agg["runs"].items():
        steps = sorted({s for r in rows for s, _, _ in r["curve"]})
        for ax, index in ((axes[0], 1), (axes[1], 2)):
            points = []
            for step in steps:
                values = [c[index] for r in rows for c in r["curve"] if c[0] == step and c[index] is not None]
                if values:
                    points.append((step, values))
            xs = [step for step, _ in points]
            colour = colours.get(method, "gray")
            ax.plot(xs, [statistics.fmean(v) for _, v in points], color=colour, marker="o", markersize=3,
                    label=f"{method} (n={len(rows)})")
            ax.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points], color=colour, alpha=0.2)
        switches = {r["switch_step"] for r in rows if r["switch_step"] is not None}
        for switch in switches:
            for ax in axes:
                ax.axvline(switch, color=colours.get(method, "gray"), linestyle=":", alpha=0.7)
    axes[0].set_ylabel(agg["metric"])
    axes[1].set_ylabel("compression ratio")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("optimiser steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{agg['study']} ({agg['protocol']}): mean over seeds, band = min..max, dotted = late-stage switch")
    return harness.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="quality_study JSON files of one study (one per seed)")
    p.add_argument("--protocol", default="steps", help="which protocol's runs to aggregate")
    p.add_argument("--out", type=Path, required=True, help="output stem (writes .md, .json, .png)")
    args = p.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        p.error(f"no such file: {', '.join(missing)}")
    agg = aggregate([json.loads(f.read_text()) for f in args.files], args.protocol)
    if not agg["summary"]:
        p.error(f"no runs with protocol {args.protocol!r} in the given files")
    text = markdown(agg)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text + "\n")
    harness.write_json(args.out.with_suffix(".json"), agg)
    plot(agg, args.out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
