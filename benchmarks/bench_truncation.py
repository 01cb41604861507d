"""Payoff of physical truncation: a training step of a CoMERA feed-forward block before and after the ranks are cut.

The paper's FFN (768 -> 3072 -> 768 ``TTLinear``s, rank 30) and a copy cut to the leading ``--keep`` share of every
bond (masked, physically truncated, AdamW state sliced, as ``bench_training_step.cut`` and RankAdaptation do);
full training steps (forward, backward, AdamW) of both timed interleaved (``harness.interleave``). Writes
``truncation.json``.

    python benchmarks/bench_truncation.py [--rows 4096] [--repeats 15] [--keep 0.5]
"""

from __future__ import annotations

import copy

import harness
import torch
from bench_training_step import Candidate, cut, train_step
from torch import nn

from comera_lightning.nn import size_report, tt_layers
from comera_lightning.nn.linear import TTLinear
from comera_lightning.optim import comera_parameter_groups


def main(argv: list[str] | None = None) -> int:
    """Cut, time both steps, print the table, write ``truncation.json``."""
    parser = harness.bench_parser(__doc__, repeats=(2, 15))
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=30)
    parser.add_argument("--keep", type=float, default=0.5, help="share of each bond's slices kept")
    args = harness.parse(parser, argv)
    torch.manual_seed(0)
    ffn = nn.Sequential(
        TTLinear(768, 3072, args.rank, in_modes=[12, 8, 8], out_modes=[12, 16, 16]),
        nn.GELU(),
        TTLinear(3072, 768, args.rank, in_modes=[12, 16, 16], out_modes=[12, 8, 8]),
    )
    x = torch.randn(64 if args.quick else args.rows, 768)
    cands = {}
    for name in ("before", "after"):  # both with optimiser state before the cut, as in a real run
        model = copy.deepcopy(ffn)
        optimizer = torch.optim.AdamW(comera_parameter_groups(model))
        step = train_step(optimizer, lambda model=model: model(x).square().mean())
        cands[name] = Candidate(name, model, optimizer, step).prime()
    cut(cands["after"].model, cands["after"].optimizer, args.keep)
    timing = harness.interleave(
        {n: c.step for n, c in cands.items()}, min_sample_s=0.05, **harness.timing_options(args)
    )
    params = {n: size_report(c.model).allocated_parameters for n, c in cands.items()}
    ranks = {n: [layer.ranks for _, layer in tt_layers(c.model)] for n, c in cands.items()}
    result = {
        "rows": x.shape[0],
        "rank": args.rank,
        "keep": args.keep,
        "threads": torch.get_num_threads(),
        "ranks_before": ranks["before"],
        "ranks_after": ranks["after"],
        "parameters_before": params["before"],
        "parameters_after": params["after"],
        "parameter_ratio": params["after"] / params["before"],
        "step_seconds_before": timing.median("before"),
        "step_seconds_after": timing.median("after"),
        "step_time_ratio": timing.ratio("after", "before"),
        "timing": timing.summary(),
        "machine": harness.machine_info(),
    }
    print(
        harness.table(
            ["model", "ranks", "parameters", "step (ms, median)"],
            [
                [f"{name} truncation", ranks[name][0], f"{params[name]:,}", harness.ms(timing.median(name))]
                for name in cands
            ],
        )
    )
    print(
        f"\nparameters after/before: {result['parameter_ratio']:.3f}; "
        f"step time after/before: {result['step_time_ratio']:.3f} (target <= 0.5)"
    )
    harness.emit(args.out_dir / "truncation.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
