"""The compiled path: the six-encoder training step of dense and CoMERA, eager and under ``torch.compile``.

Dense + AdamW and CoMERA (AdamW over its parameter groups, RankAdaptation's per-step work), each eager and compiled
in place with ``nn.Module.compile`` as the ``Compile`` callback does, timed interleaved (ratios of medians); graph
breaks and frames are counted while they compile. The target: CoMERA compiled 6x faster than dense compiled, batch 8.

    python -m benchmarks.bench_compiled --wait-quiet 60            # batch 8, 6 layers (inductor compiles for minutes)
    python -m benchmarks.bench_compiled --quick --backend aot_eager  # the plumbing in seconds
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch
from torch._dynamo.utils import counters

from benchmarks import harness
from benchmarks.bench_training_step import comera, dense_adamw, explain
from benchmarks.harness import make_batch, paper_shape

DENSE, COMERA = "dense", "CoMERA"
TARGET = 6.0


def compiled(cand, backend: str):
    """``cand`` with its model compiled in place and primed (the compilation happens there); records the graph
    breaks, the frames that fell back to eager and the seconds the compilation took."""
    counters.clear()
    torch.compiler.reset()
    cand.model.compile(backend=backend)
    started = time.perf_counter()
    cand.prime()
    cand.step()  # the second step: the optimiser's state exists, nothing new to trace
    cand.info.update(compile_s=time.perf_counter() - started, graph_breaks=sum(counters["graph_break"].values()))
    cand.info.update(frames=dict(counters["frames"]), graphs=counters["stats"].get("unique_graphs", 0))
    return cand


def main(argv: list[str] | None = None) -> int:
    parser = harness.bench_parser(__doc__, repeats=(2, 5))
    parser.add_argument("--batch", type=harness.positive_int, default=harness.Quick(2, 8))
    parser.add_argument("--layers", type=harness.positive_int, default=harness.Quick(1, 6))
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--profile", choices=["auto", "always", "never"], default="auto", help="auto: on a miss")
    args = harness.parse(parser, argv)
    shape = replace(paper_shape(), num_layers=args.layers)
    if args.quick:
        shape = replace(shape, d_model=64, num_heads=1, d_ff=256, num_layers=1, vocab_size=512, seq_len=16, rank=4)
        shape = replace(shape, embedding_rank=4)
    ids, labels = make_batch(shape, args.batch)
    print(
        f"## compiled step: {shape.num_layers} layers, d_model {shape.d_model}, batch {args.batch} x {shape.seq_len}, "
        f"backend {args.backend}, {torch.get_num_threads()} threads",
        flush=True,
    )
    cands = [
        replace(dense_adamw(shape, ids, labels), name=DENSE),
        replace(compiled(dense_adamw(shape, ids, labels), args.backend), name=f"{DENSE} compiled"),
        replace(comera(shape, ids, labels), name=COMERA),
        replace(compiled(comera(shape, ids, labels), args.backend), name=f"{COMERA} compiled"),
    ]
    timing = harness.interleave({c.name: c.step for c in cands}, **harness.timing_options(args))
    median = {c.name: timing.median(c.name) for c in cands}
    rows = []
    for c in cands:
        against = (median[f"{DENSE} compiled"], median[c.name.removesuffix(" compiled")])
        cells = [c.name, f"{c.parameters:,}", harness.ms(median[c.name])]
        cells += [harness.times(harness.ratio(m, median[c.name])) for m in against]
        compile_s = f"{c.info['compile_s']:.0f}" if "compile_s" in c.info else "-"
        rows.append([*cells, c.info.get("graph_breaks", "-"), compile_s])
    headers = "candidate|parameters|step ms|vs dense compiled|vs its eager self|graph breaks|compile s"
    table = harness.table(headers, rows)
    speedup = harness.ratio(median[f"{DENSE} compiled"], median[f"{COMERA} compiled"])
    verdict = (
        f"CoMERA compiled is {harness.times(speedup)} dense compiled at batch {args.batch} "
        f"(target {TARGET:.0f}x: {harness.verdict(speedup, TARGET)})"
    )
    profile = None
    if args.profile == "always" or (args.profile == "auto" and (speedup is None or speedup < TARGET)):
        profile = {k: harness.profile_ops(c.step) for k, c in (("comera", cands[3]), ("other", cands[1]))}
        profile["why"] = explain(profile["comera"], profile["other"], f"{DENSE} compiled")
        verdict += f"\n\nwhy (profile of the compiled steps): {profile['why']}"
    print("\n" + table + "\n\n" + verdict)
    harness.emit(
        args.out_dir / f"compiled_step{'_quick' if args.quick else ''}.json",
        {
            "machine": harness.machine_info(),
            "settings": {**harness.settings(args), "shape": shape.__dict__},
            "median_s": median,
            "min_s": {c.name: timing.minimum(c.name) for c in cands},
            "info": {c.name: c.info for c in cands},
            "speedup_compiled": speedup,
            "target": TARGET,
            "profile": profile,
        },
        markdown=table + "\n\n" + verdict,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
