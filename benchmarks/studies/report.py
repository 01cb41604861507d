"""Tables and plots of the tuned quality studies, generated from their raw results in ``docs/data/``.

``docs/data/<task>_<corpus>.json`` (written by ``studies/tuned.py``) holds a list ``runs``; each run has at least
``family``, ``size``, ``seed``, ``lr``, ``tokens``, ``params_active``, ``val_loss`` (final) and ``curve`` (a list
of ``[tokens, val_loss]``), plus its ``phase`` (``sweep``, ``check`` or ``final``). A file that does not have that
shape is refused with the run and the field at fault. From each file this script makes:

- the headline table: every (family, size) at its chosen rate, validation perplexity as mean (min .. max) over the
  seeds, active parameters, the compression they reach, training FLOPs (:func:`counted_flops`: a CoMERA run's
  counted through its late stage's ramp) and peak training memory;
- CoMERA against each rival at each size (perplexity ratio and seeds won), the output heads' ranks, and the
  early late-stage schedule's FLOPs against the default's;
- the learning-rate sweeps and checks, the full dense model's convergence over the last quarter of its run, and
  each CoMERA family's late-stage spike and rise;
- one figure: perplexity against active parameters, training FLOPs and peak memory, and the dense curves.

The markdown goes between ``<!-- quality:NAME begin -->`` and ``<!-- quality:NAME end -->`` in docs/results.md
(``--write``); ``--check`` fails when the page differs from what the data give (the suite runs it).

    python -m benchmarks.studies.report --write          # every docs/data/*.json into docs/results.md
    python -m benchmarks.studies.report --check
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Sequence
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
REQUIRED = {
    "family": str,
    "size": (int, float),
    "seed": int,
    "lr": (int, float),
    "tokens": int,
    "params_active": int,
    "val_loss": (int, float),
    "curve": list,
}
FREE_TOLERANCE = 0.05  # "free compression": within 5 % of the full dense model's perplexity
SPIKE_TOLERANCE = 0.05
CONVERGENCE_SHARE = 0.25  # the convergence is read over the run's last quarter (validations at or before 3/4)
# The late-stage schedules studies/tuned.py trains (its run_job), for counting FLOPs through them. The early family's
# ramp is a share of the run (tuned.EARLY_RAMP_FRACTION); the default ScheduledLateStage's is a share of the
# steps left at the switch: 0.6 for a size cut of up to 5x, longer for deeper cuts, at most 0.9
# (comera_lightning.rank_adaptation.late_stage.ramp_fraction_for). The runs do not record the size at the switch,
# so the default's ramp is taken at its shortest, 0.6: exact for cuts of up to 5x, a lower bound on its FLOPs for
# deeper ones.
EARLY_RAMP_SHARE_OF_RUN = 0.4
DEFAULT_RAMP_SHARE_OF_REST = 0.6
RAMPS = {"comera_early": "run", "comera": "rest", "comera_act": "rest"}


class StudyFileError(ValueError):
    """A results file that is not a tuned quality study."""


def validate(study: Any, where: str) -> dict[str, Any]:
    """``study`` when it has the documented shape; else a :class:`StudyFileError` naming the run and the field."""
    fix = "(docs/data files are written by benchmarks/studies/tuned.py; see benchmarks/studies/report.py's docstring)"
    if not isinstance(study, dict) or not isinstance(study.get("runs"), list):
        raise StudyFileError(f"{where}: not a quality study: expected a JSON object with a list 'runs' {fix}")
    for i, run in enumerate(study["runs"]):
        if not isinstance(run, dict):
            raise StudyFileError(f"{where}: runs[{i}] is a {type(run).__name__}, not an object {fix}")
        for key, kind in REQUIRED.items():
            if key not in run:
                raise StudyFileError(f"{where}: runs[{i}] has no '{key}' {fix}")
            if isinstance(run[key], bool) or not isinstance(run[key], kind):
                raise StudyFileError(
                    f"{where}: runs[{i}]['{key}'] is {run[key]!r}, which is not a "
                    f"{getattr(kind, '__name__', 'number')} {fix}"
                )
        if "error" in run:
            continue
        for point in run["curve"]:
            if not (
                isinstance(point, list)
                and len(point) == 2
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in point)
            ):
                raise StudyFileError(
                    f"{where}: runs[{i}]['curve'] holds {point!r}; each point is [tokens, val_loss] {fix}"
                )
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


def diverged(study: dict[str, Any]) -> list[dict[str, Any]]:
    """The final runs that diverged (no finite validation loss): the study drops their rate for that size and runs
    the finals again at a lower one (``tuned.Plan.chosen``)."""
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
    return dict(sorted(out.items(), key=lambda kv: (kv[0][1], ORDER.index(kv[0][0]) if kv[0][0] in ORDER else 99)))


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def perplexities(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    return spread([math.exp(r["val_loss"]) for r in runs])


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
        params = statistics.fmean(r["params_active"] for r in runs)
        row: dict[str, Any] = {"size": size, "comera": mine, "params": params}
        for rival in RIVALS:
            theirs = by.get((rival, size))
            if not theirs:
                continue
            ppl = perplexities(theirs)
            seeds = {r["seed"]: r["val_loss"] for r in theirs}
            wins = [r["val_loss"] < seeds[r["seed"]] for r in runs if r["seed"] in seeds]
            row[rival] = {
                "ratio": ppl["mean"] / mine["mean"] - 1.0,
                "won": f"{sum(wins)}/{len(wins)}",
                "params": statistics.fmean(r["params_active"] for r in theirs),
            }
        rows.append(row)
    return rows


def last_quarter_change(run: dict[str, Any]) -> tuple[float, float] | None:
    """(Relative fall of the validation loss from the last validation at or before 3/4 of the run's tokens to the
    end, the share of the run's tokens that spans); None without such points. The validations come every twelfth
    of the run, so the span is the last quarter give or take a validation interval's rounding."""
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
    """A CoMERA run's worst perplexity after the late-stage switch over its value at the switch (the last
    validation before it), minus 1."""
    switch = _switch_tokens(run)
    if switch is None:
        return None
    before = [loss for tokens, loss in run["curve"] if tokens <= switch]
    after = [loss for tokens, loss in run["curve"] if tokens > switch]
    if not before or not after:
        return None
    return math.exp(max(after) - before[-1]) - 1.0


def late_rise(run: dict[str, Any]) -> float | None:
    """A CoMERA run's worst perplexity after the late-stage switch over the best one before it (its running
    minimum), minus 1; negative when it never rose. Unlike :func:`late_spike` this also sees the rise of a schedule
    that switches while the loss is still falling fast (the early one), whose value at the switch is no reference."""
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
        rows.append(
            {
                "family": family,
                "size": size,
                "switch": sorted({int(r["late_start_step"]) for r in runs if r.get("late_start_step") is not None}),
                "seeds": [r["seed"] for r in runs],
                "spike": spikes,
                "rise": rises,
            }
        )
    return rows


def counted_flops(run: dict[str, Any]) -> float:
    """A run's training FLOPs counted step by step through its late stage: the start model's step FLOPs until the
    switch, then over the ramp a geometric fall from the start's to the end's (the size schedule is geometric,
    ``objectives.scheduled_size``, and the step's FLOPs are taken as following the size), then the end model's to the
    last step. Physical truncation every few dozen steps (50 in the decoder's config) makes the real fall a staircase
    a little behind that curve.
    Without a late stage, or for a schedule this report does not know, the FLOPs the run recorded (tuned.py
    stores ``late * start + (steps - late) * (start + end) / 2``, a linear fall over every step after the switch)."""
    late, kind = run.get("late_start_step"), RAMPS.get(run["family"])
    start, end, steps = run.get("flops_per_step_start"), run.get("flops_per_step_end"), run.get("steps")
    if late is None or kind is None or start is None or end is None or not steps or start <= 0 or end <= 0:
        return float(run.get("train_flops", math.nan))
    ramp = max(
        1, round(EARLY_RAMP_SHARE_OF_RUN * steps if kind == "run" else DEFAULT_RAMP_SHARE_OF_REST * (steps - late))
    )
    total = 0.0
    for step in range(steps):
        progress = min(max((step - late) / ramp, 0.0), 1.0)
        total += start * (end / start) ** progress
    return total


def early_flop_savings(study: dict[str, Any]) -> list[dict[str, Any]]:
    """Per size: the early schedule's mean training FLOPs over the default CoMERA's, minus 1 and negated (a saving),
    counted through both ramps (``counted``) and as the runs stored them (``stored``)."""
    by = finals(study)
    out = []
    for (family, size), runs in by.items():
        default = by.get(("comera", size))
        if family != "comera_early" or not default:
            continue
        counted = statistics.fmean(counted_flops(r) for r in runs) / statistics.fmean(counted_flops(r) for r in default)
        stored = statistics.fmean(r.get("train_flops", math.nan) for r in runs) / statistics.fmean(
            r.get("train_flops", math.nan) for r in default
        )
        out.append({"size": size, "counted": 1.0 - counted, "stored": 1.0 - stored})
    return out


def _head_rank(run: dict[str, Any]) -> int | None:
    heads = [ranks for name, ranks in (run.get("ranks_final") or {}).items() if name.endswith("lm_head")]
    return max(heads[0][1:-1]) if heads and len(heads[0]) > 2 else None


def head_ranks(study: dict[str, Any]) -> list[dict[str, Any]]:
    """Per size: the rank of CoMERA's low-rank output head (``lm_head``) at the start (twice its block rank, the
    config's head share that tuned.family_kwargs keeps) and at the end (min, max over seeds), and the low-rank
    and CoLA rivals' rank, which is their head's too."""
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
        out.append(
            {
                "size": size,
                "comera_start": 2 * int(knobs.pop()) if len(knobs) == 1 and None not in knobs else None,
                "comera": (min(ends), max(ends)),
                "rivals": rivals,
            }
        )
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
        flops = statistics.fmean(counted_flops(r) for r in runs)
        reached = [full / r["params_active"] for r in runs if r["params_active"] > 0] if full else []
        rows.append(
            [
                f"{size:g}x" if family not in ("dense", "galore") else "1x",
                LABELS.get(family, family),
                _k(statistics.fmean(r["params_active"] for r in runs)),
                _range(reached, ".1f", "x") if reached else "-",
                f"{runs[0]['lr']:.3g}",
                cell(perplexities(runs)),
                len(runs),
                f"{flops / 1e12:.2f}",
                "-" if mem is None else f"{mem / 2**20:.1f}",
            ]
        )
    lines += [
        "| size | model | active params | compression reached (min-max) | lr | val perplexity, mean (min .. max) | "
        "seeds | training TFLOPs | peak step memory, MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    lines.append("")
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
        lines += [
            "CoMERA against each rival at the same target size (rival perplexity / CoMERA's - 1: positive means "
            "CoMERA is better; seeds won: seeds where CoMERA's loss is lower than the same seed's rival):",
            "",
        ]
        header = ["size", "CoMERA active params", "CoMERA perplexity"] + [LABELS[r] for r in RIVALS]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in compare:
            cells = [f"{row['size']:g}x", _k(row["params"]), cell(row["comera"])]
            for rival in RIVALS:
                r = row.get(rival)
                cells.append("-" if r is None else f"{r['ratio']:+.1%}, {r['won']} ({_k(r['params'])})")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
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
        lines += [
            "Late stage, per family and size, seed by seed: the spike is the worst perplexity after the switch over "
            f"the value at the switch (target at most +{SPIKE_TOLERANCE:.0%}); the rise, the worst perplexity after "
            "the switch over the best before it (negative: it never rose), which also shows the rise of a schedule "
            "that switches while the loss still falls fast.",
            "",
            "| model | size | switch | seeds | spike, % | rise above the best before, % |",
            "|---|---|---|---|---|---|",
        ]
        for row in late_rows:
            shown = [" / ".join("-" if v is None else f"{100 * v:+.1f}" for v in row[key]) for key in ("spike", "rise")]
            lines.append(
                f"| {LABELS.get(row['family'], row['family'])} | {row['size']:g}x | step "
                + "/".join(str(s) for s in row["switch"])
                + f" | {' / '.join(str(s) for s in row['seeds'])} | {shown[0]} | {shown[1]} |"
            )
        lines.append("")
    lost = diverged(study)
    if lost:
        described = "; ".join(
            f"{LABELS.get(r['family'], r['family'])} {float(r['size']):g}x seed {r['seed']} at lr {r['lr']:.3g}"
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
    lines = [
        f"Learning-rate sweeps and checks ({study.get('protocol', {}).get('sweep_steps')} steps, final "
        "validation loss; bold: the rate the finals use):",
        "",
        "| model | size | " + " | ".join(f"{lr:.3g}" for lr in rates) + " |",
        "|---|---|" + "---|" * len(rates),
    ]
    for (family, size), row in sorted(
        cells.items(), key=lambda kv: (ORDER.index(kv[0][0]) if kv[0][0] in ORDER else 99, kv[0][1])
    ):
        out = []
        for lr in rates:
            if lr not in row:
                out.append("")
                continue
            text = "diverged" if not math.isfinite(row[lr]) else f"{row[lr]:.3f}"
            out.append(
                f"**{text}**"
                if chosen.get((family, size)) is not None and math.isclose(chosen[(family, size)], lr)
                else text
            )
        lines.append(f"| {LABELS.get(family, family)} | {size:g}x | " + " | ".join(out) + " |")
    return [*lines, ""]


# ------------------------------------------------------------------------------------------------------
# the figure


def figure(study: dict[str, Any], name: str):
    """Perplexity against active parameters, training FLOPs and peak memory; the full dense model's curves; every
    family's curve at the middle size (which model left a plateau when)."""
    from benchmarks import harness

    fig, axes = harness.new_figure(5, width=4.6, height=4.0)
    by = finals(study)
    families = [f for f in ORDER if any(family == f for family, _ in by)]
    for i, family in enumerate(families):
        points = [(runs, perplexities(runs)) for (fam, _), runs in by.items() if fam == family]
        for ax, key in zip(axes[:3], ("params_active", "train_flops", "peak_memory"), strict=True):
            xs, ys, errs = [], [], [[], []]
            for runs, ppl in points:
                if key == "peak_memory":
                    value = runs[0].get("peak_memory", {}).get("total")
                elif key == "train_flops":
                    value = statistics.fmean(counted_flops(r) for r in runs)
                else:
                    value = statistics.fmean(r.get(key, math.nan) for r in runs)
                if value is None or not math.isfinite(value):
                    continue
                xs.append(value)
                ys.append(ppl["mean"])
                errs[0].append(ppl["mean"] - ppl["min"])
                errs[1].append(ppl["max"] - ppl["mean"])
            if xs:
                order = sorted(range(len(xs)), key=xs.__getitem__)
                ax.errorbar(
                    [xs[j] for j in order],
                    [ys[j] for j in order],
                    yerr=[[errs[0][j] for j in order], [errs[1][j] for j in order]],
                    marker="o",
                    capsize=3,
                    label=LABELS[family],
                    color=f"C{i}",
                )
    for ax, xlabel in zip(
        axes[:3], ("active parameters at the end", "training FLOPs", "peak step memory, bytes"), strict=True
    ):
        harness.label_axes(ax, xlabel, "validation perplexity", xlog=True, ylog=True)
    for run in by.get(("dense", 1.0), []):
        axes[3].plot([t for t, _ in run["curve"]], [math.exp(v) for _, v in run["curve"]], label=f"seed {run['seed']}")
    harness.label_axes(axes[3], "tokens", "full dense: validation perplexity", ylog=True)
    sizes = sorted({size for family, size in by if family not in ("dense", "galore")})
    middle = 5.0 if 5.0 in sizes else (sizes[len(sizes) // 2] if sizes else None)
    for i, family in enumerate(families):
        runs = by.get((family, 1.0 if family in ("dense", "galore") else middle), [])
        if runs:
            run = min(runs, key=lambda r: r["seed"])
            axes[4].plot(
                [t for t, _ in run["curve"]],
                [v for _, v in run["curve"]],
                label=f"{LABELS[family]} (seed {run['seed']})",
                color=f"C{i}",
            )
    harness.label_axes(axes[4], "tokens", f"validation loss at {middle:g}x (full width at 1x)" if middle else "")
    fig.suptitle(f"{name}: tuned quality study")
    return fig


# ------------------------------------------------------------------------------------------------------
# docs/results.md


def markers(name: str, kind: str = "quality") -> tuple[str, str]:
    return f"<!-- {kind}:{name} begin -->", f"<!-- {kind}:{name} end -->"


def replace_block(page: str, name: str, block: str, kind: str = "quality") -> str:
    """``page`` with the text between ``name``'s markers replaced by ``block``."""
    begin, end = markers(name, kind)
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
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--readme", type=Path, default=README, help="gets the width study's headline table")
    args = parser.parse_args(argv)
    files = args.files or sorted(DATA.glob("*.json"))
    page = args.results.read_text() if (args.write or args.check) else ""
    readme = args.readme.read_text() if (args.write or args.check) else ""
    updated, updated_readme = page, readme
    try:
        # width studies (their own format and renderer); one still running is rendered from docs/data/partial
        # a study under way (docs/data/partial) changes after every run: --write renders it, --check leaves it out
        found = [*([] if args.check else DATA.glob("partial/width_*.json")), *DATA.glob("width_*.json")]
        widths = [] if args.files else sorted({p.stem: p for p in found}.values())  # a finished file wins
        for path in widths:
            state = json.loads(path.read_text())
            source = path.relative_to(DATA.parent.parent).as_posix()
            block = width_report.render(state, path.stem, IMAGES if args.write else Path(tempfile.mkdtemp()), source)
            if path.parent.name == "partial":
                block = f"**Under way** (`docs/data/partial/{path.name}`): what has finished so far.\n\n{block}"
            if args.write or args.check:
                updated = replace_block(updated, path.stem, block + "\n", "width")
                headline = width_report.headline(state)
                if path.parent.name == "partial":
                    headline = f"**Under way**: {headline}"
                updated_readme = replace_block(updated_readme, path.stem, headline + "\n", "width-headline")
            else:
                print(block)
        for path in [f for f in files if not f.stem.startswith("width_")]:
            study = load(path)
            block = markdown(study, path.stem)
            if args.write or args.check:
                updated = replace_block(updated, path.stem, block)
            else:
                print(block)
            if args.write:
                fig = figure(study, path.stem)
                IMAGES.mkdir(parents=True, exist_ok=True)
                fig.savefig(IMAGES / f"quality_{path.stem}.png", dpi=110, bbox_inches="tight")
    except StudyFileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path, old, new in ((args.results, page, updated), (args.readme, readme, updated_readme)):
        if args.check and new != old:
            print(
                f"{path} differs from what docs/data gives: run python -m benchmarks.studies.report --write",
                file=sys.stderr,
            )
            return 1
        if args.write and new != old:
            path.write_text(new)
            print(f"updated {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
