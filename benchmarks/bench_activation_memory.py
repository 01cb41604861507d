"""Peak training memory of the six-encoder with and without activation checkpointing, and its step-time cost.

The model of ``configs/mnli_6enc.yaml`` (``SequenceClassifier``: d_model 768, 12 heads, d_ff 3072, 6 layers,
seq 128, dropout 0.1; built by ``bench_training_step.build_model``) trained one step at a time, four ways:

- ``dense+AdamW`` and ``CoMERA r30`` as in ``bench_training_step.py`` (CoMERA with RankAdaptation's per-step
  work);
- the same two with ``activation_checkpointing=True``: each encoder block keeps only its input and is run again
  in the backward pass (``comera_lightning.models.checkpointing.run_block``; gradients are unchanged, which
  ``tests/models`` checks in float64).

Peak memory of one steady step (parameters, gradients, optimiser state, activations, temporaries) is measured
by ``harness.peak_memory`` (torch's MemTracker; not sensitive to other load). The step time of each
checkpointed candidate against its plain twin is measured interleaved in this process (``harness.interleave``)
and reported as a ratio: run it alone on the machine.

    python benchmarks/bench_activation_memory.py                     # batch 32 x 128, 3 rounds
    python benchmarks/bench_activation_memory.py --quick             # tiny model, seconds
    python benchmarks/bench_activation_memory.py --batch 8 --repeats 5 --threads 2

Writes ``activation_memory.json`` in ``--out-dir`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from bench_training_step import COMERA, DENSE, Shape, comera, dense_adamw, make_batch, paper_shape  # noqa: E402

TARGET_MEMORY_VS_DENSE = 3.0
CHECKPOINTED = " + checkpointing"


def candidates(shape: Shape, batch: int) -> tuple[dict, tuple[torch.Tensor, torch.Tensor]]:
    """The four candidates on one batch, each primed with a step (optimiser state exists)."""
    ids, labels = make_batch(shape, batch)
    cands = {}
    for name, build in ((DENSE, dense_adamw), (COMERA, comera)):
        cands[name] = build(shape, ids, labels)
        cand = build(shape, ids, labels)
        cand.model.encoder.activation_checkpointing = True
        cand.name = name + CHECKPOINTED
        cands[cand.name] = cand
    return cands, (ids, labels)


def run(shape: Shape, batch: int, repeats: int, max_other_load: float, wait_quiet_s: float) -> dict:
    cands, inputs = candidates(shape, batch)
    memory = {}
    for name, cand in cands.items():
        memory[name] = harness.peak_memory(cand.step, modules=[cand.model], optimizers=[cand.optimizer],
                                           tensors=list(inputs))
    timing = harness.interleave({name: cand.step for name, cand in cands.items()}, repeats=repeats,
                                max_other_load=max_other_load, wait_quiet_s=wait_quiet_s)
    medians = {name: timing.median(name) for name in cands}
    return {"shape": shape.__dict__, "batch": batch, "memory": memory, "step_s": medians,
            "timing": timing.summary(), "parameters": {name: cand.parameters for name, cand in cands.items()}}


def table(res: dict) -> str:
    dense_peak = res["memory"][DENSE]["total"]
    rows = []
    for name, mem in res["memory"].items():
        plain = name.removesuffix(CHECKPOINTED)
        cost = res["step_s"][name] / res["step_s"][plain]
        rows.append([name, harness.mib(mem["total"]), harness.mib(mem["activations"]), harness.times(dense_peak /
                     mem["total"]), harness.ms(res["step_s"][name]), f"{cost:.2f}x"])
    return harness.table(["candidate", "peak MiB", "activations at the peak MiB", "dense peak / this", "step ms",
                          "step / plain twin"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny model, for a smoke run")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-other-load", type=float, default=0.15)
    parser.add_argument("--wait-quiet", type=float, default=0.0)
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = paper_shape()
    if args.quick:
        shape = replace(shape, vocab_size=1000, d_model=64, num_heads=2, d_ff=128, num_layers=2, seq_len=32)
        args.batch, args.repeats = min(args.batch, 4), 1
    res = run(shape, args.batch, args.repeats, args.max_other_load, args.wait_quiet)
    res["machine"] = harness.machine_info()
    comera_ckpt = res["memory"][COMERA + CHECKPOINTED]["total"]
    ratio = res["memory"][DENSE]["total"] / comera_ckpt
    res["target"] = {"memory_vs_dense": TARGET_MEMORY_VS_DENSE, "measured": ratio,
                     "met": ratio >= TARGET_MEMORY_VS_DENSE}
    print(f"### Activation checkpointing, batch {args.batch} x {shape.seq_len}, d_model {shape.d_model}, "
          f"{shape.num_layers} layers\n")
    print(table(res))
    print(f"\nTarget: CoMERA{CHECKPOINTED} peak >= {TARGET_MEMORY_VS_DENSE:g}x below dense+AdamW: {ratio:.2f}x "
          f"({'met' if res['target']['met'] else 'MISSED'})")
    path = harness.write_json(args.out_dir / "activation_memory.json", res)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
