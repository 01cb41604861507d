"""TTLinear against nn.Linear, against one-shot einsum baselines, and every forced contraction plan.

Per case (shape, rows, rank), one forward + backward of ``nn.Linear``, ``planner`` (the plan ``plan_tt_linear``
picks), ``plan:<name>`` (each of ``comera_lightning.tt.PLANS`` forced), ``torch.einsum`` and ``tensorly+oe``, timed
interleaved; memory as parameter, gradient and saved-for-backward bytes. benchmarks/README.md has the details.

    python -m benchmarks.bench_tt_linear            # 36 cases, about 4 minutes on 2 quiet CPU cores
    python -m benchmarks.bench_tt_linear --quick    # 8 cases, about 30 s
"""

from __future__ import annotations

import functools
import math
import string
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import tensorly as tl
import torch
from tensorly import plugins
from torch import nn

from benchmarks import harness
from benchmarks.harness import mib, ms, table
from comera_lightning import TTLinear
from comera_lightning.tt import PLANS, plan_costs, plan_tt_linear

SHAPES = {
    "768x768": (768, 768, (12, 8, 8), (8, 8, 12)),
    "768x3072": (768, 3072, (12, 8, 8), (12, 16, 16)),
    "3072x768": (3072, 768, (12, 16, 16), (12, 8, 8)),
}
MAIN_RANK, MAIN_ROWS = 30, 4096
TARGET_SHAPES = ("768x768", "768x3072")  # the >= 5x targets
TARGET_SPEEDUP = 5.0
NOISE_TOL = 0.05  # "within noise" annotation for comparisons of medians (the verdicts stay strict)
FULL_GRID = dict(shapes=tuple(SHAPES), rows=(1, 32, 512, 4096), ranks=(8, 30, 64))
QUICK_GRID = dict(shapes=("768x768",), rows=(1, 32, 512), ranks=(8, 64))
EINSUM_NAMES = ("torch.einsum", "tensorly+oe")
JSON_NAME, PNG_NAME = "tt_linear.json", "tt_linear.png"
PAIRED = ("shape", "rows", "rank")


@dataclass(frozen=True)
class Case:
    """One layer shape, batch of rows and TT rank."""

    shape: str
    rows: int
    rank: int

    @property
    def is_main(self) -> bool:
        """One of the main cases (rank 30, 4096 rows)."""
        return self.rank == MAIN_RANK and self.rows == MAIN_ROWS


def build_cases(quick: bool) -> list[Case]:
    """Main shapes (rank 30, 4096 rows) first, then the grid, without duplicates."""
    cases = [Case(s, MAIN_ROWS, MAIN_RANK) for s in (TARGET_SHAPES if quick else SHAPES)]
    grid = QUICK_GRID if quick else FULL_GRID
    for case in (Case(s, rows, rank) for s in grid["shapes"] for rank in grid["ranks"] for rows in grid["rows"]):
        if case not in cases:
            cases.append(case)
    return cases


def tt_equation(num_in: int, num_out: int) -> str:
    """``b i1..ip, r0 i1 r1, ..., r_{p+q-1} o_q r_{p+q} -> b o1..oq`` (boundary ranks of size 1 summed)."""
    letters = iter(string.ascii_letters)
    ins = [next(letters) for _ in range(num_in)]
    outs = [next(letters) for _ in range(num_out)]
    bonds = [next(letters) for _ in range(num_in + num_out + 1)]
    batch = next(letters)
    modes = ins + outs
    terms = [batch + "".join(ins)] + [bonds[k] + modes[k] + bonds[k + 1] for k in range(len(modes))]
    return ",".join(terms) + "->" + batch + "".join(outs)


def make_candidates(case: Case, seed: int) -> tuple[dict[str, tuple[Callable, list]], TTLinear, torch.Tensor]:
    """name -> (forward, parameters) for nn.Linear, the planner, every forced plan and the two einsum baselines,
    on one seeded layer and input ``x``."""
    in_f, out_f, in_modes, out_modes = SHAPES[case.shape]
    torch.manual_seed(seed)
    x = torch.randn(case.rows, in_f, requires_grad=True)
    dense = nn.Linear(in_f, out_f)
    layer = TTLinear(in_f, out_f, case.rank, in_modes=list(in_modes), out_modes=list(out_modes))
    assert math.prod(layer.in_modes) == in_f and math.prod(layer.out_modes) == out_f
    x_shape, equation = (case.rows, *layer.in_modes), tt_equation(len(layer.in_modes), len(layer.out_modes))

    def tt_forward(plan: str | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            layer.contraction_plan = plan  # as set_contraction_plan, without re-validating every call
            return layer(x)

        return run

    def einsum(fn) -> Callable[[], torch.Tensor]:
        return lambda: fn(equation, x.reshape(x_shape), *layer.gated_cores()).reshape(case.rows, out_f) + layer.bias

    for plan in PLANS:  # validate the names once through the public API
        layer.set_contraction_plan(plan)
    layer.set_contraction_plan(None)
    tt_params = list(layer.parameters())
    cands = {"nn.Linear": (lambda: dense(x), list(dense.parameters())), "planner": (tt_forward(None), tt_params)}
    cands.update({f"plan:{p}": (tt_forward(p), tt_params) for p in PLANS})
    cands.update({"torch.einsum": (einsum(torch.einsum), tt_params), "tensorly+oe": (einsum(tl.einsum), tt_params)})
    return cands, layer, x


def measure_memory(forward: Callable, params: list, x: torch.Tensor, grad_out: torch.Tensor) -> dict:
    """Unique storages saved for backward (input / parameters / other), parameters and gradients, in bytes."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    x_ptr = x.untyped_storage().data_ptr()
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    torch.autograd.grad(y, [x, *params], grad_out)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    saved_other = sum(n for ptr, n in seen.items() if ptr != x_ptr and ptr not in param_ptrs)
    return {
        "saved_other_bytes": saved_other,
        "saved_input_bytes": seen.get(x_ptr, 0),
        "saved_param_bytes": sum(n for ptr, n in seen.items() if ptr in param_ptrs),
        "param_bytes": param_bytes,
        "grad_bytes": param_bytes,
        "total_bytes": param_bytes * 2 + saved_other,
    }


def run_case(case: Case, seed: int, **timing) -> dict:
    """One case: correctness check, memory per candidate, then every candidate timed by ``harness.interleave``."""
    cands, layer, x = make_candidates(case, seed)
    in_f, out_f, _, _ = SHAPES[case.shape]
    grad_out = torch.randn(case.rows, out_f, generator=torch.Generator().manual_seed(seed + 1))
    steps = {name: (lambda f=f, p=p: torch.autograd.grad(f(), [x, *p], grad_out)) for name, (f, p) in cands.items()}
    with torch.no_grad():  # correctness (untimed): every TT candidate must give the planner's output
        reference = cands["planner"][0]()
        scale = reference.abs().max().item() or 1.0
        errors = {n: (f() - reference).abs().max().item() / scale for n, (f, _) in cands.items() if n != "nn.Linear"}
    memory = {}
    for name, (forward, params) in cands.items():
        steps[name]()  # plans and einsum paths cached before memory is measured
        memory[name] = measure_memory(forward, params, x, grad_out)
    timing = harness.interleave(steps, seed=seed, **timing)
    summary = timing.summary()
    ranks = list(layer.ranks)
    pick = plan_tt_linear(layer.in_modes, layer.out_modes, ranks, case.rows, "cpu", x.element_size())
    modelled = {c.plan: c.seconds for c in plan_costs(layer.in_modes, layer.out_modes, ranks, case.rows, "cpu", 4)}
    med, best = summary["median_s"], summary["min_s"]
    forced = {p: med[f"plan:{p}"] for p in PLANS}
    fastest = min(forced, key=forced.get)
    best_einsum = min(EINSUM_NAMES, key=med.get)
    paired = timing.paired_ratios("nn.Linear", "planner")  # a noise indicator for the headline ratio
    keys = ("samples_s", "inner_iterations")
    entries = {n: {"median_s": med[n], "min_s": best[n], **{k: summary[k][n] for k in keys}} for n in cands}
    for n, entry in entries.items():
        entry.update(memory=memory[n], max_rel_err_vs_planner=errors.get(n))
    return {
        **{"shape": case.shape, "in_features": in_f, "out_features": out_f, "rows": case.rows, "rank": case.rank},
        **{"in_modes": list(layer.in_modes), "out_modes": list(layer.out_modes), "ranks": ranks, "main": case.is_main},
        **{k: summary[k] for k in ("rounds_total", "rounds_clean", "contended", "other_load_median", "rounds")},
        "rounds_used": len(paired),
        "noise_cell": timing.noise_cell(),
        "planner_pick": pick,
        "modelled_seconds": modelled,
        "modelled_order": sorted(modelled, key=modelled.get),
        "candidates": entries,
        "measured_plan_order": sorted(forced, key=forced.get),
        "fastest_forced_plan": fastest,
        "best_einsum": best_einsum,
        "ratios": {
            "dense_time_over_tt_time": med["nn.Linear"] / med["planner"],
            "dense_time_over_tt_time_paired_min": min(paired),
            "dense_time_over_tt_time_paired_max": max(paired),
            "dense_time_over_tt_time_of_minima": best["nn.Linear"] / best["planner"],
            "dense_mem_over_tt_mem": memory["nn.Linear"]["total_bytes"] / memory["planner"]["total_bytes"],
            "best_einsum_time_over_planner_time": med[best_einsum] / med["planner"],
            "best_einsum_time_over_planner_time_of_minima": min(best[n] for n in EINSUM_NAMES) / best["planner"],
            "torch_einsum_time_over_planner_time": med["torch.einsum"] / med["planner"],
            "tensorly_time_over_planner_time": med["tensorly+oe"] / med["planner"],
            "planner_time_over_fastest_forced_plan": med["planner"] / forced[fastest],
            "picked_forced_time_over_fastest_forced": forced[pick] / forced[fastest],
        },
    }


# ------------------------------------------------------------------------------------------------------
# reporting


def evaluate_targets(results: list[dict]) -> dict:
    """Verdicts: TTLinear >= 5x faster than nn.Linear on the main cases; planner never slower than einsum."""
    speed = []
    for r in results:
        if r["main"] and r["shape"] in TARGET_SHAPES:
            speedup = r["ratios"]["dense_time_over_tt_time"]
            minima = r["ratios"]["dense_time_over_tt_time_of_minima"]
            speed.append({**{k: r[k] for k in PAIRED}, "speedup": speedup, "speedup_of_minima": minima})
            speed[-1].update(met=speedup >= TARGET_SPEEDUP, contended=r["contended"])
    einsum = []
    for r in results:
        ratio = r["ratios"]["best_einsum_time_over_planner_time"]
        einsum.append({**{k: r[k] for k in PAIRED}, "best_einsum": r["best_einsum"], "best_einsum_over_planner": ratio})
        einsum[-1].update(met=ratio >= 1.0, within_noise=ratio >= 1.0 - NOISE_TOL, contended=r["contended"])
        einsum[-1]["best_einsum_over_planner_of_minima"] = r["ratios"]["best_einsum_time_over_planner_time_of_minima"]
    return {
        "tt_at_least_5x_faster_than_dense": {
            "met": bool(speed) and all(s["met"] for s in speed),
            "any_case_contended": any(s["contended"] for s in speed),
            "cases": speed,
        },
        "planner_never_slower_than_best_einsum": {
            "met": all(e["met"] for e in einsum),
            "met_on_uncontended_cases": all(e["met"] for e in einsum if not e["contended"]),
            "contended_cases": sum(e["contended"] for e in einsum),
            "met_within_noise_tolerance": all(e["within_noise"] for e in einsum),
            "noise_tolerance": NOISE_TOL,
            "violations": [e for e in einsum if not e["met"]],
        },
    }


def render(results: list[dict], targets: dict, meta: dict) -> str:
    """The markdown report: TTLinear vs nn.Linear, planner vs einsum baselines and forced plans, verdicts."""
    out = [
        f"# TTLinear forward+backward (fp32, CPU, {meta['threads']} threads, >= {meta['repeats']} rounds; "
        f"`rounds`: clean/total (other load), `!` contended)",
        "",
        "## 1. TTLinear (planner's choice) vs nn.Linear",
        "",
    ]
    rows, plans = [], []
    for r in results:
        c, ratios = r["candidates"], r["ratios"]
        dense, tt = c["nn.Linear"], c["planner"]
        cells = [*(r[k] for k in PAIRED), r["planner_pick"], ms(dense["median_s"]), ms(tt["median_s"])]
        cells += [f"{ratios['dense_time_over_tt_time']:.2f}", *(mib(e["memory"]["total_bytes"]) for e in (dense, tt))]
        rows.append([*cells, f"{ratios['dense_mem_over_tt_mem']:.2f}", r["noise_cell"]])
        cells = [*(r[k] for k in PAIRED), *(ms(c[n]["median_s"]) for n in ("planner", *EINSUM_NAMES))]
        cells += [f"{ratios['best_einsum_time_over_planner_time']:.2f}"]
        cells += [ms(c[f"plan:{p}"]["median_s"]) + ("*" if p == r["planner_pick"] else "") for p in PLANS]
        plans.append([*cells, r["fastest_forced_plan"], f"{ratios['picked_forced_time_over_fastest_forced']:.2f}"])
    headers = (
        "shape|rows|rank|plan|nn.Linear ms|TTLinear ms|dense/tt time|nn.Linear MiB|TTLinear MiB|dense/tt mem|rounds"
    )
    out.append(table(headers, rows))
    out += ["", "## 2. Planner vs einsum baselines and every forced plan (ms; `*`: the planner's pick)", ""]
    plan_headers = [*PAIRED, "planner", *EINSUM_NAMES, "best einsum/planner", *PLANS, "fastest", "pick/fastest"]
    out.append(table(plan_headers, plans))
    out += ["", "## Targets", ""]
    t1, t2 = targets["tt_at_least_5x_faster_than_dense"], targets["planner_never_slower_than_best_einsum"]
    flag = lambda x: " (contended!)" if x["contended"] else ""  # noqa: E731
    met = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    detail = ", ".join(
        f"{s['shape']} r{s['rank']} {s['rows']} rows: {s['speedup']:.2f}x "
        f"[ratio of minima {s['speedup_of_minima']:.2f}x]{flag(s)}"
        for s in t1["cases"]
    )
    out.append(f"- TTLinear >= {TARGET_SPEEDUP:g}x faster than nn.Linear (fwd+bwd): {met(t1['met'])} ({detail})")
    line = f"- Planner never slower than the better einsum baseline: {met(t2['met'])}"
    if t2["violations"]:
        within = "all" if t2["met_within_noise_tolerance"] else "not all"
        line += f" ({len(t2['violations'])} case(s); within {NOISE_TOL:.0%} noise: {within})"
        for v in t2["violations"]:
            line += (
                f"\n  - {v['shape']} rows={v['rows']} rank={v['rank']}: {v['best_einsum']} is "
                f"{1 / v['best_einsum_over_planner']:.2f}x faster than the planner (medians; ratio of minima: "
                f"einsum/planner = {v['best_einsum_over_planner_of_minima']:.2f}){flag(v)}"
            )
        if t2["contended_cases"] == len(results):
            line += "\n  - every case was contended: nothing verified"
        elif t2["contended_cases"]:
            clean = len(results) - t2["contended_cases"]
            line += f"\n  - on the {clean} cases measured without contention: {met(t2['met_on_uncontended_cases'])}"
    out.append(line)
    worse = [r for r in results if r["ratios"]["picked_forced_time_over_fastest_forced"] > 1 + NOISE_TOL]
    out += ["", f"## Planner picks slower than the fastest forced plan by more than {NOISE_TOL:.0%}", ""]
    out += [] if worse else ["None."]
    for r in worse:
        c, pick, best = r["candidates"], r["planner_pick"], r["fastest_forced_plan"]
        out.append(
            f"- {r['shape']} rows={r['rows']} rank={r['rank']} ranks={r['ranks']}: picked {pick} "
            f"{ms(c['plan:' + pick]['median_s'])} ms, {best} {ms(c['plan:' + best]['median_s'])} ms "
            f"({r['ratios']['picked_forced_time_over_fastest_forced']:.2f}x); model order "
            f"{r['modelled_order']}, measured order {r['measured_plan_order']}{flag(r)}"
        )
    return "\n".join(out)


def plot(results: list[dict]):
    """Per case (x = rows, log): torch.einsum/planner, tensorly+oe/planner and nn.Linear/TTLinear time, one line
    per (shape, rank); above 1 the planner (or the TT layer) is faster."""
    fig, axes = harness.new_figure(3, width=5.0, height=4.0)
    panels = [
        ("torch.einsum / planner", "torch_einsum_time_over_planner_time"),
        ("tensorly+oe / planner", "tensorly_time_over_planner_time"),
        ("nn.Linear / TTLinear (planner)", "dense_time_over_tt_time"),
    ]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        groups.setdefault((r["shape"], r["rank"]), []).append(r)
    for ax, (title, key) in zip(axes, panels, strict=True):
        for (shape, rank), rs in sorted(groups.items()):
            rs = sorted(rs, key=lambda r: r["rows"])
            ax.plot([r["rows"] for r in rs], [r["ratios"][key] for r in rs], marker="o", label=f"{shape} r{rank}")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        harness.label_axes(ax, "rows (tokens)", xlog=True, ylog=True, title=f"time ratio {title}", legend=ax is axes[0])
    fig.suptitle("TT linear forward+backward: the planner vs einsum baselines, and vs dense (> 1: planner faster)")
    return fig


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print the report, write ``tt_linear.json`` and ``tt_linear.png``."""
    parser = harness.bench_parser(__doc__, repeats=(3, 5))
    quick, add = harness.Quick, parser.add_argument
    add("--min-sample-ms", type=float, default=quick(5.0, 10.0), help="inner loop per sample (10)")
    add("--min-case-s", type=float, default=quick(1.0, 1.5), help="clean seconds per case (1.5)")
    add("--shapes", nargs="+", choices=list(SHAPES), default=None, help="only these shapes")
    add("--rows", nargs="+", type=int, default=None, help="only these row counts")
    add("--ranks", nargs="+", type=int, default=None, help="only these ranks")
    add("--keep-freed-memory", action="store_true", help="glibc malloc keeps freed memory (training)")
    args = harness.parse(parser, argv)
    if args.keep_freed_memory:
        harness.keep_freed_memory_for_run()
    min_sample_s, min_case_s = args.min_sample_ms / 1e3, args.min_case_s
    wanted = {"shape": args.shapes, "rows": args.rows, "rank": args.ranks}
    cases = [c for c in build_cases(args.quick) if all(v is None or getattr(c, k) in v for k, v in wanted.items())]
    if not cases:
        parser.error("--shapes/--rows/--ranks leave no case to run")
    meta = {"machine": harness.machine_info(), "settings": harness.settings(args), "tensorly": tl.__version__}
    meta.update(threads=torch.get_num_threads(), repeats=args.repeats, min_sample_s=min_sample_s, min_case_s=min_case_s)
    meta["keep_freed_memory"] = args.keep_freed_memory
    log = functools.partial(print, file=sys.stderr, flush=True)
    log(f"# {len(cases)} cases, {args.repeats} rounds, {meta['threads']} threads")
    results = []
    started = time.perf_counter()
    with tl.backend_context("pytorch"):
        plugins.use_opt_einsum()
        try:
            for i, case in enumerate(cases):
                t0 = time.perf_counter()
                r = run_case(case, 0, min_sample_s=min_sample_s, min_total_s=min_case_s, **harness.timing_options(args))
                r["wall_s"] = time.perf_counter() - t0
                results.append(r)
                ratios = r["ratios"]
                log(
                    f"# [{i + 1}/{len(cases)}] {case.shape} rows={case.rows} rank={case.rank}: pick={r['planner_pick']}"
                    f" dense/tt={ratios['dense_time_over_tt_time']:.2f} einsum/planner="
                    f"{ratios['best_einsum_time_over_planner_time']:.2f} rounds={r['noise_cell']} ({r['wall_s']:.1f}s)"
                )
        finally:
            plugins.use_default_einsum()
    meta["wall_s"] = time.perf_counter() - started
    targets = evaluate_targets(results)
    print(render(results, targets, meta))
    harness.emit(args.out_dir / JSON_NAME, {"meta": meta, "targets": targets, "cases": results}, fig=plot(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
