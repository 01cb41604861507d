"""DDP step with TT-core gradients in their parameters' layout (now) against the layout the contractions leave
(before issue 26), in the same two processes.

Two ranks (gloo, one thread each) wrap the quickstart's masked LM (``configs/quickstart.yaml``: d_model 128,
TT rank 32) in ``DistributedDataParallel`` twice from the same initial weights. ``before`` runs with
``grad_in_layout`` replaced by the identity (what the TT backward returned before the fix: DDP's reducer then
warns "Grad strides do not match bucket view strides" and copies those gradients with their odd strides);
``kept`` is the code as it is. Rounds alternate the two in a seeded random order, the same on both ranks, and
the claim is the ratio of median step times (forward, backward with the all-reduce, AdamW). The count of
parameters whose gradient's strides differ from the parameter's shows that ``before`` reproduces the old layout.

    python benchmarks/bench_ddp_grad_layout.py           # 8 rounds of 10 steps per variant
    python benchmarks/bench_ddp_grad_layout.py --quick   # the plumbing
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import harness
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = ("before", "kept")
BATCH, SEQ = 16, 64


@contextlib.contextmanager
def gradients_as_contracted():
    """The TT backward as before the fix: gradients in whatever layout the contraction produced."""
    from comera_lightning.tt import contract, cores

    saved = cores.grad_in_layout, contract.grad_in_layout
    cores.grad_in_layout = contract.grad_in_layout = lambda grad, shape, strides: grad
    try:
        yield
    finally:
        cores.grad_in_layout, contract.grad_in_layout = saved


def _model(d_model: int):
    import yaml

    from comera_lightning.lit import MaskedLM

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml").read_text())
    init = {**config["model"]["init_args"], "d_model": d_model, "d_ff": 4 * d_model}
    torch.manual_seed(0)
    return MaskedLM(**init).model


def _worker(rank: int, world: int, spec: dict, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    warnings.filterwarnings("ignore", message="Grad strides do not match")
    models = {name: torch.nn.parallel.DistributedDataParallel(_model(spec["d_model"])) for name in VARIANTS}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(5, 2048, (BATCH, SEQ), generator=gen)
    labels = torch.where(torch.rand(BATCH, SEQ, generator=gen) < 0.15, ids, torch.full_like(ids, -100))

    def step(name: str) -> int:
        logits = models[name](ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        odd = sum(p.grad is not None and p.grad.stride() != p.stride() for p in models[name].parameters())
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        return odd

    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    odd: dict[str, int] = {}
    order = random.Random(0)
    for round_index in range(spec["rounds"] + 1):  # round 0 warms both up and is not counted
        for name in order.sample(VARIANTS, len(VARIANTS)):
            with gradients_as_contracted() if name == "before" else contextlib.nullcontext():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(spec["steps"]):
                    odd[name] = step(name)
                elapsed = (time.perf_counter() - start) / spec["steps"]
            if round_index:
                times[name].append(elapsed)
    if rank == 0:
        harness.write_json(
            Path(out),
            {
                "times": times,
                "odd_layout_parameters": odd,
                "parameters": sum(p.numel() for p in models["kept"].parameters()),
            },
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = harness.bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=harness.Quick(2, 8), help="timed rounds per variant")
    parser.add_argument("--steps", type=int, default=harness.Quick(2, 10), help="steps per round")
    parser.add_argument("--d-model", type=int, default=harness.Quick(64, 128), help="model width (default 128)")
    parser.add_argument("--port", type=int, default=29517, help="the rendezvous port on 127.0.0.1")
    args = harness.parse(parser, argv)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.json"
        spec = {"rounds": args.rounds, "steps": args.steps, "d_model": args.d_model, "port": args.port}
        mp.spawn(_worker, args=(2, spec, str(raw)), nprocs=2, join=True)
        measured = harness.read_json(raw)
    medians = {name: statistics.median(values) for name, values in measured["times"].items()}
    speedup = medians["before"] / medians["kept"]
    markdown = harness.table(
        ["variant", "median step ms (2 ranks, 1 thread each)", "parameters with a gradient in another layout"],
        [[name, harness.ms(medians[name]), measured["odd_layout_parameters"][name]] for name in VARIANTS],
    )
    markdown += f"\n\nbefore / kept: {harness.times(speedup)} ({args.rounds} rounds of {args.steps} steps each)"
    print(markdown)
    harness.emit(
        args.out_dir / ("ddp_grad_layout_quick.json" if args.quick else "ddp_grad_layout.json"),
        {
            "machine": harness.machine_info(),
            "settings": harness.settings(args),
            **measured,
            "median_step_s": medians,
            "before_over_kept": speedup,
        },
        markdown=markdown,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
