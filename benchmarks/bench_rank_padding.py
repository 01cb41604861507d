"""The padded bottleneck of ``half_merge``: TTLinear forward + backward with and without it, against nn.Linear.

``comera_lightning.tt.contract.bottleneck_padding`` adds zero slices to the bottleneck rank of the
``half_merge`` plan on a CPU (26-31 -> 32, 42-47 -> 48, 58-63 -> 64): the same product, but the six skinny
GEMMs of a step run at a width the BLAS handles better. This times, interleaved in one process
(``harness.interleave``), one forward + backward of ``TTLinear`` at the paper's shapes and modes (768x768,
768x3072, 3072x768) with the padding (the default), with it switched off, and ``nn.Linear``.

    python benchmarks/bench_rank_padding.py                 # rank 30, 4096 rows, run alone
    python benchmarks/bench_rank_padding.py --rank 28 --rows 1024 --threads 1
    python benchmarks/bench_rank_padding.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import comera_lightning.tt.contract as contract  # noqa: E402
from comera_lightning.models import paper_linear_modes  # noqa: E402
from comera_lightning.nn import TTLinear  # noqa: E402

SHAPES = ((768, 768), (768, 3072), (3072, 768))


@contextmanager
def padding_off():
    """``bottleneck_padding`` returns 0 inside the block."""
    original = contract.bottleneck_padding
    contract.bottleneck_padding = lambda rank, device_type: 0
    try:
        yield
    finally:
        contract.bottleneck_padding = original


def candidates(in_features: int, out_features: int, rank: int, rows: int) -> dict:
    torch.manual_seed(0)
    in_modes, out_modes = paper_linear_modes(in_features, out_features)
    tt = TTLinear(in_features, out_features, rank, in_modes=in_modes, out_modes=out_modes)
    tt.set_contraction_plan("half_merge")
    dense = nn.Linear(in_features, out_features)
    x = torch.randn(rows, in_features, requires_grad=True)
    upstream = torch.randn(rows, out_features)

    def step(layer: nn.Module) -> None:
        x.grad = None
        layer(x).backward(upstream)

    def unpadded() -> None:
        with padding_off():
            step(tt)

    return {"padded": lambda: step(tt), "unpadded": unpadded, "nn.Linear": lambda: step(dense)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=30)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-other-load", type=float, default=0.15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows, repeats = (64, 1) if args.quick else (args.rows, args.repeats)
    padding = contract.bottleneck_padding(args.rank, "cpu")
    results, table = [], []
    for in_features, out_features in shapes:
        timing = harness.interleave(candidates(in_features, out_features, args.rank, rows), repeats=repeats,
                                    min_sample_s=0.05, max_other_load=args.max_other_load)
        med = {name: timing.median(name) for name in ("padded", "unpadded", "nn.Linear")}
        results.append({"shape": [in_features, out_features], "median_s": med, "timing": timing.summary()})
        table.append([f"{in_features}x{out_features}", harness.ms(med["padded"]), harness.ms(med["unpadded"]),
                      harness.ms(med["nn.Linear"]), harness.times(med["unpadded"] / med["padded"]),
                      harness.times(med["nn.Linear"] / med["padded"]), harness.times(med["nn.Linear"] / med["unpadded"])])
    print(f"### half_merge bottleneck rank {args.rank} (+{padding} zero slices), {rows} rows, forward + backward\n")
    print(harness.table(["layer", "padded ms", "unpadded ms", "nn.Linear ms", "unpadded / padded",
                         "nn.Linear / padded", "nn.Linear / unpadded"], table))
    path = harness.write_json(args.out_dir / "rank_padding.json", {"rank": args.rank, "padding": padding, "rows": rows,
                                                                    "results": results, "machine": harness.machine_info()})
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
