"""The padded bottleneck of ``half_merge``: TTLinear forward + backward with and without it, against nn.Linear.

``comera_lightning.tt.contract.bottleneck_padding`` adds zero slices to the bottleneck rank of the ``half_merge``
plan on a CPU (26-31 -> 32, 42-47 -> 48, 58-63 -> 64): the same product, but the skinny GEMMs of a step run at a
width the BLAS handles better. Timed interleaved in one process (``harness.interleave``): one forward + backward
of ``TTLinear`` at the paper's shapes and modes with the padding (the default), without it, and ``nn.Linear``.
Writes ``rank_padding.json``.

    python benchmarks/bench_rank_padding.py                 # rank 30, 4096 rows, run alone
    python benchmarks/bench_rank_padding.py --rank 28 --rows 1024 --threads 1
"""

from __future__ import annotations

from contextlib import contextmanager

import harness
import torch
from torch import nn

import comera_lightning.tt.contract as contract
from comera_lightning.models import paper_linear_modes
from comera_lightning.nn import TTLinear

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
    """Padded and unpadded ``half_merge`` TTLinear steps and the nn.Linear step on one input."""
    torch.manual_seed(0)
    in_modes, out_modes = paper_linear_modes(in_features, out_features)
    tt = TTLinear(in_features, out_features, rank, in_modes=in_modes, out_modes=out_modes)
    tt.set_contraction_plan("half_merge")
    dense = nn.Linear(in_features, out_features)
    x = torch.randn(rows, in_features, requires_grad=True)
    upstream = torch.randn(rows, out_features)
    padded = harness.backward_step(lambda: tt(x), [x], upstream)

    def unpadded() -> None:
        with padding_off():
            padded()

    return {"padded": padded, "unpadded": unpadded, "nn.Linear": harness.backward_step(lambda: dense(x), [x], upstream)}


def main(argv: list[str] | None = None) -> int:
    """Time every shape, print the table, write ``rank_padding.json``."""
    parser = harness.bench_parser(__doc__, repeats=(1, 8))
    parser.add_argument("--rank", type=int, default=30)
    parser.add_argument("--rows", type=int, default=4096)
    args = harness.parse(parser, argv)
    shapes, rows = (SHAPES[:1], 64) if args.quick else (SHAPES, args.rows)
    padding = contract.bottleneck_padding(args.rank, "cpu")
    results, table = [], []
    for in_features, out_features in shapes:
        timing = harness.interleave(
            candidates(in_features, out_features, args.rank, rows), min_sample_s=0.05, **harness.timing_options(args)
        )
        med = {name: timing.median(name) for name in ("padded", "unpadded", "nn.Linear")}
        results.append({"shape": [in_features, out_features], "median_s": med, "timing": timing.summary()})
        table.append(
            [
                f"{in_features}x{out_features}",
                *(harness.ms(v) for v in med.values()),
                harness.times(med["unpadded"] / med["padded"]),
                harness.times(med["nn.Linear"] / med["padded"]),
                harness.times(med["nn.Linear"] / med["unpadded"]),
            ]
        )
    print(f"### half_merge bottleneck rank {args.rank} (+{padding} zero slices), {rows} rows, forward + backward\n")
    print(
        harness.table(
            [
                "layer",
                "padded ms",
                "unpadded ms",
                "nn.Linear ms",
                "unpadded / padded",
                "nn.Linear / padded",
                "nn.Linear / unpadded",
            ],
            table,
        )
    )
    harness.emit(
        args.out_dir / "rank_padding.json",
        {"rank": args.rank, "padding": padding, "rows": rows, "results": results, "machine": harness.machine_info()},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
