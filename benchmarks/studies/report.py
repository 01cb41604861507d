"""Tables and the figure of the tuned quality studies (``studies/tuned.py``), from their raw runs in ``docs/data/``.

``docs/data/<task>_<corpus>.json`` holds a list ``runs``, each with at least the :data:`REQUIRED` fields and its
``phase`` (``sweep``, ``check`` or ``final``); a file of another shape is refused, naming the run and the field. Its
tables and figure go between ``<!-- quality:NAME begin -->`` and ``<!-- quality:NAME end -->`` in docs/results.md;
the width studies' blocks (and README's headline) come from ``width_report``.

    python -m benchmarks.studies.report --write          # every docs/data/*.json into docs/results.md
    python -m benchmarks.studies.report --check          # fail when the page differs from what the data give
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.studies import width_report

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "docs" / "data"
RESULTS = REPO / "docs" / "results.md"
README = REPO / "README.md"
IMAGES = REPO / "docs" / "img"
ORDER = ("dense", "galore", "narrow", "lowrank", "cola", "tt", "comera", "comera_act", "comera_early")
RIVALS = ("narrow", "lowrank", "cola", "tt", "comera_act", "comera_early")
FULL_WIDTH = ("dense", "galore")
LABELS = {
    "dense": "dense (full width)",
    "galore": "dense + GaLore",
    "narrow": "dense-narrowed",
    "lowrank": "low-rank A B",
    "cola": "CoLA (B silu(A x))",
    "tt": "fixed-rank TT",
    "comera": "CoMERA",
    "comera_act": "CoMERA + SiLU bottleneck",
    "comera_early": "CoMERA, early late stage",
}
REQUIRED = {"family": str, "size": (int, float), "seed": int, "lr": (int, float), "tokens": int, "params_active": int}
REQUIRED |= {"val_loss": (int, float), "curve": list}
FREE_TOLERANCE = 0.05  # "free compression": within 5 % of the full dense model's perplexity
SPIKE_TOLERANCE = 0.05
CONVERGENCE_SHARE = 0.25  # the convergence is read over the run's last quarter
# The late-stage ramps tuned.run_job trains, for counting FLOPs through them: the early family's is a share of the
# run (tuned.EARLY_RAMP_FRACTION), the default's a share of the steps left at the switch, 0.6 for a cut of up to 5x
# and longer for deeper ones (late_stage.ramp_fraction_for); the runs do not record the size at the switch, so it is
# taken at 0.6 (a lower bound on the FLOPs beyond 5x).
EARLY_RAMP_SHARE_OF_RUN = 0.4
DEFAULT_RAMP_SHARE_OF_REST = 0.6
RAMPS = {"comera_early": "run", "comera": "rest", "comera_act": "rest"}


class StudyFileError(ValueError):
    """A results file that is not a tuned quality study."""


def validate(study: Any, where: str) -> dict[str, Any]:
    """``study`` when it has the documented shape; else a :class:`StudyFileError` naming the run and the field."""
    fix = "(docs/data files are written by benchmarks/studies/tuned.py; see benchmarks/studies/report.py's docstring)"

    def refuse(what: str) -> StudyFileError:
        return StudyFileError(f"{where}: {what} {fix}")

    if not isinstance(study, dict) or not isinstance(study.get("runs"), list):
        raise refuse("not a quality study: expected a JSON object with a list 'runs'")
    for i, run in enumerate(study["runs"]):
        if not isinstance(run, dict):
            raise refuse(f"runs[{i}] is a {type(run).__name__}, not an object")
        for key, kind in REQUIRED.items():
            if key not in run:
                raise refuse(f"runs[{i}] has no '{key}'")
            if isinstance(run[key], bool) or not isinstance(run[key], kind):
                kind_name = getattr(kind, "__name__", "number")
                raise refuse(f"runs[{i}]['{key}'] is {run[key]!r}, which is not a {kind_name}")
        for point in [] if "error" in run else run["curve"]:
            pair = isinstance(point, list) and len(point) == 2
            if not (pair and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in point)):
                raise refuse(f"runs[{i}]['curve'] holds {point!r}; each point is [tokens, val_loss]")
    return study


def load(path: Path) -> dict[str, Any]:
    """A study file, validated."""
    try:
        study = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise StudyFileError(
            f"{path}: not valid JSON ({err}); restore it from git or rerun benchmarks/studies/tuned.py"
        ) from err
    return validate(study, str(path))


# ------------------------------------------------------------------------------------------------------
# summaries


def _final(run: dict[str, Any]) -> bool:
    return run.get("phase", "final") == "final" and "error" not in run


def _rank(family: str) -> int:
    return ORDER.index(family) if family in ORDER else 99


def _mean(runs: Iterable[dict[str, Any]], value: Any) -> float:
    """The mean of ``value(run)`` (a callable) or of ``run[value]`` (missing: NaN) over ``runs``."""
    return statistics.fmean(value(r) if callable(value) else r.get(value, math.nan) for r in runs)


def diverged(study: dict[str, Any]) -> list[dict[str, Any]]:
    """The final runs without a finite validation loss (the study reruns their size at a lower rate)."""
    return [r for r in study["runs"] if _final(r) and not math.isfinite(r["val_loss"])]


def finals(study: dict[str, Any]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    """The finished final runs by (family, size), seeds in order, at the rates that did not diverge."""
    dropped = {(r["family"], float(r["size"]), r["lr"]) for r in diverged(study)}
    out: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for run in study["runs"]:
        if _final(run) and (run["family"], float(run["size"]), run["lr"]) not in dropped:
            out.setdefault((run["family"], float(run["size"])), []).append(run)
    for runs in out.values():
        runs.sort(key=lambda r: r["seed"])
    return dict(sorted(out.items(), key=lambda kv: (kv[0][1], _rank(kv[0][0]))))


def perplexities(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    values = [math.exp(r["val_loss"]) for r in runs]
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def cell(stats: dict[str, float], digits: int = 2) -> str:
    if stats["n"] == 1:
        return f"{stats['mean']:.{digits}f}"
    return f"{stats['mean']:.{digits}f} ({stats['min']:.{digits}f} .. {stats['max']:.{digits}f})"


def full_dense(study: dict[str, Any]) -> dict[str, float] | None:
    runs = finals(study).get(("dense", 1.0))
    return None if not runs else perplexities(runs)


def comparisons(study: dict[str, Any]) -> list[dict[str, Any]]:
    """CoMERA against each rival at each size: perplexity ratio (rival / CoMERA - 1) and seeds won."""
    by = finals(study)
    rows = []
    for (family, size), runs in by.items():
        if family != "comera":
            continue
        mine = perplexities(runs)
        row: dict[str, Any] = {"size": size, "comera": mine, "params": _mean(runs, "params_active")}
        for rival in RIVALS:
            if not (theirs := by.get((rival, size))):
                continue
            seeds = {r["seed"]: r["val_loss"] for r in theirs}
            wins = [r["val_loss"] < seeds[r["seed"]] for r in runs if r["seed"] in seeds]
            ratio = perplexities(theirs)["mean"] / mine["mean"] - 1.0
            row[rival] = {"ratio": ratio, "won": f"{sum(wins)}/{len(wins)}", "params": _mean(theirs, "params_active")}
        rows.append(row)
    return rows


def last_quarter_change(run: dict[str, Any]) -> tuple[float, float] | None:
    """(Relative fall of the validation loss from the last validation at or before 3/4 of the run's tokens to the
    end, the share of the tokens that spans); None without such points."""
    curve = run["curve"]
    if len(curve) < 2:
        return None
    end_tokens, end_loss = curve[-1]
    start = [(tokens, loss) for tokens, loss in curve if tokens <= (1 - CONVERGENCE_SHARE) * end_tokens]
    if not start or end_tokens <= 0:
        return None
    tokens, loss = start[-1]
    return (loss - end_loss) / end_loss, (end_tokens - tokens) / end_tokens


def _switch_tokens(run: dict[str, Any]) -> float | None:
    step = run.get("late_start_step")
    if step is None or not run["curve"] or run.get("steps", 0) <= 0:
        return None
    return step * run["tokens"] / run["steps"]


def late_spike(run: dict[str, Any]) -> float | None:
    """A CoMERA run's worst perplexity after the late-stage switch over its value at the switch, minus 1."""
    switch = _switch_tokens(run)
    if switch is None:
        return None
    before = [loss for tokens, loss in run["curve"] if tokens <= switch]
    after = [loss for tokens, loss in run["curve"] if tokens > switch]
    if not before or not after:
        return None
    return math.exp(max(after) - before[-1]) - 1.0


def late_rise(run: dict[str, Any]) -> float | None:
    """A CoMERA run's worst perplexity after the switch over the best before it, minus 1 (negative: it never rose);
    unlike :func:`late_spike` it sees the rise of a schedule that switches while the loss still falls fast."""
    switch = _switch_tokens(run)
    if switch is None:
        return None
    best, worst = math.inf, -math.inf
    for tokens, loss in run["curve"]:
        if tokens > switch and best < math.inf:
            worst = max(worst, loss - best)
        best = min(best, loss)
    return None if worst == -math.inf else math.exp(worst) - 1.0


def late_stage_rows(study: dict[str, Any]) -> list[dict[str, Any]]:
    """Per CoMERA family and size: the switch step(s), and each seed's spike and rise (None where not defined)."""
    rows = []
    for (family, size), runs in finals(study).items():
        spikes, rises = [late_spike(r) for r in runs], [late_rise(r) for r in runs]
        if all(v is None for v in spikes + rises):
            continue
        switch = sorted({int(r["late_start_step"]) for r in runs if r.get("late_start_step") is not None})
        seeds = [r["seed"] for r in runs]
        rows.append({"family": family, "size": size, "switch": switch, "seeds": seeds, "spike": spikes, "rise": rises})
    return rows


def counted_flops(run: dict[str, Any]) -> float:
    """A run's training FLOPs step by step: the start model's until the late-stage switch, a geometric fall to the
    end model's over the ramp (as the size schedule falls), the end model's after it. Without a late stage, or for a
    schedule not in :data:`RAMPS`, the run's recorded ``train_flops`` (a linear fall after the switch)."""
    late, kind = run.get("late_start_step"), RAMPS.get(run["family"])
    start, end, steps = run.get("flops_per_step_start"), run.get("flops_per_step_end"), run.get("steps")
    if late is None or kind is None or start is None or end is None or not steps or start <= 0 or end <= 0:
        return float(run.get("train_flops", math.nan))
    share = EARLY_RAMP_SHARE_OF_RUN * steps if kind == "run" else DEFAULT_RAMP_SHARE_OF_REST * (steps - late)
    ramp = max(1, round(share))
    return sum(start * (end / start) ** min(max((step - late) / ramp, 0.0), 1.0) for step in range(steps))


def early_flop_savings(study: dict[str, Any]) -> list[dict[str, Any]]:
    """Per size: 1 - the early schedule's mean training FLOPs over the default CoMERA's, counted through both ramps
    (``counted``) and as the runs stored them (``stored``)."""
    by = finals(study)
    out = []
    for (family, size), runs in by.items():
        default = by.get(("comera", size))
        if family != "comera_early" or not default:
            continue
        counted = _mean(runs, counted_flops) / _mean(default, counted_flops)
        stored = _mean(runs, "train_flops") / _mean(default, "train_flops")
        out.append({"size": size, "counted": 1.0 - counted, "stored": 1.0 - stored})
    return out


def _head_rank(run: dict[str, Any]) -> int | None:
    heads = [ranks for name, ranks in (run.get("ranks_final") or {}).items() if name.endswith("lm_head")]
    return max(heads[0][1:-1]) if heads and len(heads[0]) > 2 else None


def head_ranks(study: dict[str, Any]) -> list[dict[str, Any]]:
    """Per size: the rank of CoMERA's output head (``lm_head``) at the start (twice its block rank) and at the end
    (min, max over seeds), and the low-rank and CoLA rivals' rank (their head's too)."""
    by = finals(study)
    out = []
    for (family, size), runs in by.items():
        ends = [rank for r in runs if (rank := _head_rank(r)) is not None]
        if family != "comera" or not ends:
            continue
        knobs = {r.get("knob") for r in runs}
        rivals = {
            rival: int(theirs[0]["knob"])
            for rival in ("lowrank", "cola")
            if (theirs := by.get((rival, size))) and theirs[0].get("knob") is not None
        }
        start = 2 * int(knobs.pop()) if len(knobs) == 1 and None not in knobs else None
        out.append({"size": size, "comera_start": start, "comera": (min(ends), max(ends)), "rivals": rivals})
    return out


def free_compression(study: dict[str, Any]) -> float | None:
    """The largest compression at which CoMERA's mean perplexity is within 5 % of the full dense model's."""
    reference = full_dense(study)
    if reference is None:
        return None
    sizes = [
        size
        for (family, size), runs in finals(study).items()
        if family == "comera" and perplexities(runs)["mean"] <= (1 + FREE_TOLERANCE) * reference["mean"]
    ]
    return max(sizes, default=None)


# ------------------------------------------------------------------------------------------------------
# markdown


def _k(value: float) -> str:
    return f"{value / 1e3:,.0f} k"


def _range(values: Sequence[float], fmt: str, unit: str = "") -> str:
    """``min-max`` of ``values`` formatted with ``fmt`` (one value when they format alike)."""
    low, high = format(min(values), fmt), format(max(values), fmt)
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _label(family: str) -> str:
    return LABELS.get(family, family)


def markdown(study: dict[str, Any], name: str) -> str:
    """Every table of one study as markdown (deterministic: the same data give the same text)."""
    protocol = study.get("protocol", {})
    by = finals(study)
    tokens = next((r["tokens"] for runs in by.values() for r in runs), None)
    full = study.get("full_dense_params")
    lines = [
        f"Generated by `python -m benchmarks.studies.report --write` from `docs/data/{name}.json` "
        f"({len(study['runs'])} runs); the figure is `docs/img/quality_{name}.png`.",
        "",
    ]
    if tokens is not None:
        per_param = f", {tokens / full:.1f} tokens per parameter of the full dense model" if full else ""
        lines += [
            f"Final runs: {protocol.get('steps')} steps, {tokens / 1e6:.2f} M tokens each{per_param}; seeds "
            f"{protocol.get('seeds')}. {'Checks' if protocol.get('recheck') else 'Sweeps and checks'}: "
            f"{protocol.get('sweep_steps')} steps. Every run: "
            f"AdamW, one rate for all weights (gates {protocol.get('gate_lr')}), warm-up, cosine to "
            f"{protocol.get('final_lr_ratio')} of the peak, clipping at {protocol.get('grad_clip')}."
            + (f" Settings changed from the config: `{' '.join(protocol['set'])}`." if protocol.get("set") else ""),
            "",
        ]
    rows = []
    for (family, size), runs in by.items():
        mem = runs[0].get("peak_memory", {}).get("total")
        reached = [full / r["params_active"] for r in runs if r["params_active"] > 0] if full else []
        cells = [f"{size:g}x" if family not in FULL_WIDTH else "1x", _label(family), _k(_mean(runs, "params_active"))]
        cells += [_range(reached, ".1f", "x") if reached else "-", f"{runs[0]['lr']:.3g}", cell(perplexities(runs))]
        cells += [len(runs), f"{_mean(runs, counted_flops) / 1e12:.2f}", "-" if mem is None else f"{mem / 2**20:.1f}"]
        rows.append(cells)
    header = "size|model|active params|compression reached (min-max)|lr|val perplexity, mean (min .. max)|seeds|"
    header += "training TFLOPs|peak step memory, MiB"
    lines += [*_table(header.split("|"), rows), ""]
    if rows:
        lines += [
            "Compression reached: the full dense model's active parameters over the run's at the end (rivals are sized "
            "at or just above the target; CoMERA's late stage may end above it). Training FLOPs: torch's "
            "FlopCounterMode on one step at the start and one at the end of each run; a CoMERA run's counted step by "
            "step through its schedule (`counted_flops`: the start model's until the switch, a geometric fall to the "
            "end model's over the ramp, the end model's after it; the default schedule's ramp taken at its shortest, "
            "0.6 of the steps left, which is exact for a cut of up to 5x at the switch and a lower bound on its FLOPs "
            "beyond).",
            "",
        ]
    compare = comparisons(study)
    if compare:
        rows = []
        for row in compare:
            rows.append([f"{row['size']:g}x", _k(row["params"]), cell(row["comera"])])
            for rival in RIVALS:
                r = row.get(rival)
                rows[-1].append("-" if r is None else f"{r['ratio']:+.1%}, {r['won']} ({_k(r['params'])})")
        lines += [
            "CoMERA against each rival at the same target size (rival perplexity / CoMERA's - 1: positive means "
            "CoMERA is better; seeds won: seeds where CoMERA's loss is lower than the same seed's rival):",
            "",
            *_table(["size", "CoMERA active params", "CoMERA perplexity", *(LABELS[r] for r in RIVALS)], rows),
            "",
        ]
    heads = head_ranks(study)
    if heads:
        described = "; ".join(
            f"{h['size']:g}x: CoMERA "
            + (f"from {h['comera_start']} " if h["comera_start"] is not None else "")
            + f"to {_range(h['comera'], 'd')}"
            + "".join(f", {LABELS[rival]} {rank}" for rival, rank in h["rivals"].items())
            for h in heads
        )
        lines += [
            "Output head (`lm_head`: a low-rank product in the low-rank, CoLA, TT and CoMERA families), its rank "
            "at the start and at the end of training: CoMERA's starts at twice its block rank and its late stage "
            "cuts it with the rest; the fixed-rank TT trains at CoMERA's seed-0 final ranks, head included; "
            f"low-rank and CoLA give the head their block rank. {described}.",
            "",
        ]
    savings = early_flop_savings(study)
    if savings:
        described = ", ".join(
            f"{s['size']:g}x {-s['counted']:+.1%} (the stored interpolation: {-s['stored']:+.1%})" for s in savings
        )
        lines += [
            "Training FLOPs of the early late stage against the default schedule, mean over seeds, counted through "
            f"each schedule's ramp: {described}.",
            "",
        ]
    reference = full_dense(study)
    free = free_compression(study)
    if reference is not None:
        lines.append(
            f"Full dense model: perplexity {cell(reference)}. Free compression (CoMERA within "
            f"{FREE_TOLERANCE:.0%} of it): " + ("none of the sizes" if free is None else f"{free:g}x") + "."
        )
    changes = [(r["seed"], c) for r in by.get(("dense", 1.0), []) if (c := last_quarter_change(r)) is not None]
    if changes:
        shown = ", ".join(f"seed {s}: {c[0]:.1%}" for s, c in changes)
        shares = [c[1] for _, c in changes]
        lines += [
            f"Convergence: the full dense model's validation loss fell by {shown} over the last "
            f"{_range([100 * v for v in shares], '.0f', ' %')} of its run (from the validation at "
            f"{_range([100 * (1 - v) for v in shares], '.0f', ' %')} of its tokens; the protocol asks for less than "
            "1 %).",
            "",
        ]
    elif reference is not None:
        lines.append("")
    late_rows = late_stage_rows(study)
    if late_rows:
        rows = []
        for row in late_rows:
            percents = [" / ".join("-" if v is None else f"{100 * v:+.1f}" for v in row[k]) for k in ("spike", "rise")]
            where = [_label(row["family"]), f"{row['size']:g}x", "step " + "/".join(map(str, row["switch"]))]
            rows.append([*where, " / ".join(map(str, row["seeds"])), *percents])
        lines += [
            "Late stage, per family and size, seed by seed: the spike is the worst perplexity after the switch over "
            f"the value at the switch (target at most +{SPIKE_TOLERANCE:.0%}); the rise, the worst perplexity after "
            "the switch over the best before it (negative: it never rose), which also shows the rise of a schedule "
            "that switches while the loss still falls fast.",
            "",
            *_table(["model", "size", "switch", "seeds", "spike, %", "rise above the best before, %"], rows),
            "",
        ]
    lost = diverged(study)
    if lost:
        described = "; ".join(
            f"{_label(r['family'])} {float(r['size']):g}x seed {r['seed']} at lr {r['lr']:.3g}"
            + (f" (first non-finite validation at {first:,} tokens)" if (first := _first_nan(r)) is not None else "")
            for r in lost
        )
        lines += [
            f"Diverged finals, whose rate the study then dropped for that size (the finals ran again at the best "
            f"short-run rate below it): {described}.",
            "",
        ]
    source = study.get("rates_from")
    if source and protocol.get("recheck"):  # the copied sweeps are in the source's section
        lines += [
            f"Rates: each family's sweep in `docs/data/{source}` chose its rate; this study checked it at every size "
            "on its own data (best, x2, /2):",
            "",
            *sweep_table({**study, "runs": [r for r in study["runs"] if "copied_from" not in r]}),
        ]
    elif source:  # its short runs are copies: the source's section shows them
        lines.append(f"Rates: the sweeps and checks of `docs/data/{source}`; only the finals ran here.")
    else:
        lines += sweep_table(study)
    return "\n".join(lines).rstrip() + "\n"


def _first_nan(run: dict[str, Any]) -> int | None:
    return next((int(tokens) for tokens, loss in run["curve"] if not math.isfinite(loss)), None)


def sweep_table(study: dict[str, Any]) -> list[str]:
    """Every sweep and check run: final validation loss by family, size and rate (the chosen rate in bold)."""
    cells: dict[tuple[str, float], dict[float, float]] = {}
    for run in study["runs"]:
        if run.get("phase") in ("sweep", "check"):
            loss = run["val_loss"] if "error" not in run else math.nan
            cells.setdefault((run["family"], float(run["size"])), {})[run["lr"]] = loss
    if not cells:
        return []
    chosen = {key: runs[0]["lr"] for key, runs in finals(study).items()}
    rates = sorted({lr for row in cells.values() for lr in row})
    rows = []
    for (family, size), row in sorted(cells.items(), key=lambda kv: (_rank(kv[0][0]), kv[0][1])):
        out = []
        for lr in rates:
            text = "" if lr not in row else "diverged" if not math.isfinite(row[lr]) else f"{row[lr]:.3f}"
            best = lr in row and (family, size) in chosen and math.isclose(chosen[(family, size)], lr)
            out.append(f"**{text}**" if best else text)
        rows.append([_label(family), f"{size:g}x", *out])
    return [
        f"Learning-rate sweeps and checks ({study.get('protocol', {}).get('sweep_steps')} steps, final "
        "validation loss; bold: the rate the finals use):",
        "",
        *_table(["model", "size", *(f"{lr:.3g}" for lr in rates)], rows),
        "",
    ]


# ------------------------------------------------------------------------------------------------------
# the figure


def figure(study: dict[str, Any], name: str):
    """Perplexity against active parameters, training FLOPs and peak memory; the full dense model's curves; every
    family's curve at the middle size."""
    from benchmarks import harness

    fig, axes = harness.new_figure(5, width=4.6, height=4.0)
    by = finals(study)
    families = [f for f in ORDER if any(family == f for family, _ in by)]
    values = {
        "active parameters at the end": lambda runs: _mean(runs, "params_active"),
        "training FLOPs": lambda runs: _mean(runs, counted_flops),
        "peak step memory, bytes": lambda runs: runs[0].get("peak_memory", {}).get("total"),
    }
    for i, family in enumerate(families):
        points = [(runs, perplexities(runs)) for (fam, _), runs in by.items() if fam == family]
        for ax, value_of in zip(axes[:3], values.values(), strict=True):
            found = [(x, ppl) for runs, ppl in points if (x := value_of(runs)) is not None and math.isfinite(x)]
            found.sort(key=lambda p: p[0])
            if found:
                xs, ys = [x for x, _ in found], [p["mean"] for _, p in found]
                errors = [[p["mean"] - p["min"] for _, p in found], [p["max"] - p["mean"] for _, p in found]]
                ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=LABELS[family], color=f"C{i}")
    for ax, xlabel in zip(axes[:3], values, strict=True):
        harness.label_axes(ax, xlabel, "validation perplexity", xlog=True, ylog=True)
    for run in by.get(("dense", 1.0), []):
        axes[3].plot([t for t, _ in run["curve"]], [math.exp(v) for _, v in run["curve"]], label=f"seed {run['seed']}")
    harness.label_axes(axes[3], "tokens", "full dense: validation perplexity", ylog=True)
    sizes = sorted({size for family, size in by if family not in FULL_WIDTH})
    middle = 5.0 if 5.0 in sizes else (sizes[len(sizes) // 2] if sizes else None)
    for i, family in enumerate(families):
        if runs := by.get((family, 1.0 if family in FULL_WIDTH else middle), []):
            run = min(runs, key=lambda r: r["seed"])
            curve = run["curve"]
            label = f"{LABELS[family]} (seed {run['seed']})"
            axes[4].plot([t for t, _ in curve], [v for _, v in curve], label=label, color=f"C{i}")
    harness.label_axes(axes[4], "tokens", f"validation loss at {middle:g}x (full width at 1x)" if middle else "")
    fig.suptitle(f"{name}: tuned quality study")
    return fig


# ------------------------------------------------------------------------------------------------------
# docs/results.md


def replace_block(page: str, name: str, block: str, kind: str = "quality") -> str:
    """``page`` with the text between ``name``'s markers replaced by ``block``."""
    begin, end = f"<!-- {kind}:{name} begin -->", f"<!-- {kind}:{name} end -->"
    if page.count(begin) != 1 or page.count(end) != 1 or page.index(begin) > page.index(end):
        raise StudyFileError(
            f"the page (docs/results.md; README.md for a width study's headline) needs exactly one '{begin}' line "
            f"followed by one '{end}' line where the {name} tables go; add them and run again"
        )
    head, rest = page.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{block}{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="study files (default: docs/data/*.json)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update docs/results.md and the figures")
    mode.add_argument("--check", action="store_true", help="fail when docs/results.md is not what the data give")
    args = parser.parse_args(argv)
    edit = args.write or args.check
    files = args.files or sorted(DATA.glob("*.json"))
    page, readme = (RESULTS.read_text(), README.read_text()) if edit else ("", "")
    updated, updated_readme = page, readme
    try:
        # width studies: one under way (docs/data/partial) changes after every run, so --check leaves it out; a
        # finished file wins over a partial one
        found = [*([] if args.check else DATA.glob("partial/width_*.json")), *DATA.glob("width_*.json")]
        for path in [] if args.files else sorted({p.stem: p for p in found}.values()):
            state = json.loads(path.read_text())
            source = path.relative_to(DATA.parent.parent).as_posix()
            block = width_report.render(state, path.stem, IMAGES if args.write else Path(tempfile.mkdtemp()), source)
            under_way = path.parent.name == "partial"
            if under_way:
                block = f"**Under way** (`docs/data/partial/{path.name}`): what has finished so far.\n\n{block}"
            if edit:
                updated = replace_block(updated, path.stem, block + "\n", "width")
                headline = ("**Under way**: " if under_way else "") + width_report.headline(state)
                updated_readme = replace_block(updated_readme, path.stem, headline + "\n", "width-headline")
            else:
                print(block)
        for path in [f for f in files if not f.stem.startswith("width_")]:
            study = load(path)
            block = markdown(study, path.stem)
            if edit:
                updated = replace_block(updated, path.stem, block)
            else:
                print(block)
            if args.write:
                IMAGES.mkdir(parents=True, exist_ok=True)
                figure(study, path.stem).savefig(IMAGES / f"quality_{path.stem}.png", dpi=110, bbox_inches="tight")
    except StudyFileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path, old, new in ((RESULTS, page, updated), (README, readme, updated_readme)):
        if args.check and new != old:
            fix = "run python -m benchmarks.studies.report --write"
            print(f"{path} differs from what docs/data gives: {fix}", file=sys.stderr)
            return 1
        if args.write and new != old:
            path.write_text(new)
            print(f"updated {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
