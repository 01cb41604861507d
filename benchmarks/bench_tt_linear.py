"""TTLinear against nn.Linear, against one-shot einsum baselines, and every forced contraction plan.

Run from the repository root::

    python benchmarks/bench_tt_linear.py            # full run (about 3-5 minutes on 2 quiet CPU cores)
    python benchmarks/bench_tt_linear.py --quick    # under a minute on a quiet machine
    python benchmarks/bench_tt_linear.py --repeats 9 --threads 2 --out-dir /tmp/tt   # tt_linear.json + .png
    python benchmarks/bench_tt_linear.py --wait-quiet 120   # on a shared machine: wait out other jobs
    python benchmarks/bench_tt_linear.py --keep-freed-memory --shapes 768x3072 --rows 4096 --ranks 30

``--keep-freed-memory`` runs every candidate with glibc's malloc keeping freed memory, as the
``KeepFreedMemory`` callback does in training: without it every output above 32 MiB (768x3072 at 4096 rows
is 48 MiB) is a fresh mapping that the kernel faults in and zeroes on every step.

What one "step" is, for every candidate: forward on ``x (rows, in_features)`` (``x.requires_grad``),
then ``torch.autograd.grad(y, [x, *parameters], g)`` with ``g`` a fixed random ``(rows, out)`` tensor,
i.e. the backward of ``loss = sum(y * g)``: gradients of the input and of every parameter (nn.Linear:
weight and bias; TT candidates: cores, rank gates and bias). TT candidates all start from
``layer.gated_cores()`` and add the bias, so they compute the same function as ``TTLinear.forward``.

Candidates (per shape, rows, rank):

* ``nn.Linear``: the dense layer being replaced.
* ``planner``: ``TTLinear`` with the contraction plan chosen by ``comera_lightning.tt.plan_tt_linear``.
* ``plan:<name>``: the same layer with each plan of ``comera_lightning.tt.PLANS`` forced.
* ``torch.einsum``: one ``torch.einsum`` over x (reshaped to its modes) and ALL cores; torch asks
  opt_einsum for a contraction path on every call (nothing cached).
* ``tensorly+oe``: ``tl.einsum`` of the same expression with ``tensorly.plugins.use_opt_einsum()``
  (path computed once per equation+shapes and cached as an opt_einsum ContractExpression). The
  pytorch tensorly backend and the plugin are switched on once for the whole run and restored at exit.

The machine is assumed noisy: within one case all candidates are timed in the same process by
``harness.interleave``, round by round (a fresh seeded random order every round, so no candidate always follows
the same one), each sample being the mean of an inner loop long enough to dwarf timer resolution (with
one untimed step first when steps are short, so no sample starts cache-cold); at least ``--repeats`` rounds, more for cheap cases
(until ``--min-case-s`` of clean rounds); reported times are medians over the rounds and ratios are
ratios of those medians. Every candidate is warmed up (plans and einsum paths cached) first.
Contention is measured, not guessed: /proc/stat gives the CPU time other processes (and hypervisor
steal) took during each round; a round above ``--max-other-load`` of the machine is kept in the JSON,
left out of the medians and retried (``--wait-quiet`` sleeps until the machine is quiet first). With
oversubscribed cores torch's OpenMP threads can slow small cases down by 10-100x, so a case whose
medians still include contended rounds is flagged ``!`` in the table.

Memory is NOT an allocator peak (CPU torch keeps no allocator statistics). It is, per candidate,
``param_bytes + grad_bytes + saved_bytes`` where ``saved_bytes`` is the sum of the unique storages
that autograd keeps for backward (captured by ``torch.autograd.graph.saved_tensors_hooks``), excluding
the storages of the input ``x`` and of the parameters themselves (those exist anyway and are the same
for every candidate or already counted). The input's saved bytes are reported separately in the JSON.
Transient workspaces freed during forward or backward and the output itself are not counted.

Output: markdown tables and target verdicts on stdout; ``tt_linear.json`` (machine, settings, every
sample and round, memory breakdown, modelled plan costs) and ``tt_linear.png`` (per case, against rows:
torch.einsum/planner, tensorly+oe/planner and nn.Linear/TTLinear time ratios, one line per shape and
rank) in ``--out-dir`` (``--out PATH`` still names the JSON file; the PNG then goes next to it).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import string
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import tensorly as tl
from tensorly import plugins

import harness
from harness import interleave, mib, ms, table

from comera_lightning import TTLinear
from comera_lightning.tt import PLANS, plan_costs, plan_tt_linear

# ------------------------------------------------------------------------------------------------------
# what to run

SHAPES = {
    "768x768": (768, 768, (12, 8, 8), (8, 8, 12)),
    "768x3072": (768, 3072, (12, 8, 8), (12, 16, 16)),
    "3072x768": (3072, 768, (12, 16, 16), (12, 8, 8)),
}
MAIN_RANK, MAIN_ROWS = 30, 4096
TARGET_SHAPES = ("768x768", "768x3072")  # the issue's >= 5x targets
TARGET_SPEEDUP = 5.0
MAX_ROUNDS = 40
NOISE_TOL = 0.05  # "within noise" annotation for comparisons of medians (the verdicts stay strict)

FULL_GRID = dict(shapes=tuple(SHAPES), rows=(1, 32, 512, 4096), ranks=(8, 30, 64))
QUICK_GRID = dict(shapes=("768x768",), rows=(1, 32, 512), ranks=(8, 64))
QUICK_MAIN_SHAPES = TARGET_SHAPES

EINSUM_NAMES = ("torch.einsum", "tensorly+oe")
JSON_NAME, PNG_NAME = "tt_linear.json", "tt_linear.png"


@dataclass(frozen=True)
class Case:
    shape: str
    rows: int
    rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == MAIN_RANK and self.rows == MAIN_ROWS


def build_cases(quick: bool) -> list[Case]:
    """Main shapes (rank 30, 4096 rows) first, then the grid, without duplicates."""
    cases = [Case(s, MAIN_ROWS, MAIN_RANK) for s in (QUICK_MAIN_SHAPES if quick else SHAPES)]
    grid = QUICK_GRID if quick else FULL_GRID
    for shape in grid["shapes"]:
        for rank in grid["ranks"]:
            for rows in grid["rows"]:
                case = Case(shape, rows, rank)
                if case not in cases:
                    cases.append(case)
    return cases


# ------------------------------------------------------------------------------------------------------
# candidates


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


@dataclass
class Candidate:
    name: str
    forward: Callable[[], torch.Tensor]
    inputs: list[torch.Tensor]  # x and the parameters: what gradients are taken of
    params: list[torch.Tensor]
    samples: list[float] = field(default_factory=list)
    inner: int = 1
    mem: dict = field(default_factory=dict)
    max_rel_err: float | None = None


def make_candidates(case: Case, seed: int) -> tuple[list[Candidate], TTLinear, torch.Tensor]:
    """nn.Linear, the planner, every forced plan and the two einsum baselines on one seeded layer and input."""
    in_f, out_f, in_modes, out_modes = SHAPES[case.shape]
    torch.manual_seed(seed)
    x = torch.randn(case.rows, in_f, requires_grad=True)
    dense = nn.Linear(in_f, out_f)
    layer = TTLinear(in_f, out_f, case.rank, in_modes=list(in_modes), out_modes=list(out_modes))
    assert math.prod(layer.in_modes) == in_f and math.prod(layer.out_modes) == out_f
    dense_params = list(dense.parameters())
    tt_params = list(layer.parameters())
    rows, x_shape = case.rows, (case.rows, *layer.in_modes)
    equation = tt_equation(len(layer.in_modes), len(layer.out_modes))

    def tt_forward(plan: str | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            layer.contraction_plan = plan  # same as set_contraction_plan, without re-validating per call
            return layer(x)

        return run

    def torch_einsum() -> torch.Tensor:
        y = torch.einsum(equation, x.reshape(x_shape), *layer.gated_cores())
        return y.reshape(rows, out_f) + layer.bias

    def tensorly_einsum() -> torch.Tensor:
        y = tl.einsum(equation, x.reshape(x_shape), *layer.gated_cores())
        return y.reshape(rows, out_f) + layer.bias

    for plan in PLANS:  # validate names once through the public API
        layer.set_contraction_plan(plan)
    layer.set_contraction_plan(None)

    cands = [Candidate("nn.Linear", lambda: dense(x), [x, *dense_params], dense_params)]
    cands.append(Candidate("planner", tt_forward(None), [x, *tt_params], tt_params))
    cands += [Candidate(f"plan:{p}", tt_forward(p), [x, *tt_params], tt_params) for p in PLANS]
    cands.append(Candidate("torch.einsum", torch_einsum, [x, *tt_params], tt_params))
    cands.append(Candidate("tensorly+oe", tensorly_einsum, [x, *tt_params], tt_params))
    return cands, layer, x


def step(cand: Candidate, grad_out: torch.Tensor) -> None:
    """One timed step: forward, then the gradients of x and every parameter for ``loss = sum(y * grad_out)``."""
    y = cand.forward()
    torch.autograd.grad(y, cand.inputs, grad_out)


# ------------------------------------------------------------------------------------------------------
# measurement


def measure_memory(cand: Candidate, x: torch.Tensor, grad_out: torch.Tensor) -> dict:
    """Unique storages saved for backward (split into input / other), params and grads, in bytes."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = cand.forward()
    x_ptr = x.untyped_storage().data_ptr()
    param_ptrs = {p.untyped_storage().data_ptr() for p in cand.params}
    saved_input = sum(n for ptr, n in seen.items() if ptr == x_ptr)
    saved_params = sum(n for ptr, n in seen.items() if ptr in param_ptrs)
    saved_other = sum(n for ptr, n in seen.items() if ptr != x_ptr and ptr not in param_ptrs)
    torch.autograd.grad(y, cand.inputs, grad_out)
    param_bytes = sum(p.numel() * p.element_size() for p in cand.params)
    return {
        "saved_other_bytes": saved_other,
        "saved_input_bytes": saved_input,
        "saved_param_bytes": saved_params,
        "param_bytes": param_bytes,
        "grad_bytes": param_bytes,
        "total_bytes": param_bytes * 2 + saved_other,
    }


def run_case(
    case: Case,
    repeats: int,
    warmup: int,
    min_sample_s: float,
    min_case_s: float,
    seed: int,
    max_other_load: float,
    wait_quiet_s: float,
) -> dict:
    """One case: correctness check, memory per candidate, then every candidate timed by ``harness.interleave``."""
    cands, layer, x = make_candidates(case, seed)
    in_f, out_f, _, _ = SHAPES[case.shape]
    grad_out = torch.randn(case.rows, out_f, generator=torch.Generator().manual_seed(seed + 1))

    # correctness (untimed): every TT candidate must give the planner's output
    with torch.no_grad():
        reference = cands[1].forward()
        scale = reference.abs().max().item() or 1.0
        for cand in cands[1:]:
            cand.max_rel_err = (cand.forward() - reference).abs().max().item() / scale
    for cand in cands:
        step(cand, grad_out)  # plans and einsum paths cached before memory is measured
        cand.mem = measure_memory(cand, x, grad_out)

    # At least `repeats` clean rounds, and more while the clean rounds add up to less than `min_case_s`
    # (small cases are cheap and their 1 ms steps noisy, so they get many rounds). Rounds during which
    # other processes used more than `max_other_load` of the machine are kept in the JSON but left out
    # of the medians and retried (at most `repeats` of them per case), up to MAX_ROUNDS rounds in all.
    timing = interleave(
        {cand.name: (lambda cand=cand: step(cand, grad_out)) for cand in cands},
        repeats=repeats, warmup=warmup, min_sample_s=min_sample_s, min_total_s=min_case_s,
        max_rounds=MAX_ROUNDS, max_other_load=max_other_load, wait_quiet_s=wait_quiet_s, seed=seed,
    )
    for cand in cands:
        cand.samples, cand.inner = timing.samples[cand.name], timing.inner[cand.name]
    summary = timing.summary()
    rounds = timing.rounds

    ranks = list(layer.ranks)
    pick = plan_tt_linear(layer.in_modes, layer.out_modes, ranks, case.rows, "cpu", x.element_size())
    modelled = {c.plan: c.seconds for c in plan_costs(layer.in_modes, layer.out_modes, ranks, case.rows, "cpu", 4)}
    med = {c.name: statistics.median(c.samples) for c in cands}
    best = {c.name: min(c.samples) for c in cands}
    forced = {p: med[f"plan:{p}"] for p in PLANS}
    fastest_plan = min(forced, key=forced.get)
    best_einsum = min(EINSUM_NAMES, key=lambda n: med[n])
    # paired per-round ratio dense/planner: a noise indicator for the headline ratio
    paired = [d / t for d, t in zip(cands[0].samples, cands[1].samples)]
    mem = {c.name: c.mem for c in cands}
    return {
        "shape": case.shape,
        "in_features": in_f,
        "out_features": out_f,
        "in_modes": list(layer.in_modes),
        "out_modes": list(layer.out_modes),
        "rows": case.rows,
        "rank": case.rank,
        "ranks": ranks,
        "main": case.is_main,
        "rounds_total": summary["rounds_total"],
        "rounds_clean": summary["rounds_clean"],
        "rounds_used": len(cands[0].samples),
        "contended": timing.contended,
        "other_load_median": summary["other_load_median"],
        "noise_cell": timing.noise_cell(),
        "rounds": rounds,
        "planner_pick": pick,
        "modelled_seconds": modelled,
        "modelled_order": sorted(modelled, key=modelled.get),
        "candidates": {
            c.name: {
                "median_s": med[c.name],
                "min_s": best[c.name],
                "samples_s": c.samples,
                "inner_iterations": c.inner,
                "memory": c.mem,
                "max_rel_err_vs_planner": c.max_rel_err,
            }
            for c in cands
        },
        "measured_plan_order": sorted(forced, key=forced.get),
        "fastest_forced_plan": fastest_plan,
        "best_einsum": best_einsum,
        "ratios": {
            "dense_time_over_tt_time": med["nn.Linear"] / med["planner"],
            "dense_time_over_tt_time_paired_min": min(paired),
            "dense_time_over_tt_time_paired_max": max(paired),
            "dense_time_over_tt_time_of_minima": best["nn.Linear"] / best["planner"],
            "dense_mem_over_tt_mem": mem["nn.Linear"]["total_bytes"] / mem["planner"]["total_bytes"],
            "best_einsum_time_over_planner_time": med[best_einsum] / med["planner"],
            "best_einsum_time_over_planner_time_of_minima": min(best[n] for n in EINSUM_NAMES) / best["planner"],
            "torch_einsum_time_over_planner_time": med["torch.einsum"] / med["planner"],
            "tensorly_time_over_planner_time": med["tensorly+oe"] / med["planner"],
            "planner_time_over_fastest_forced_plan": med["planner"] / forced[fastest_plan],
            "picked_forced_time_over_fastest_forced": forced[pick] / forced[fastest_plan],
        },
    }


# ------------------------------------------------------------------------------------------------------
# reporting


def noise_cell(r: dict) -> str:
    """Clean/total rounds, median load of other processes, ``!`` if the medians include contended rounds."""
    return r["noise_cell"]


SHORT = {"half_merge": "hm", "sweep": "sw", "merge_in_sweep_out": "mi_so", "sweep_in_merge_out": "si_mo", "dense": "dn"}


def evaluate_targets(results: list[dict]) -> dict:
    """Verdicts: TTLinear >= 5x faster than nn.Linear on the main cases; planner never slower than einsum."""
    speed = []
    for r in results:
        if r["main"] and r["shape"] in TARGET_SHAPES:
            ratio = r["ratios"]["dense_time_over_tt_time"]
            speed.append({"shape": r["shape"], "rows": r["rows"], "rank": r["rank"], "speedup": ratio,
                          "speedup_of_minima": r["ratios"]["dense_time_over_tt_time_of_minima"],
                          "met": ratio >= TARGET_SPEEDUP, "contended": r["contended"]})
    einsum = []
    for r in results:
        ratio = r["ratios"]["best_einsum_time_over_planner_time"]
        einsum.append({"shape": r["shape"], "rows": r["rows"], "rank": r["rank"], "best_einsum": r["best_einsum"],
                       "best_einsum_over_planner": ratio, "met": ratio >= 1.0,
                       "best_einsum_over_planner_of_minima": r["ratios"]["best_einsum_time_over_planner_time_of_minima"],
                       "within_noise": ratio >= 1.0 - NOISE_TOL, "contended": r["contended"]})
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
        f"# TTLinear benchmark (forward+backward, fp32, CPU, {meta['threads']} threads, "
        f"medians over >= {meta['repeats']} interleaved rounds per case)",
        "",
        "Time = one forward + backward (grads of x and all parameters) in ms. "
        "Memory = params + grads + unique storages saved for backward other than x and the parameters "
        "(saved_tensors_hooks; not an allocator peak, transients and the output not counted), MiB.",
        "",
        f"Contention: a round (every candidate once) during which other processes used more than "
        f"{meta['max_other_load']:.0%} of all CPUs (/proc/stat) is left out of the medians and retried "
        f"(at most `repeats` retries per case). `rounds` = clean/total rounds and the "
        f"median CPU share of other processes; `!` marks a case whose medians include contended rounds "
        f"(too few clean ones: distrust it). "
        f"Load average (1 min) before {meta['loadavg_before'][0]:.2f}, after {meta['loadavg_after'][0]:.2f}.",
        "",
        "## 1. TTLinear (planner's choice) vs nn.Linear",
        "",
    ]
    rows = []
    for r in results:
        c = r["candidates"]
        rows.append([
            r["shape"], str(r["rows"]), str(r["rank"]), r["planner_pick"],
            ms(c["nn.Linear"]["median_s"]), ms(c["planner"]["median_s"]),
            f"{r['ratios']['dense_time_over_tt_time']:.2f}",
            mib(c["nn.Linear"]["memory"]["total_bytes"]), mib(c["planner"]["memory"]["total_bytes"]),
            f"{r['ratios']['dense_mem_over_tt_mem']:.2f}", noise_cell(r),
        ])
    out.append(table(["shape", "rows", "rank", "plan", "nn.Linear ms", "TTLinear ms", "dense/tt time",
                      "nn.Linear MiB", "TTLinear MiB", "dense/tt mem", "rounds"], rows))
    out += ["", "## 2. Planner vs einsum baselines and every forced plan (ms)", "",
            "Plan columns: " + ", ".join(f"{v}={k}" for k, v in SHORT.items())
            + ". `*` marks the planner's pick. einsum/planner > 1 means the planner is faster.", ""]
    rows = []
    for r in results:
        c = r["candidates"]
        plan_cells = []
        for p in PLANS:
            cell = ms(c[f"plan:{p}"]["median_s"])
            plan_cells.append(cell + ("*" if p == r["planner_pick"] else ""))
        rows.append([
            r["shape"], str(r["rows"]), str(r["rank"]), ms(c["planner"]["median_s"]),
            ms(c["torch.einsum"]["median_s"]), ms(c["tensorly+oe"]["median_s"]),
            f"{r['ratios']['best_einsum_time_over_planner_time']:.2f}",
            *plan_cells, SHORT[r["fastest_forced_plan"]],
            f"{r['ratios']['picked_forced_time_over_fastest_forced']:.2f}",
        ])
    out.append(table(["shape", "rows", "rank", "planner", "torch.einsum", "tensorly+oe", "best einsum/planner",
                      *[SHORT[p] for p in PLANS], "fastest", "pick/fastest"], rows))

    out += ["", "## Targets", ""]
    contended = [r for r in results if r["contended"]]
    if contended:
        out.append(f"WARNING: {len(contended)} case(s) measured under contention (`!`): "
                   + ", ".join(f"{r['shape']}/{r['rows']}/r{r['rank']}" for r in contended) + ". Rerun on a "
                   "quiet machine before trusting them.")
        out.append("")
    t1 = targets["tt_at_least_5x_faster_than_dense"]
    detail = ", ".join(f"{s['shape']} r{s['rank']} {s['rows']} rows: {s['speedup']:.2f}x "
                       f"[ratio of minima {s['speedup_of_minima']:.2f}x]{' (contended!)' if s['contended'] else ''}"
                       for s in t1["cases"])
    out.append(f"- TTLinear >= {TARGET_SPEEDUP:g}x faster than nn.Linear (fwd+bwd): "
               f"{'MET' if t1['met'] else 'NOT MET'} ({detail})")
    t2 = targets["planner_never_slower_than_best_einsum"]
    line = f"- Planner never slower than the better einsum baseline: {'MET' if t2['met'] else 'NOT MET'}"
    if t2["violations"]:
        line += (f" ({len(t2['violations'])} case(s); within {NOISE_TOL:.0%} noise: "
                 f"{'all' if t2['met_within_noise_tolerance'] else 'not all'})")
        for v in t2["violations"]:
            line += (f"\n  - {v['shape']} rows={v['rows']} rank={v['rank']}: {v['best_einsum']} is "
                     f"{1 / v['best_einsum_over_planner']:.2f}x faster than the planner (medians; ratio of "
                     f"minima: einsum/planner = {v['best_einsum_over_planner_of_minima']:.2f})"
                     + (" (contended!)" if v["contended"] else ""))
        if t2["contended_cases"] == len(results):
            line += "\n  - every case was contended: nothing verified"
        elif t2["contended_cases"]:
            line += (f"\n  - on the {len(results) - t2['contended_cases']} cases measured without contention: "
                     f"{'MET' if t2['met_on_uncontended_cases'] else 'NOT MET'}")
    out.append(line)
    worse = [r for r in results if r["ratios"]["picked_forced_time_over_fastest_forced"] > 1 + NOISE_TOL]
    out += ["", f"## Planner picks slower than the fastest forced plan by more than {NOISE_TOL:.0%}", ""]
    if not worse:
        out.append("None.")
    for r in worse:
        c = r["candidates"]
        pick, best = r["planner_pick"], r["fastest_forced_plan"]
        out.append(f"- {r['shape']} rows={r['rows']} rank={r['rank']} ranks={r['ranks']}: picked {pick} "
                   f"{ms(c['plan:' + pick]['median_s'])} ms, {best} {ms(c['plan:' + best]['median_s'])} ms "
                   f"({r['ratios']['picked_forced_time_over_fastest_forced']:.2f}x); "
                   f"model order {r['modelled_order']}, measured order {r['measured_plan_order']}"
                   + (" (contended!)" if r["contended"] else ""))
    return "\n".join(out)


def plot(results: list[dict], path: Path) -> Path:
    """Per case (x = rows, log): torch.einsum/planner, tensorly+oe/planner and nn.Linear/TTLinear time.

    One line per (shape, rank); above 1 the planner (or the TT layer) is faster.
    """
    fig, axes = harness.new_figure(3, width=5.0, height=4.0)
    panels = [("torch.einsum / planner", "torch_einsum_time_over_planner_time"),
              ("tensorly+oe / planner", "tensorly_time_over_planner_time"),
              ("nn.Linear / TTLinear (planner)", "dense_time_over_tt_time")]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        groups.setdefault((r["shape"], r["rank"]), []).append(r)
    for ax, (title, key) in zip(axes, panels):
        for (shape, rank), rs in sorted(groups.items()):
            rs = sorted(rs, key=lambda r: r["rows"])
            ax.plot([r["rows"] for r in rs], [r["ratios"][key] for r in rs], marker="o",
                    label=f"{shape} r{rank}")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rows (tokens)")
        ax.set_title(f"time ratio {title}")
        ax.grid(which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("TT linear forward+backward: contraction planner vs einsum baselines, and vs dense (> 1: planner faster)")
    return harness.save_figure(fig, path)


# ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and rounds (under a minute)")
    parser.add_argument("--repeats", type=int, default=None, help="minimum timed rounds per case (default 5, quick 3)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps per candidate before timing (plus one more that sizes the inner loop)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--min-sample-ms", type=float, default=None,
                        help="inner loop length per sample (default 10, quick 5)")
    parser.add_argument("--min-case-s", type=float, default=None,
                        help="keep adding rounds until the clean ones took this long (default 1.5, quick 1); "
                             f"at most max(2 x repeats, {MAX_ROUNDS}) rounds in all")
    parser.add_argument("--max-other-load", type=float, default=0.15,
                        help="leave a round out of the medians and retry it (at most --repeats times per "
                             "case) if other processes used more than this fraction of all CPUs during it "
                             "(from /proc/stat; default 0.15, 1 disables)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="per case, wait up to this long (sleeping) for other processes to go quiet before "
                             "the first round and before each retry of a contended round (default 0: no wait)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None,
                        help="only these shapes (filters the chosen case list)")
    parser.add_argument("--rows", nargs="+", type=int, default=None, help="only these row counts (filter)")
    parser.add_argument("--ranks", nargs="+", type=int, default=None, help="only these ranks (filter)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="glibc's malloc keeps freed memory, as the KeepFreedMemory callback does in training: "
                             "outputs above 32 MiB stop being page-faulted in on every step")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help=f"folder of {JSON_NAME} and {PNG_NAME} (default benchmarks/results)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON results path (default <out-dir>/{JSON_NAME}); without --out-dir the PNG "
                             "goes next to it")
    args = parser.parse_args(argv)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.keep_freed_memory:
        harness.keep_freed_memory_for_run()
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    min_sample_s = (args.min_sample_ms if args.min_sample_ms is not None else (5.0 if args.quick else 10.0)) / 1e3
    min_case_s = args.min_case_s if args.min_case_s is not None else (1.0 if args.quick else 1.5)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    cases = [
        c for c in build_cases(args.quick)
        if (args.shapes is None or c.shape in args.shapes)
        and (args.rows is None or c.rows in args.rows)
        and (args.ranks is None or c.rank in args.ranks)
    ]
    if not cases:
        parser.error("--shapes/--rows/--ranks leave no case to run")
    json_path = args.out or (args.out_dir or harness.RESULTS_DIR) / JSON_NAME
    png_path = (args.out_dir / PNG_NAME) if args.out_dir is not None else json_path.with_suffix(".png")
    meta = {
        "machine": harness.machine_info(),
        "torch": torch.__version__,
        "tensorly": tl.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "keep_freed_memory": args.keep_freed_memory,
        "torch_opt_einsum_available": torch.backends.opt_einsum.is_available(),
        "torch_opt_einsum_strategy": torch.backends.opt_einsum.strategy,
        "repeats": repeats,
        "warmup": args.warmup,
        "min_sample_s": min_sample_s,
        "min_case_s": min_case_s,
        "quick": args.quick,
        "seed": args.seed,
        "max_other_load": args.max_other_load,
        "wait_quiet_s": args.wait_quiet,
        "dtype": "float32",
        "what_is_measured": {
            "time": "median over interleaved rounds of one forward + torch.autograd.grad(y, [x, *params], g)",
            "memory": "param_bytes + grad_bytes + unique storages saved for backward excluding x and the "
                      "parameters (torch.autograd.graph.saved_tensors_hooks); not an allocator peak",
        },
    }
    meta["loadavg_before"] = os.getloadavg()
    print(f"# {len(cases)} cases, {repeats} rounds, {meta['threads']} threads", file=sys.stderr)
    results = []
    started = time.perf_counter()
    with tl.backend_context("pytorch"):
        plugins.use_opt_einsum()
        try:
            for i, case in enumerate(cases):
                t0 = time.perf_counter()
                r = run_case(case, repeats, args.warmup, min_sample_s, min_case_s, args.seed,
                             args.max_other_load, args.wait_quiet)
                r["wall_s"] = time.perf_counter() - t0
                r["loadavg_after"] = os.getloadavg()[0]
                results.append(r)
                print(f"# [{i + 1}/{len(cases)}] {case.shape} rows={case.rows} rank={case.rank}: "
                      f"pick={r['planner_pick']} dense/tt={r['ratios']['dense_time_over_tt_time']:.2f} "
                      f"einsum/planner={r['ratios']['best_einsum_time_over_planner_time']:.2f} "
                      f"rounds={noise_cell(r)} "
                      f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)
        finally:
            plugins.use_default_einsum()
    meta["wall_s"] = time.perf_counter() - started
    meta["loadavg_after"] = os.getloadavg()
    targets = evaluate_targets(results)
    print(render(results, targets, meta))
    harness.write_json(json_path, {"meta": meta, "targets": targets, "cases": results})
    plot(results, png_path)
    print(f"\nJSON: {json_path}\nPNG: {png_path}  (wall {meta['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
