"""KeepFreedMemory on the six-encoder training step: glibc's default malloc vs freed memory kept, one process.

With glibc's defaults every block above the mmap threshold is mapped fresh and unmapped on free, so a step
page-faults its large activations in again. ``keep_freed_memory`` (the ``KeepFreedMemory`` callback) keeps freed
memory in the process. The two settings alternate round by round for the dense and the CoMERA six-encoder steps
of ``bench_training_step.py`` (batch 32 x 128): one untimed step after each switch, then ``--steps`` timed steps
with their minor page faults and system time (``getrusage``). Writes ``host_memory.json``.

    python benchmarks/bench_host_memory.py                       # 3 rounds, run alone
    python benchmarks/bench_host_memory.py --quick               # smoke run
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import bench_training_step as bts
import harness

from comera_lightning.training.host_memory import keep_freed_memory

MODES = ("glibc default", "kept")


def measure(step, steps: int) -> dict:
    """Wall seconds, minor faults and system seconds per step over ``steps`` calls of ``step``."""
    start = time.perf_counter()
    work = [harness.kernel_work(step) for _ in range(steps)]
    return {
        "step_s": (time.perf_counter() - start) / steps,
        **{k: sum(w[k] for w in work) / steps for k in ("minor_faults", "system_s")},
    }


def main(argv: list[str] | None = None) -> int:
    """Alternate the two settings, print the table, write ``host_memory.json``."""
    parser = harness.bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setting and round")
    parser.add_argument("--packed-dropout", action="store_true")
    args = harness.parse(parser, argv)
    if not keep_freed_memory(False):
        raise SystemExit("this benchmark needs glibc (mallopt)")
    shape = replace(bts.paper_shape(), packed_dropout=args.packed_dropout)
    batch, rounds, steps = (2, 1, 1) if args.quick else (32, args.rounds, args.steps)
    if args.quick:
        shape = replace(shape, num_layers=1)
    ids, labels = bts.make_batch(shape, batch)
    candidates = {bts.DENSE: bts.dense_adamw(shape, ids, labels), bts.COMERA: bts.comera(shape, ids, labels)}
    samples: dict[str, dict[str, list[dict]]] = {name: {mode: [] for mode in MODES} for name in candidates}
    for r in range(rounds):
        for name, cand in candidates.items():
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                keep_freed_memory(mode == "kept")
                cand.step()  # settles the heap after the switch
                samples[name][mode].append(measure(cand.step, steps))
    keep_freed_memory(False)
    summary = {
        name: {
            mode: {k: statistics.median(s[k] for s in by_mode[mode]) for k in ("step_s", "minor_faults", "system_s")}
            for mode in MODES
        }
        for name, by_mode in samples.items()
    }
    work = lambda m: f"{m['minor_faults']:,.0f} / {m['system_s']:.2f} s"  # noqa: E731
    rows = [
        [
            name,
            harness.ms(m[MODES[0]]["step_s"]),
            harness.ms(m[MODES[1]]["step_s"]),
            harness.times(m[MODES[0]]["step_s"] / m[MODES[1]]["step_s"]),
            work(m[MODES[0]]),
            work(m[MODES[1]]),
        ]
        for name, m in summary.items()
    ]
    ratios = {mode: summary[bts.DENSE][mode]["step_s"] / summary[bts.COMERA][mode]["step_s"] for mode in MODES}
    print(
        f"### six-encoder step, batch {batch} x {shape.seq_len}, {rounds} rounds x {steps} steps per setting"
        f"{', packed dropout' if args.packed_dropout else ''}\n"
    )
    print(
        harness.table(
            ["candidate", "default ms", "kept ms", "default / kept", "faults / system s per step, default", "kept"],
            rows,
        )
    )
    print(
        f"\ndense / CoMERA step: {harness.times(ratios[MODES[0]])} with glibc's default, "
        f"{harness.times(ratios[MODES[1]])} with freed memory kept"
    )
    harness.emit(
        args.out_dir / "host_memory.json",
        {
            "batch": batch,
            "rounds": rounds,
            "steps": steps,
            "packed_dropout": args.packed_dropout,
            "samples": samples,
            "medians": summary,
            "dense_over_comera": ratios,
            "machine": harness.machine_info(),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
