"""Aggregate quality-study runs over seeds: mean and spread per method, the late-stage dip, plots.

Reads the JSONs ``quality_study.py`` wrote for one study (one per seed, e.g. ``--tag _s0``, ``_s1``), takes the
runs of one protocol, and reports per method over the seeds (``study.spread``: mean, min..max): the final
headline metric and its difference to dense *of the same seed* (the methods of one seed saw identical batches),
the final compression ratio, the largest fall of the metric below its value at the late-stage switch
(``study.late_dip``, in points: metric x 100), steps and median step time. Writes ``<out>.md`` (the table),
``<out>.json`` and ``<out>.png`` (metric and compression against steps: mean, min..max band, switch dotted).

    python benchmarks/quality_seeds.py benchmarks/results/q11/quality_mlm_s*.json --protocol steps \\
        --out benchmarks/results/q11/mlm_steps
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import harness
import study


def aggregate(results: list[dict[str, Any]], protocol: str) -> dict[str, Any]:
    """Per-method statistics over the seeds of ``results`` (one study)."""
    studies = {r["study"] for r in results}
    if len(studies) != 1:
        raise ValueError(f"pass the runs of one study, got {sorted(studies)}")
    spec = results[0]["spec"]
    metric = spec["metric"]
    per_method: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        runs = {r["method"]: r for r in result["runs"] if r["protocol"] == protocol}
        dense = runs.get("dense")
        for method, run in runs.items():
            switch = run.get("rank_adaptation", {}).get("switch_step")
            final = run["final"]["metrics"][metric]
            per_method.setdefault(method, []).append(
                {
                    "seed": result["spec"]["seed"],
                    "final": final,
                    "delta_vs_dense": None if dense is None else final - dense["final"]["metrics"][metric],
                    "compression": run["final"]["compression_ratio"],
                    "switch_step": switch,
                    "at_switch": None
                    if switch is None
                    else next((v["metrics"].get(metric) for v in run["validations"] if v["step"] == switch), None),
                    "dip": None
                    if switch is None
                    else study.late_dip(run["validations"], metric, switch, spec.get("higher_is_better", True)),
                    "steps": run["steps"],
                    "median_step_s": run["median_step_s"],
                    "curve": [
                        (v["step"], v["metrics"].get(metric), v["compression_ratio"]) for v in run["validations"]
                    ],
                }
            )
    summary = {
        method: {
            **{
                key: study.spread([r[key] for r in rows])
                for key in ("final", "delta_vs_dense", "compression", "dip", "steps", "median_step_s")
            },
            "seeds": sorted(r["seed"] for r in rows),
        }
        for method, rows in per_method.items()
    }
    return {
        "study": results[0]["study"],
        "protocol": protocol,
        "metric": metric,
        "summary": summary,
        "runs": per_method,
    }


def markdown(agg: dict[str, Any]) -> str:
    """One row per method: means over seeds with (min .. max); metric and its differences in points."""
    cell = study.spread_cell
    rows = []
    for method in sorted(agg["summary"], key=lambda m: (m != "dense", m)):
        s = agg["summary"][method]
        rows.append(
            [
                method,
                ",".join(map(str, s["seeds"])),
                cell(s["steps"], fmt="{:.0f}"),
                cell(s["final"], 100.0),
                cell(s["delta_vs_dense"], 100.0, signed=True),
                cell(s["compression"], fmt="{:.1f}"),
                cell(s["dip"], 100.0),
            ]
        )
    return f"### {agg['study']}, protocol {agg['protocol']}\n\n" + harness.table(
        [
            "method",
            "seeds",
            "steps",
            f"final {agg['metric']} (x100)",
            "vs dense, same seed (points)",
            "compression",
            "largest dip after the switch (points)",
        ],
        rows,
    )


def plot(agg: dict[str, Any]):
    """Metric and compression against steps: mean over seeds, min-max band, the switch as a dotted line."""
    fig, axes = harness.new_figure(2, width=5.5, height=3.8)
    for method, rows in agg["runs"].items():
        colour = study.COLOURS.get(method, "gray")
        steps = sorted({s for r in rows for s, _, _ in r["curve"]})
        for ax, index in ((axes[0], 1), (axes[1], 2)):
            points = [
                (step, values)
                for step in steps
                if (values := [c[index] for r in rows for c in r["curve"] if c[0] == step and c[index] is not None])
            ]
            xs = [step for step, _ in points]
            ax.plot(
                xs,
                [statistics.fmean(v) for _, v in points],
                color=colour,
                marker="o",
                markersize=3,
                label=f"{method} (n={len(rows)})",
            )
            ax.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points], color=colour, alpha=0.2)
        for switch in {r["switch_step"] for r in rows if r["switch_step"] is not None}:
            for ax in axes:
                ax.axvline(switch, color=colour, linestyle=":", alpha=0.7)
    harness.label_axes(axes[0], "optimiser steps", agg["metric"])
    harness.label_axes(axes[1], "optimiser steps", "compression ratio", ylog=True)
    fig.suptitle(f"{agg['study']} ({agg['protocol']}): mean over seeds, band = min..max, dotted = late-stage switch")
    return fig


def main(argv: list[str] | None = None) -> int:
    """Aggregate the given JSONs, print the table, write ``<out>.{md,json,png}``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path, help="quality_study JSON files of one study (one per seed)")
    p.add_argument("--protocol", default="steps", help="which protocol's runs to aggregate")
    p.add_argument("--out", type=Path, required=True, help="output stem (writes .md, .json, .png)")
    args = p.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        p.error(f"no such file: {', '.join(missing)}")
    agg = aggregate([harness.read_json(f) for f in args.files], args.protocol)
    if not agg["summary"]:
        p.error(f"no runs with protocol {args.protocol!r} in the given files")
    text = markdown(agg)
    print(text)
    harness.emit(args.out.with_suffix(".json"), agg, fig=plot(agg), markdown=text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
