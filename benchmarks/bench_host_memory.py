"""KeepFreedMemory on the six-encoder training step: glibc's default malloc vs freed memory kept, one process.

With glibc's defaults every block above the mmap threshold is mapped fresh and unmapped on free, so a step
page-faults its large activations in again (the kernel maps and zeroes them). ``keep_freed_memory`` (the
``KeepFreedMemory`` callback) keeps freed memory in the process. This alternates the two settings in one
process, round by round, for the dense and the CoMERA six-encoder step of ``bench_training_step.py`` (batch 32
x 128, AdamW, CoMERA with RankAdaptation's per-step work): after each switch one untimed step settles the heap,
then ``--steps`` steps are timed, with their minor page faults and system CPU time (``getrusage``). One model is
trained per process in real runs, so this is the steady state a ``comera fit`` sees.

    python benchmarks/bench_host_memory.py                       # 3 rounds, run alone
    python benchmarks/bench_host_memory.py --quick               # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_training_step as bts  # noqa: E402
import harness  # noqa: E402
from comera_lightning.training.host_memory import keep_freed_memory  # noqa: E402

MODES = ("glibc default", "kept")


def measure(step, steps: int) -> dict:
    """Wall seconds, minor faults and system seconds per step over ``steps`` calls of ``step``."""
    start = time.perf_counter()
    faults = system = 0.0
    for _ in range(steps):
        k = harness.kernel_work(step)
        faults += k["minor_faults"]
        system += k["system_s"]
    return {"step_s": (time.perf_counter() - start) / steps, "minor_faults": faults / steps, "system_s": system / steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per setting and round")
    parser.add_argument("--packed-dropout", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not keep_freed_memory(False):
        raise SystemExit("this benchmark needs glibc (mallopt)")
    shape = replace(bts.paper_shape(), packed_dropout=args.packed_dropout)
    batch, rounds, steps = (2, 1, 1) if args.quick else (32, args.rounds, args.steps)
    if args.quick:
        shape = replace(shape, num_layers=1)
    ids, labels = bts.make_batch(shape, batch)
    candidates = {"dense+AdamW": bts.dense_adamw(shape, ids, labels), "CoMERA r30": bts.comera(shape, ids, labels)}
    samples: dict[str, dict[str, list[dict]]] = {name: {mode: [] for mode in MODES} for name in candidates}
    for r in range(rounds):
        for name, cand in candidates.items():
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                keep_freed_memory(mode == "kept")
                cand.step()  # settles the heap after the switch
                samples[name][mode].append(measure(cand.step, steps))
    keep_freed_memory(False)
    rows, summary = [], {}
    for name, by_mode in samples.items():
        med = {mode: {k: statistics.median(s[k] for s in by_mode[mode]) for k in ("step_s", "minor_faults", "system_s")}
               for mode in MODES}
        summary[name] = med
        rows.append([name, harness.ms(med[MODES[0]]["step_s"]), harness.ms(med[MODES[1]]["step_s"]),
                     harness.times(med[MODES[0]]["step_s"] / med[MODES[1]]["step_s"]),
                     f"{med[MODES[0]]['minor_faults']:,.0f} / {med[MODES[0]]['system_s']:.2f} s",
                     f"{med[MODES[1]]['minor_faults']:,.0f} / {med[MODES[1]]['system_s']:.2f} s"])
    dense, comera = summary["dense+AdamW"], summary["CoMERA r30"]
    ratios = {mode: dense[mode]["step_s"] / comera[mode]["step_s"] for mode in MODES}
    print(f"### six-encoder step, batch {batch} x {shape.seq_len}, {rounds} rounds x {steps} steps per setting"
          f"{', packed dropout' if args.packed_dropout else ''}\n")
    print(harness.table(["candidate", "default ms", "kept ms", "default / kept", "faults / system s per step, default",
                         "kept"], rows))
    print(f"\ndense / CoMERA step: {harness.times(ratios[MODES[0]])} with glibc's default, "
          f"{harness.times(ratios[MODES[1]])} with freed memory kept")
    path = harness.write_json(args.out_dir / "host_memory.json",
                              {"batch": batch, "rounds": rounds, "steps": steps, "packed_dropout": args.packed_dropout,
                               "samples": samples, "medians": summary, "dense_over_comera": ratios,
                               "machine": harness.machine_info()})
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
