"""The width study's wall-clock front, run alone: every final's training step timed on a quiet machine.

The study trains two runs at once, so its own clock (``train_s``) is that of a machine shared with another run. This
script times the training step of every seed-0 final's model in one process, interleaved round by round
(``harness.interleave``, rounds with other load left out), with the machine's every thread: the step as the run
took it (forward, backward, RankAdaptation's per-step work for CoMERA, AdamW). Dense's and the uniform TT's shape
never changes; CoMERA's is timed at its start ranks and at the ranks its run ended with (the cores cut to them).

A run's clock alone is then the sum over its counted FLOPs schedule (``flops_per_step``: FLOPs per step from each
cut on) of steps x step time, the step time read linearly in FLOPs between the two shapes timed
(:func:`benchmarks.studies.width_report.alone_seconds`). Lightning's loop, data loading and validation are not in
it. The FLOPs of each shape are counted twice: as the study counted them on its CPU (with the zero slices a CPU pads
the bottleneck with), and without them. All goes into the study's JSON as ``clock_alone``; run it when the study is
not running (the study rewrites its JSON after every run), then ``python -m benchmarks.studies.report --write``.

    python -m benchmarks.studies.width_clock                     # docs/data/width_stdlib.json, ~5 minutes
    python -m benchmarks.studies.width_clock --quick --out /tmp/w.json  # the smoke study's JSON
    python -m benchmarks.studies.width_clock --device cuda --precision bf16-mixed \
        --write-to /tmp/width_cuda.json          # on a GPU (the GPU checks' width_clock): the same study, its clock
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parents[2]


def shapes(state: dict[str, Any], widths: Sequence[int] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(``start`` or ``end``, run) for every finished seed-0 final (at ``widths`` only, when given): its start
    shape, and CoMERA's end shape too."""
    runs = [r for r in state["runs"] if r["phase"] == "final" and r["seed"] == 0 and "error" not in r]
    runs = [r for r in runs if widths is None or r["width"] in widths]
    return [("start", r) for r in runs] + [("end", r) for r in runs if r["family"] == "comera"]


def key_of(shape: str, run: dict[str, Any]) -> str:
    return f"{run['family']}/{run['width']}/{shape}"


def cut_to_ranks_(task, ranks: dict[str, list[int]]) -> None:
    """Cut every TT layer of ``task`` to ``ranks`` (name -> boundary ranks, as a run records them): the leading
    slices kept, the rest removed from the cores."""
    from comera_lightning.nn import tt_layers

    for name, layer in tt_layers(task):
        wanted = ranks[name]
        for bond, (now, keep) in enumerate(zip(layer.ranks[1:-1], wanted[1:-1], strict=True)):
            if keep < now:
                layer.remove_slices_(bond, range(keep, now))
        layer.truncate_()
        if layer.ranks != list(wanted):
            raise RuntimeError(f"{name}: cut to ranks {layer.ranks}, wanted {wanted}")


def candidate(spec, shape: str, run: dict[str, Any], batch, execution):
    """The training step of ``run``'s model at ``shape`` where and in which precision ``execution`` says, primed
    (its optimiser state exists)."""
    import torch

    from benchmarks.bench_training_step import Candidate, comera_candidate, train_step
    from benchmarks.studies import common as study
    from benchmarks.studies import tuned as ts
    from benchmarks.studies.width import model_kwargs
    from comera_lightning.optim import comera_parameter_groups

    torch.manual_seed(0)
    kwargs = model_kwargs(spec, run["family"], run["width"], run["parameterization"], run["rank"])
    task = study.task_class(spec.name)(**ts.with_optim(kwargs, run["lr"], run["steps"]))
    if shape == "end":
        cut_to_ranks_(task, run["ranks_final"])
    task.to(execution.device).train()
    optimizer = torch.optim.AdamW(comera_parameter_groups(task, run["lr"], ts.GATE_LR, run["lr"]))

    def loss() -> torch.Tensor:
        with execution.autocast():
            return ts.training_loss(task, batch)

    name = key_of(shape, run)
    if run["family"] == "comera":
        return comera_candidate(name, task, optimizer, loss)
    return Candidate(name, task, optimizer, train_step(optimizer, loss)).prime()


def measure(state: dict[str, Any], args: argparse.Namespace) -> dict:
    """``clock_alone``: the median step seconds of every shape, with the FLOPs of the step timed."""
    import torch

    from benchmarks import harness
    from benchmarks.bench_training_step import Execution
    from benchmarks.studies import common as study
    from benchmarks.studies import tuned as ts
    from benchmarks.studies.width import data_settings
    from comera_lightning.tt import contract

    execution = Execution(args.device, args.precision)
    spec = ts.base_spec("lm", "stdlib", 0, state["protocol"]["steps"], args.quick, data_settings(args.quick))
    batch = next(iter(study.build_datamodule(spec, args.cache_dir).val_dataloader()))
    batch = {k: v.to(execution.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    cpu_padding = functools.partial(contract.bottleneck_padding, device_type="cpu")
    cands, flops, unpadded = {}, {}, {}
    for shape, run in shapes(state, args.widths):
        cand = candidate(spec, shape, run, batch, execution)
        cands[cand.name] = cand
        # a CPU pads half_merge's bottleneck with zero slices its BLAS multiplies faster (bottleneck_padding): the
        # study counted the FLOPs run on its CPU, which every device's count follows; without the padding they are
        # the algorithm's, as a GPU runs them
        with mock.patch.object(contract, "bottleneck_padding", lambda rank, device_type: cpu_padding(rank)):
            flops[cand.name] = ts.step_flops(cand.model, batch)
        with mock.patch.object(contract, "bottleneck_padding", return_value=0):
            unpadded[cand.name] = ts.step_flops(cand.model, batch)
    timing = harness.interleave(
        {name: cand.step for name, cand in cands.items()}, repeats=args.repeats, wait_quiet_s=args.wait_quiet
    )
    return {
        "device": execution.describe(),
        "precision": execution.precision,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "contended": timing.contended,
        "step_s": timing.medians(),
        "step_s_spread": {n: max(s) - min(s) for n, s in timing.samples.items()},
        "step_flops": flops,
        "step_flops_unpadded": unpadded,
        "machine": harness.machine_info(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M"),
    }


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks import harness
    from benchmarks.bench_training_step import DEVICES, PRECISIONS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "data" / "width_stdlib.json", help="the study")
    parser.add_argument("--write-to", type=Path, default=None, help="write the study with its clock here (not --out)")
    parser.add_argument("--quick", action="store_true", help="the JSON of a --quick study")
    parser.add_argument("--widths", type=int, nargs="+", default=None, help="time the finals at these widths only")
    parser.add_argument("--device", choices=DEVICES, default="cpu")
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true", help="bf16-mixed: bfloat16 autocast")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wait-quiet", type=float, default=300.0, help="seconds to wait for a quiet machine")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "comera")
    args = parser.parse_args(argv)
    if not args.out.exists():
        parser.error(f"{args.out} does not exist: run the width study first (python -m benchmarks.studies.width)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; run on a GPU machine or leave --device at cpu")
    state = harness.read_json(args.out)
    if not shapes(state, args.widths):
        parser.error(f"{args.out} has no finished final run of seed 0 to time (widths: {args.widths or 'all'})")
    clock = measure(state, args)
    state = harness.read_json(args.out)  # re-read: only ``clock_alone`` changes
    state["clock_alone"] = clock
    written = harness.write_json(args.write_to or args.out, state)
    for name, seconds in clock["step_s"].items():
        print(f"{name:>20}: {seconds * 1e3:8.1f} ms a step, {clock['step_flops'][name] / 1e9:8.2f} GFLOPs")
    print(f"JSON: {written} (clock_alone; contended rounds: {clock['contended']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
