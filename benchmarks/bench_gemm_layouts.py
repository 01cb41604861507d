"""The six GEMMs of a ``half_merge`` TT step, each in the operand layouts it could be given, against one dense GEMM.

``TTLinearFunction``'s ``half_merge`` plan runs six skinny GEMMs per forward + backward (``x L``, ``h R``, and in the
backward ``grad_y R^T``, ``h^T grad_y``, ``grad_h L^T``, ``x^T grad_h``) where ``nn.Linear`` runs three square ones.
How fast MKL runs a skinny GEMM depends on which operand is transposed, so each product is timed in the layouts
that give the same result, interleaved with one dense ``x W`` in one process (medians). The sum of the six against
three dense GEMMs is the TT layer's speedup on its GEMMs alone: what the layer could reach without any other work.

    python benchmarks/bench_gemm_layouts.py                       # 4096 x 768, rank 32, about 30 s
    python benchmarks/bench_gemm_layouts.py --keep-freed-memory   # glibc keeps freed memory (no page faults)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import harness
import torch

# product -> {layout: step}; the first layout of each is what TTLinearFunction runs
Products = dict[str, dict[str, Callable[[], torch.Tensor]]]


def products(rows: int, features: int, rank: int) -> tuple[Products, Callable[[], torch.Tensor]]:
    """The six products of a (rows, features) x (features, features) TT step at ``rank``, and the dense GEMM."""
    gen = torch.Generator().manual_seed(0)
    x, grad_y = torch.randn(rows, features, generator=gen), torch.randn(rows, features, generator=gen)
    h, grad_h = torch.randn(rows, rank, generator=gen), torch.randn(rows, rank, generator=gen)
    left, right = torch.randn(features, rank, generator=gen), torch.randn(rank, features, generator=gen)
    left_t, right_t = left.t().contiguous(), right.t().contiguous()
    weight = torch.randn(features, features, generator=gen)
    table: Products = {
        "y = x L": {"x @ L": lambda: x @ left, "x @ (L^T)^T": lambda: x @ left_t.t()},
        "y = h R": {"h @ R": lambda: h @ right, "h @ (R^T)^T": lambda: h @ right_t.t()},
        "grad_h = grad_y R^T": {"grad_y @ R.t()": lambda: grad_y @ right.t(), "grad_y @ R^T": lambda: grad_y @ right_t},
        "grad_R = h^T grad_y": {
            "(grad_y^T h)^T": lambda: (grad_y.t() @ h).t(),
            "h.t() @ grad_y": lambda: h.t() @ grad_y,
        },
        "grad_x = grad_h L^T": {
            "grad_h @ L.t()": lambda: grad_h @ left.t(),
            "grad_h @ L^T": lambda: grad_h @ left_t,
        },
        "grad_L = x^T grad_h": {
            "x.t() @ grad_h": lambda: x.t() @ grad_h,
            "(grad_h^T x)^T": lambda: (grad_h.t() @ x).t(),
        },
    }
    return table, lambda: x @ weight


def build_parser():
    parser = harness.bench_parser(__doc__, repeats=(2, 15))
    parser.add_argument("--rows", type=harness.positive_int, default=harness.Quick(256, 4096))
    parser.add_argument("--features", type=harness.positive_int, default=harness.Quick(96, 768))
    parser.add_argument("--rank", type=harness.positive_int, default=32)
    parser.add_argument("--keep-freed-memory", action="store_true", help="glibc keeps freed memory for the run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = harness.parse(build_parser(), argv)
    if args.keep_freed_memory:
        harness.keep_freed_memory_for_run()
    table, dense = products(args.rows, args.features, args.rank)
    steps = {f"{product}: {layout}": step for product, layouts in table.items() for layout, step in layouts.items()}
    steps["dense x W"] = dense
    timing = harness.interleave(steps, **harness.timing_options(args))
    median = {name: timing.median(name) for name in steps}
    rows, used, best = [], 0.0, 0.0
    for product, layouts in table.items():
        times = {layout: median[f"{product}: {layout}"] for layout in layouts}
        used += times[next(iter(layouts))]
        best += min(times.values())
        slowest = max(times.values())
        rows += [[product, layout, harness.ms(t), harness.times(slowest / t)] for layout, t in times.items()]
    dense_step = 3 * median["dense x W"]
    text = harness.table(["product", "layout (first: what TTLinearFunction runs)", "ms", "slowest / this"], rows)
    verdict = (
        f"dense step (3 GEMMs) {harness.ms(dense_step)} ms; the six TT GEMMs as run {harness.ms(used)} ms "
        f"({harness.times(dense_step / used)} on the GEMMs alone), in the best layouts {harness.ms(best)} ms "
        f"({harness.times(dense_step / best)})"
    )
    title = f"## {args.rows} x {args.features}, rank {args.rank}, {torch.get_num_threads()} threads"
    print(f"{title}\n\n{text}\n\n{verdict}")
    harness.emit(
        args.out_dir / f"gemm_layouts{'_quick' if args.quick else ''}.json",
        {
            "machine": harness.machine_info(),
            "settings": harness.settings(args),
            "median_s": median,
            "dense_step_s": dense_step,
            "tt_gemms_s": used,
            "tt_gemms_best_s": best,
        },
        markdown=text + "\n\n" + verdict,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
