"""Peak training memory of the six-encoder with and without activation checkpointing, and its step-time cost.

The model of ``configs/mnli_6enc.yaml`` trained one step at a time four ways: ``dense+AdamW`` and ``CoMERA r30``
as in ``bench_training_step.py``, and the same two with ``activation_checkpointing=True`` (each encoder block
keeps only its input and runs again in the backward pass; gradients unchanged, as ``tests/models`` checks).
Peak memory of one steady step by ``harness.peak_memory``; the step time of each checkpointed candidate against
its plain twin, interleaved (``harness.interleave``: run it alone). Writes ``activation_memory.json``.

    python -m benchmarks.bench_activation_memory                     # batch 32 x 128, 3 rounds
    python -m benchmarks.bench_activation_memory --quick             # tiny model, seconds
"""

from __future__ import annotations

from dataclasses import replace

from benchmarks import bench_training_step as bts
from benchmarks import harness
from benchmarks.bench_training_step import COMERA, DENSE

TARGET_MEMORY_VS_DENSE = 3.0
CHECKPOINTED = " + checkpointing"


def run(shape: harness.Shape, batch: int, **timing) -> dict:
    """Peak memory and interleaved step time of the four candidates on one batch (``bts.measure``)."""
    ids, labels = harness.make_batch(shape, batch)
    cands = []
    for build in (bts.dense_adamw, bts.comera):
        plain, checkpointed = build(shape, ids, labels), build(shape, ids, labels)
        checkpointed.name += CHECKPOINTED
        checkpointed.model.encoder.activation_checkpointing = True
        cands += [plain, checkpointed]
    timing, entries = bts.measure(cands, (ids, labels), **timing)
    return {
        "shape": shape.__dict__,
        "batch": batch,
        "memory": {n: e["memory"] for n, e in entries.items()},
        "step_s": timing.medians(),
        "timing": timing.summary(),
        "candidates": entries,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table and the target, write ``activation_memory.json``."""
    parser = harness.bench_parser(__doc__, repeats=(1, 3))
    parser.add_argument("--batch", type=int, default=32)
    args = harness.parse(parser, argv)
    shape = harness.paper_shape()
    if args.quick:
        shape = replace(shape, vocab_size=1000, d_model=64, num_heads=2, d_ff=128, num_layers=2, seq_len=32)
        args.batch = min(args.batch, 4)
    res = run(shape, args.batch, **harness.timing_options(args))
    res["machine"] = harness.machine_info()
    dense_peak = res["memory"][DENSE]["total"]
    rows = [
        [
            name,
            harness.mib(mem["total"]),
            harness.mib(mem["activations"]),
            harness.times(dense_peak / mem["total"]),
            harness.ms(res["step_s"][name]),
            harness.times(res["step_s"][name] / res["step_s"][name.removesuffix(CHECKPOINTED)]),
        ]
        for name, mem in res["memory"].items()
    ]
    ratio = dense_peak / res["memory"][COMERA + CHECKPOINTED]["total"]
    res["target"] = {
        "memory_vs_dense": TARGET_MEMORY_VS_DENSE,
        "measured": ratio,
        "met": ratio >= TARGET_MEMORY_VS_DENSE,
    }
    print(
        f"### Activation checkpointing, batch {args.batch} x {shape.seq_len}, d_model {shape.d_model}, "
        f"{shape.num_layers} layers\n"
    )
    print(
        harness.table(
            [
                "candidate",
                "peak MiB",
                "activations at the peak MiB",
                "dense peak / this",
                "step ms",
                "step / plain twin",
            ],
            rows,
        )
    )
    print(
        f"\nTarget: CoMERA{CHECKPOINTED} peak >= {TARGET_MEMORY_VS_DENSE:g}x below dense+AdamW: {ratio:.2f}x "
        f"({'met' if res['target']['met'] else 'MISSED'})"
    )
    harness.emit(args.out_dir / "activation_memory.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
