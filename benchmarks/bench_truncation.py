"""Payoff of physical truncation: a training step before and after the ranks are cut.

Builds a CoMERA feed-forward block at the paper's shapes (768 -> 3072 -> 768, rank 30), copies it, kills
gate entries in the copy until about a quarter of its TT parameters remain, masks and physically
truncates it (slicing its AdamW state the way RankAdaptation does), then times full training steps
(forward, backward, AdamW) of both models interleaved in one process and prints the ratio.

    python benchmarks/bench_truncation.py [--rows 4096] [--repeats 15] [--keep 0.5]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from comera_lightning.nn import size_report, tt_layers
from comera_lightning.nn.linear import TTLinear
from comera_lightning.optim import comera_parameter_groups, slice_optimizer_state


def build(rank: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(TTLinear(768, 3072, rank, in_modes=[12, 8, 8], out_modes=[12, 16, 16]), nn.GELU(),
                         TTLinear(3072, 768, rank, in_modes=[12, 16, 16], out_modes=[12, 8, 8]))


def cut(model: nn.Module, optimizer: torch.optim.Optimizer, keep: float) -> None:
    """Zero the gates of all but the first ``keep`` fraction of every bond, then mask and truncate."""
    for _, layer in tt_layers(model):
        slice_optimizer_state([optimizer], layer.truncate_to_share_(keep))


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=30)
    parser.add_argument("--keep", type=float, default=0.5, help="fraction of each bond's slices kept")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/truncation.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    before = build(args.rank)
    after = copy.deepcopy(before)
    opt_before = torch.optim.AdamW(comera_parameter_groups(before))
    opt_after = torch.optim.AdamW(comera_parameter_groups(after))
    x = torch.randn(args.rows, 768)
    step(before, opt_before, x)
    step(after, opt_after, x)  # optimiser state exists before the cut, as in a real run
    cut(after, opt_after, args.keep)
    params_before = size_report(before).allocated_parameters
    params_after = size_report(after).allocated_parameters

    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(2):
        step(before, opt_before, x)
        step(after, opt_after, x)
    for _ in range(args.repeats):
        for name, model, opt in (("before", before, opt_before), ("after", after, opt_after)):
            start = time.perf_counter()
            step(model, opt, x)
            times[name].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "rows": args.rows, "rank": args.rank, "keep": args.keep, "threads": torch.get_num_threads(),
        "ranks_before": [layer.ranks for _, layer in tt_layers(before)],
        "ranks_after": [layer.ranks for _, layer in tt_layers(after)],
        "parameters_before": params_before, "parameters_after": params_after,
        "parameter_ratio": params_after / params_before,
        "step_seconds_before": median["before"], "step_seconds_after": median["after"],
        "step_time_ratio": median["after"] / median["before"],
    }
    print("| model | ranks | parameters | step (ms, median) |")
    print("|---|---|---|---|")
    print(f"| before truncation | {result['ranks_before'][0]} | {params_before:,} | {median['before'] * 1e3:.1f} |")
    print(f"| after truncation | {result['ranks_after'][0]} | {params_after:,} | {median['after'] * 1e3:.1f} |")
    print(f"\nparameters after/before: {result['parameter_ratio']:.3f}; "
          f"step time after/before: {result['step_time_ratio']:.3f} (target <= 0.5)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
