"""Tables and figures of a width study (``studies/width.py``'s JSON): the fronts, the rate transfer, where compute goes.

``render(state, figure_dir)`` returns the markdown that ``report.py --write`` puts between the study's
``<!-- width:NAME begin/end -->`` markers in docs/results.md, and writes its figures. Every number comes from the
JSON; a study still under way renders what it has and says what is missing.

    python -m benchmarks.studies.width_report docs/data/width_stdlib.json     # print the markdown
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .tuned import MAX_EXTENSIONS, check_rates, finite, sweep_rates

REPO = Path(__file__).resolve().parents[2]
LABELS = {"dense": "dense", "comera": "CoMERA (early schedule)", "tt": "TT, one uniform rank"}
TENSORISED = ("comera", "tt")
SHORT = {"dense": "dense", "comera": "CoMERA", "tt": "the uniform TT"}
COLOURS = {"dense": "tab:blue", "comera": "tab:red", "tt": "tab:green"}
FRONTS = (
    ("train_flops", "training FLOPs", 1e12, "TFLOPs"),
    ("train_s_alone", "training clock, run alone", 1.0, "s"),
    ("params_active", "active parameters", 1e3, "k"),
    ("peak_memory", "peak training-step memory", 2**20, "MiB"),
)


def alone_seconds(run: dict[str, Any], clock: dict[str, Any]) -> float | None:
    """``run``'s training clock on a quiet machine: the sum over its counted FLOPs schedule of steps x step time,
    the step time read linearly in FLOPs between its start and end shapes as ``width_clock.py`` timed them (one
    shape: a constant step). None if its start shape was not timed."""
    times, flops = clock["step_s"], clock["step_flops"]
    start, end = (f"{run['family']}/{run['width']}/{shape}" for shape in ("start", "end"))
    if start not in times:
        return None
    f0, t0 = flops[start], times[start]
    f1, t1 = (flops[end], times[end]) if end in times else (f0, t0)
    changes = run["flops_per_step"]
    total = 0.0
    for (first, per_step), (following, _) in zip(changes, [*changes[1:], (run["steps"], 0)], strict=True):
        seconds = t0 if f1 == f0 else t0 + (per_step - f0) * (t1 - t0) / (f1 - f0)
        total += max(0, min(following, run["steps"]) - first) * seconds
    return total


def finals(state: dict[str, Any], seed: int = 0) -> list[dict[str, Any]]:
    """The finished final runs of ``seed`` (seed 0's are the fronts' points), ordered by family and width, each with
    its clock run alone (``train_s_alone``) once ``width_clock.py`` has timed its shape."""
    order = {f: i for i, f in enumerate(LABELS)}
    runs = [r for r in state["runs"] if r["phase"] == "final" and r["seed"] == seed and "error" not in r]
    clock = state.get("clock_alone")
    if clock is not None:
        runs = [{**r, "train_s_alone": alone_seconds(r, clock)} for r in runs]
    return sorted(runs, key=lambda r: (order.get(r["family"], 9), r["width"]))


def final_losses(state: dict[str, Any], family: str, width: int) -> dict[int, float]:
    """Seed -> final validation loss of ``family`` at ``width``, over its finished seeds."""
    return {
        r["seed"]: r["val_loss"]
        for r in state["runs"]
        if r["phase"] == "final" and r["family"] == family and r["width"] == width and finite(r.get("val_loss"))
    }


def seed_spread(state: dict[str, Any], family: str, width: int) -> tuple[float, float, int] | None:
    """(mean, max - min, seeds) of the final validation loss of ``family`` at ``width`` over its finished seeds."""
    losses = list(final_losses(state, family, width).values())
    if not losses:
        return None
    return sum(losses) / len(losses), max(losses) - min(losses), len(losses)


def finals_table(state: dict[str, Any]) -> str:
    lines = [
        "| model | d_model | rank | lr | active params (start) | val loss (perplexity) | seeds, spread | "
        "training TFLOPs | training clock, s: alone (beside another run) | peak step memory, MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in finals(state):
        spread = seed_spread(state, r["family"], r["width"])
        seeds = "1" if spread is None or spread[2] == 1 else f"{spread[2]}, {spread[1]:.3f}"
        memory, alone = r.get("peak_memory"), r.get("train_s_alone")
        start = r.get("params_at_start", r["params_active"])
        params = f"{r['params_active'] / 1e3:,.0f} k" + (
            f" ({start / 1e3:,.0f} k)" if start != r["params_active"] else ""
        )
        lines.append(
            f"| {LABELS[r['family']]} | {r['width']} | {r.get('rank') or '-'} | {r['lr']:g} | {params} | "
            f"{r['val_loss']:.3f} ({math.exp(r['val_loss']):.1f}) | {seeds} | {r['train_flops'] / 1e12:.2f} | "
            f"{'-' if alone is None else f'{alone:.0f}'} ({r['train_s']:.0f}) | "
            f"{'-' if memory is None else f'{memory / 2**20:.1f}'} |"
        )
    return "\n".join(lines)


def short_runs(state: dict[str, Any], family: str, width: int, parameterization: str) -> dict[float, float]:
    """Rate -> final validation loss of every short run (sweep, check, transfer) of one (family, width, param)."""
    return {
        r["lr"]: r["val_loss"]
        for r in state["runs"]
        if r["phase"] != "final"
        and r["family"] == family
        and r["width"] == width
        and r["parameterization"] == parameterization
    }


def best(losses: dict[float, float]) -> float | None:
    kept = {lr: v for lr, v in losses.items() if finite(v)}
    return min(kept, key=lambda lr: (kept[lr], lr)) if kept else None


def rates_table(state: dict[str, Any]) -> str:
    """Every short run's loss by rate, one row per (family, width, parameterisation); bold: the row's best."""
    keys = sorted(
        {(r["family"], r["width"], r["parameterization"]) for r in state["runs"] if r["phase"] != "final"},
        key=lambda k: (list(LABELS).index(k[0]), k[2], k[1]),
    )
    rates = sorted({r["lr"] for r in state["runs"] if r["phase"] != "final"})
    lines = [
        "| model | parameterisation | d_model | " + " | ".join(f"{lr:g}" for lr in rates) + " |",
        "|---|---|---|" + "---|" * len(rates),
    ]
    for family, width, param in keys:
        losses = short_runs(state, family, width, param)
        chosen = best(losses)
        cells = []
        for lr in rates:
            value = losses.get(lr)
            text = "" if value is None else (f"{value:.3f}" if finite(value) else "diverged")
            cells.append(f"**{text}**" if lr == chosen else text)
        lines.append(f"| {LABELS[family]} | {param} | {width} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def settled(losses: dict[float, float], grid: Sequence[float], extensions: int = MAX_EXTENSIONS) -> float | None:
    """The rate a finished sweep over ``grid`` (grown past an edge up to ``extensions`` times, as the study grows it)
    chose; None while the sweep still has rates to run, so a half-run sweep never reports a best rate."""
    return sweep_rates(losses, grid, extensions)[1] if losses else None


def transfer(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per parameterisation: the uniform-rank TT's best rate at each transfer width (whole-grid sweeps) and how far
    it moved (a factor, >= 1; None until both sweeps have finished)."""
    widths, grid = state["protocol"]["transfer_widths"], state["protocol"]["grid"]
    out: dict[str, dict[str, Any]] = {}
    for param in ("standard", "mup"):
        chosen = {w: settled(short_runs(state, "tt", w, param), grid) for w in widths}
        moved = None
        if all(chosen.values()):
            a, b = chosen[widths[0]], chosen[widths[-1]]
            moved = max(a, b) / min(a, b)  # type: ignore[type-var,operator]
        out[param] = {"best": chosen, "moved": moved}
    return out


def protocol_transfer(state: dict[str, Any]) -> list[tuple[str, int, float, int, float]]:
    """Per family: (family, smallest width, its swept rate, largest width, its checked rate), once both settled."""
    rows = []
    grid = state["protocol"]["grid"]
    for family, widths in state["protocol"]["widths"].items():
        param = state["protocol"]["parameterization"] if family != "dense" else "standard"
        small, large = min(widths), max(widths)
        swept = settled(short_runs(state, family, small, param), grid)
        if swept is None:
            continue
        extensions = state["protocol"].get("check_extensions", MAX_EXTENSIONS)
        checked = settled(short_runs(state, family, large, param), check_rates(swept), extensions)
        if checked is not None:
            rows.append((family, small, swept, large, checked))
    return rows


def transfer_lines(state: dict[str, Any]) -> list[str]:
    widths = state["protocol"]["transfer_widths"]
    lines = []
    for param, found in transfer(state).items():
        picks = ", ".join(f"d {w}: {lr:g}" if lr else f"d {w}: not finished" for w, lr in found["best"].items())
        moved = "is not measured yet" if found["moved"] is None else f"moves {found['moved']:g}x"
        lines.append(f"- `{param}`: best rate {picks}; from d {widths[0]} to d {widths[-1]} it {moved}.")
    for family, small, swept, large, checked in protocol_transfer(state):
        factor = max(swept, checked) / min(swept, checked)
        lines.append(
            f"- {LABELS[family]} (the protocol's sweep and check): {swept:g} at d {small}, {checked:g} at d {large}: "
            f"the best rate moves {factor:g}x."
        )
    return lines


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """The loss at ``x`` on the piecewise-linear curve through ``points`` in (log x, loss); None outside them."""
    pts = sorted(points)
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            t = 0.0 if x1 == x0 else (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return None


def compare(state: dict[str, Any], family: str, key: str, seed: int = 0) -> list[tuple[int, float, str, bool | None]]:
    """Per finished width of ``family``: (width, its loss, the cell text, whether it beats dense at that cost), both
    of ``seed`` (each seed validates on its own sample of the held-out rows).

    Inside dense's range dense's loss is read off its front. Outside it nothing is extrapolated; the family still
    loses where a dense model at no more cost has a lower loss, and wins where one at no less cost has a higher
    loss. The verdict is None where neither holds."""
    runs = finals(state, seed)
    dense = [r for r in runs if r["family"] == "dense" and finite(r.get(key))]
    rows = []
    for r in runs:
        if r["family"] != family or not finite(r.get(key)):
            continue
        cost, loss = r[key], r["val_loss"]
        read = interpolate([(d[key], d["val_loss"]) for d in dense], cost)
        if read is not None:
            rows.append((r["width"], loss, f"{read:.3f} ({(loss - read) / read:+.1%})", loss < read))
            continue
        cheaper_better = [d for d in dense if d[key] <= cost and d["val_loss"] < loss]
        costlier_worse = [d for d in dense if d[key] >= cost and d["val_loss"] > loss]
        if cheaper_better:
            d = min(cheaper_better, key=lambda d: d["val_loss"])
            rows.append((r["width"], loss, f"behind dense d {d['width']} ({d['val_loss']:.3f} at less)", False))
        elif costlier_worse:
            d = max(costlier_worse, key=lambda d: d["val_loss"])
            rows.append((r["width"], loss, f"ahead of dense d {d['width']} ({d['val_loss']:.3f} at more)", True))
        else:
            rows.append((r["width"], loss, "outside dense's range", None))
    return rows


def beside_dense(width: int, loss: float, text: str) -> str:
    """One :func:`compare` row as prose: ``d 256: 3.779 against 3.486 (+8.4%)`` where dense's front was read at the
    same cost, else ``d 128: 4.278, outside dense's range`` (or behind / ahead of a dense model)."""
    return f"d {width}: {loss:.3f}" + (f" against {text}" if text[0].isdigit() else f", {text}")


def moonshot_lines(state: dict[str, Any], seed: int = 0) -> list[str]:
    """Each tensorised family against dense at equal training FLOPs and at equal active parameters, per width, all
    of ``seed``; later seeds list only the widths where dense's front reaches."""
    lines = []
    for family in TENSORISED:
        for key, what in (("train_flops", "equal training FLOPs"), ("params_active", "equal active parameters")):
            rows = compare(state, family, key, seed)
            cells = [beside_dense(w, loss, text) for w, loss, text, wins in rows if seed == 0 or wins is not None]
            if cells:
                lines.append(f"- {LABELS[family]} against dense at {what}: " + "; ".join(cells) + ".")
    return lines


def later_seed_lines(state: dict[str, Any]) -> list[str]:
    """:func:`moonshot_lines` of every later seed with dense finals, each read off that seed's own dense front."""
    seeds = sorted({r["seed"] for r in state["runs"] if r["phase"] == "final" and r["family"] == "dense"} - {0})
    return [f"{line[:2]}seed {seed}: {line[2:]}" for seed in seeds for line in moonshot_lines(state, seed)]


def seed_lines(state: dict[str, Any], family: str = "comera", rival: str = "tt") -> list[str]:
    """``family`` against ``rival`` at each width both trained, seed by seed: each seed validates on its own sample of
    the held-out rows, so only differences within a seed compare."""

    lines = []
    widths = state["protocol"]["widths"]
    for width in sorted(set(widths.get(family, ())) & set(widths.get(rival, ()))):
        ours, theirs = final_losses(state, family, width), final_losses(state, rival, width)
        seeds = sorted(set(ours) & set(theirs))
        if not seeds:
            continue
        gaps = [ours[s] - theirs[s] for s in seeds]
        ahead = sum(gap < 0 for gap in gaps)
        each = "; ".join(
            f"{SHORT[name]} " + " / ".join(f"{by_seed[s]:.3f}" for s in seeds)
            for name, by_seed in ((family, ours), (rival, theirs))
        )
        lines.append(
            f"- d {width}, seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}: {SHORT[family]} minus "
            f"{SHORT[rival]} " + ", ".join(f"{g:+.3f}" for g in gaps) + f" (mean {sum(gaps) / len(gaps):+.3f}); "
            f"ahead in {ahead} of {len(seeds)}. The losses: {each}."
        )
    return lines


def headline_table(state: dict[str, Any], family: str = "comera") -> str:
    """``family``'s place on every front, one row per width: its loss, and dense's at the same cost (the change:
    negative where ``family`` wins; see :func:`compare`)."""
    columns = [(key, label.split(" (")[0]) for key, label, _, _ in FRONTS]
    per_front = {key: {width: text for width, _, text, _ in compare(state, family, key)} for key, _ in columns}
    lines = [
        "| d_model | active params | val loss | " + " | ".join(f"dense at equal {x}" for _, x in columns) + " |",
        "|---" * (3 + len(columns)) + "|",
    ]
    for r in finals(state):
        if r["family"] == family:
            cells = [per_front[key].get(r["width"], "not measured") for key, _ in columns]
            size = f"{r['params_active'] / 1e3:,.0f} k"
            lines.append(f"| {r['width']} | {size} | {r['val_loss']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline(state: dict[str, Any], family: str = "comera") -> str:
    """The README's paragraph: ``family``'s place on each front at each width measured, and where it wins."""
    protocol = state["protocol"]
    done = [r for r in finals(state) if r["family"] in (family, "dense")]
    expected = len(protocol["widths"].get(family, ())) + len(protocol["widths"].get("dense", ()))
    verdicts: dict[bool, dict[str, list[str]]] = {True: {}, False: {}}
    for key, label, _, _ in FRONTS:
        for width, _, _, wins in compare(state, family, key):
            if wins is not None:
                verdicts[wins].setdefault(label.split(" (")[0], []).append(str(width))
    runs = f"{protocol['steps']} steps ({protocol['steps'] * 2048 / 1e6:.1f} M tokens) a run, seed 0"
    lead = (
        f"{LABELS[family]}, tensorised families under `{protocol['parameterization']}`, against dense read off "
        f"dense's own front at the same cost; {runs}; {len(done)} of {expected} of these finals finished."
    )
    if not any(r["family"] == family for r in done):
        return f"{lead} No {LABELS[family]} final has finished yet."
    below, above = (
        "; ".join(f"{front} at d {', '.join(widths)}" for front, widths in verdicts[w].items()) or "nowhere"
        for w in (True, False)
    )
    verdict = f"Below dense at the same cost: {below}. Above: {above}."
    return "\n".join([lead, "", headline_table(state, family), "", verdict])


def compute_per_token(state: dict[str, Any]) -> str:
    """Training FLOPs per token against 6 x active parameters (forward + backward of a dense layer), per final, and
    the share of them spent on the zero slices a CPU pads the bottleneck with (``width_clock.py`` counts them)."""
    clock = state.get("clock_alone") or {}
    run_flops, unpadded = clock.get("step_flops", {}), clock.get("step_flops_unpadded", {})
    lines = [
        "| model | d_model | FLOPs / token (start -> end) | 6 x active params (end) | ratio | "
        "zero padding (start, end) |",
        "|---|---|---|---|---|---|",
    ]
    for r in finals(state):
        shares = [
            f"{1 - unpadded[key] / run_flops[key]:.1%}"
            for key in (f"{r['family']}/{r['width']}/{shape}" for shape in ("start", "end"))
            if key in unpadded
        ]
        steps = r.get("flops_per_step") or []
        if not steps:
            continue
        tokens_per_step = r["tokens"] / r["steps"]
        start, end = steps[0][1] / tokens_per_step, steps[-1][1] / tokens_per_step
        reference = 6 * r["params_active"]
        lines.append(
            f"| {LABELS[r['family']]} | {r['width']} | {start / 1e6:.2f} M -> {end / 1e6:.2f} M | "
            f"{reference / 1e6:.2f} M | {end / reference:.2f}x | {', '.join(shares) or 'not counted'} |"
        )
    return "\n".join(lines)


def _figure(ncols: int, width: float):
    """A row of ``ncols`` plots sharing the loss axis, ``width`` inches wide in all (drawn without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width, 3.6), sharey=True)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fronts(state: dict[str, Any], path: Path) -> None:
    runs = finals(state)
    fig, axes = _figure(len(FRONTS), 4.2 * len(FRONTS))
    for ax, (key, label, scale, unit) in zip(axes, FRONTS, strict=True):
        for family in LABELS:
            pts = sorted(
                (r[key] / scale, r["val_loss"], r["width"])
                for r in runs
                if r["family"] == family and finite(r.get(key))
            )
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLOURS[family], label=LABELS[family])
            for x, y, w in pts:
                ax.annotate(str(w), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel(f"{label} ({unit})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final validation loss")
    axes[0].legend(fontsize=8)
    _save(fig, path)


def plot_transfer(state: dict[str, Any], path: Path) -> None:
    widths = state["protocol"]["transfer_widths"]
    fig, axes = _figure(2, 9)
    for ax, param in zip(axes, ("standard", "mup"), strict=True):
        for width, style in zip(widths, ("o--", "o-"), strict=False):
            losses = {lr: v for lr, v in short_runs(state, "tt", width, param).items() if finite(v)}
            if losses:
                lrs = sorted(losses)
                ax.plot(lrs, [losses[lr] for lr in lrs], style, label=f"d_model {width}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{param}: uniform-rank TT decoder")
        ax.set_xlabel("learning rate (cores and other weights)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel(f"validation loss after {state['protocol']['sweep_steps']} steps")
    _save(fig, path)


def clock_line(state: dict[str, Any]) -> str:
    """How the clock run alone was measured, or that it was not."""
    clock = state.get("clock_alone")
    if clock is None:
        return "The clock run alone is not measured yet (`python -m benchmarks.studies.width_clock`)."
    other = "; some rounds had other load on the machine" if clock["contended"] else ""
    return (
        f"Clock run alone: every final's training step timed by `python -m benchmarks.studies.width_clock` on a quiet "
        f"machine ({clock['threads']} threads, {clock['repeats']} interleaved rounds, {clock['measured_at']}{other}), "
        "CoMERA's at its start and end ranks, summed over each run's counted FLOPs schedule; Lightning's loop, data "
        "loading and validation are not in it. In brackets: the study's own clock, beside another run."
    )


def render(state: dict[str, Any], name: str, figure_dir: Path, source: str | None = None) -> str:
    """The markdown of the study in ``state`` read from ``source`` (its figures written into ``figure_dir``)."""
    protocol = state["protocol"]
    done = finals(state)
    expected = sum(len(w) for w in protocol["widths"].values())
    later = [r for r in state["runs"] if r["phase"] == "final" and r["seed"] != 0 and "error" not in r]
    fronts, transfer_png = figure_dir / f"{name}_fronts.png", figure_dir / f"{name}_transfer.png"
    if done:
        plot_fronts(state, fronts)
    plot_transfer(state, transfer_png)
    tokens = protocol["steps"] * 2048
    origin = source or f"docs/data/{name}.json"
    header = (
        f"Generated by `python -m benchmarks.studies.report --write` from `{origin}` ({len(state['runs'])} runs, "
        f"{state.get('worker_hours', 0):.1f} worker-hours)."
    )
    rates = [
        "Learning-rate transfer (the uniform-rank TT):",
        "",
        *transfer_lines(state),
        "",
        f"![transfer](img/{transfer_png.name})",
        "",
        "Every short run (validation loss; bold: the row's best):",
        "",
        rates_table(state),
    ]
    if not done:
        return "\n".join([f"{header} No final run has finished yet.", "", *rates])
    out = [
        header,
        "",
        f"Final runs: {protocol['steps']} steps, {tokens / 1e6:.2f} M tokens each; short runs "
        f"{protocol['sweep_steps']} steps. Tensorised families under `{protocol['parameterization']}`, dense under "
        f"`standard`. Finals finished: {len(done)} of {expected} at seed 0, and {len(later)} of later seeds.",
        "",
        finals_table(state),
        "",
        clock_line(state),
        "",
        f"![fronts](img/{fronts.name})",
        "",
        *rates,
        "",
        "Against dense on its own front (a negative change: lower loss than dense at the same cost):",
        "",
        *moonshot_lines(state),
        *later_seed_lines(state),
        "",
        f"{LABELS['comera']} against {SHORT['tt']} at the same width and size, seed by seed (each seed validates on "
        "its own sample of the held-out rows, so losses compare within a seed):",
        "",
        *seed_lines(state),
        "",
        "Where the compute goes (measured FLOPs of a training step per token):",
        "",
        compute_per_token(state),
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--figure-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args(argv)
    state = json.loads(args.path.read_text())
    print(render(state, args.path.stem, args.figure_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
