"""CUDA graphs (comera_lightning.training.CudaGraphs) against eager training on one GPU: same result, how much faster.

Per precision, at the quickstart's size (launch-bound, where graphs matter): the tensorised masked-LM trained by
Lightning eagerly and captured from one seed, with a forced truncation half-way (one re-capture), losses and
parameters compared; then the bare step timed interleaved at batch 1 and 32, with peak CUDA memory. Without CUDA it
prints ``no CUDA device: skipped``; ``--backend replay`` runs the identity check on the CPU at a tiny size.

    python -m benchmarks.bench_cuda_graphs              # on a GPU: fp32 and bf16-mixed (about a minute)
    python -m benchmarks.bench_cuda_graphs --quick --backend replay   # CPU dry run of the identity check
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from benchmarks import harness
from comera_lightning.callbacks import RankAdaptation
from comera_lightning.models import MaskedLanguageModel
from comera_lightning.nn import tt_layers
from comera_lightning.optim import comera_parameter_groups
from comera_lightning.rank_adaptation import after_truncation
from comera_lightning.training import CudaGraphs

IGNORE = -100
TOLERANCE = {"32-true": 1e-3, "bf16-mixed": 2e-2}  # largest relative difference of a step's loss
UPDATE_TOLERANCE = {"32-true": 1e-2, "bf16-mixed": 5e-2}  # ||theta_graphs - theta_eager|| / ||update||


@dataclass(frozen=True)
class Size:
    """One benchmarked masked-LM: its shape, batch and TT rank."""

    name: str
    vocab: int
    d_model: int
    heads: int
    d_ff: int
    layers: int
    seq: int
    batch: int
    rank: int


TINY = Size("tiny", vocab=128, d_model=64, heads=2, d_ff=128, layers=1, seq=16, batch=4, rank=8)
QUICKSTART = Size("quickstart", vocab=2048, d_model=128, heads=4, d_ff=512, layers=2, seq=64, batch=32, rank=32)


class BenchMLM(LightningModule):
    """Masked-LM with a capture-safe step: loss over every position with ignore_index (static shapes)."""

    def __init__(self, size: Size, log_loss: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.size, self.log_loss = size, log_loss
        dims = dict(vocab_size=size.vocab, d_model=size.d_model, num_heads=size.heads, d_ff=size.d_ff)
        layers = dict(tt_embeddings=False, rank=size.rank)
        self.model = MaskedLanguageModel(
            **dims, num_layers=size.layers, max_len=size.seq, dropout=0.0, layer_config=layers
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"]).float().reshape(-1, self.size.vocab)
        loss = F.cross_entropy(logits, batch["labels"].reshape(-1), ignore_index=IGNORE)
        if self.log_loss:
            self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        groups = comera_parameter_groups(self, lr_cores=2e-3, lr_gates=5e-3, lr_other=2e-3)
        return torch.optim.AdamW(groups, weight_decay=0.0)


def make_batches(size: Size, count: int, device: str | torch.device = "cpu", seed: int = 0) -> list[dict]:
    """``count`` synthetic masked-LM batches: random ids, 15 % of positions masked (id 1) and predicted."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(2, size.vocab, (size.batch, size.seq), generator=g)
        masked = torch.rand(size.batch, size.seq, generator=g) < 0.15
        inputs, labels = torch.where(masked, torch.ones_like(ids), ids), torch.where(masked, ids, IGNORE)
        batches.append({"input_ids": inputs.to(device), "labels": labels.to(device)})
    return batches


class ForcedTruncation(Callback):
    """At one step, kill the upper half of every bond of every TT layer and remove it physically."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            for _, layer in tt_layers(pl_module):
                after_truncation(trainer, layer.truncate_to_share_(0.5))


class StepTimer(Callback):
    """Synchronised wall time of every training step inside the Lightning loop, and its loss."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []
        self._t0 = 0.0

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = self._now()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(self._now() - self._t0)
        self.losses.append(float(outputs["loss"]))


def _fit(size: Size, steps: int, precision: str, device: str, graphs: Any | None) -> tuple[Any, Any, StepTimer]:
    module = BenchMLM(size)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    timer = StepTimer()
    callbacks = [RankAdaptation(gamma=0.01, truncate_every_n_steps=None), ForcedTruncation(max(2, steps // 2)), timer]
    callbacks += [graphs] if graphs else []
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    accelerator = "gpu" if device == "cuda" else "cpu"
    trainer = Trainer(
        max_steps=steps, accelerator=accelerator, devices=1, precision=precision, callbacks=callbacks, **quiet
    )
    trainer.fit(module, DataLoader(make_batches(size, 8), batch_size=None, shuffle=False))
    return module, start, timer


def _update_difference(a, b, start_b) -> tuple[float, float, str]:
    """(||theta_a - theta_b|| / ||theta_b - theta_b_start|| over all parameters, largest absolute parameter
    difference, its tensor). A global norm: parameters of zero true gradient (the attention key bias) get Adam
    updates of rounding noise that no two runs share. Tensors truncated on the way count in the numerator only."""
    named_b = dict(b.named_parameters())
    diff_sq, update_sq, worst_abs, worst_name = 0.0, 0.0, 0.0, ""
    for name, p in a.named_parameters():
        q = named_b[name]
        if p.shape != q.shape:
            return math.inf, math.inf, name
        diff = p.detach().double() - q.detach().double()
        diff_sq += float(diff.pow(2).sum())
        if float(diff.abs().max()) > worst_abs:
            worst_abs, worst_name = float(diff.abs().max()), name
        if start_b[name].shape == q.shape:
            update_sq += float((q.detach().double() - start_b[name].double()).pow(2).sum())
    return math.sqrt(diff_sq) / max(math.sqrt(update_sq), 1e-30), worst_abs, worst_name


def compare_training(size: Size, steps: int, precision: str, device: str, backend: str = "cuda") -> dict:
    """Train eagerly and with CudaGraphs from the same seed; return differences, counters and loop step times."""
    graphs = CudaGraphs(backend=backend, warmup_steps=3)
    captured, _, timer_c = _fit(size, steps, precision, device, graphs)
    eager, start_e, timer_e = _fit(size, steps, precision, device, None)
    update_rel, max_abs, worst = _update_difference(captured, eager, start_e)
    losses_c, losses_e = timer_c.losses, timer_e.losses
    loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses_c, losses_e, strict=True))
    tol, update_tol = TOLERANCE[precision], UPDATE_TOLERANCE[precision]
    skip = graphs.warmup_steps + 1  # loop times of replayed steps only (not warm-up or capture)
    loop_c, loop_e = (
        statistics.median(t.times[skip:]) if len(t.times) > skip else math.nan for t in (timer_c, timer_e)
    )
    counters = {k: getattr(graphs, k) for k in ("captures", "step_captures", "replays", "eager_steps")}
    return {
        **{"size": size.name, "precision": precision, "batch": size.batch, "steps": steps, "backend": backend},
        **{"identical": bool(update_rel <= update_tol and loss_rel <= tol), "update_rel_diff": update_rel},
        **{"loss_rel_diff": loss_rel, "max_abs_param_diff": max_abs, "max_abs_param_diff_tensor": worst},
        "tolerance": {"update_rel": update_tol, "loss_rel": tol},
        "losses": {"graphs": losses_c, "eager": losses_e},
        "graphs": {**counters, "invalidations": len(graphs.invalidations)},
        "loop_step_s": {"graphs": loop_c, "eager": loop_e, "times_graphs": timer_c.times, "times_eager": timer_e.times},
    }


def time_steps(size: Size, precision: str, batch: int, **timing) -> dict:
    """Bare step time (no Lightning loop) at ``batch`` sequences, eager vs captured, interleaved (``timing``:
    :func:`harness.interleave`'s keywords), and the peak CUDA memory of each."""
    batches = make_batches(replace(size, batch=batch), 8, "cuda", seed=1)
    bf16 = precision == "bf16-mixed"
    eager_module = BenchMLM(size, log_loss=False).cuda()
    graph_module = copy.deepcopy(eager_module)
    eager_opt, graph_opt = eager_module.configure_optimizers(), graph_module.configure_optimizers()
    graphs = CudaGraphs(backend="cuda", warmup_steps=3)
    graphs.attach(graph_module, graph_opt, "cuda")
    eager_batches, graph_batches = itertools.cycle(batches), itertools.cycle(batches)

    def eager_step() -> None:
        eager_opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = eager_module.training_step(next(eager_batches), 0)
        loss.backward()
        eager_opt.step()

    def graph_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            graph_module.training_step(next(graph_batches), 0)
        graph_opt.step()

    try:
        for _ in range(graphs.warmup_steps + 2):  # warm up and capture before timing
            graph_step()
            eager_step()
        torch.cuda.synchronize()
        memory = {}
        for name, step in (("eager", eager_step), ("graphs", graph_step)):
            torch.cuda.reset_peak_memory_stats()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            # a replay allocates nothing: the graphs' step uses its pool's idle blocks besides the live tensors
            memory[name] = torch.cuda.max_memory_allocated() + (graphs.pool_idle_bytes() if name == "graphs" else 0)
        timing = harness.interleave({"eager": eager_step, "graphs": graph_step}, min_sample_s=0.2, **timing)
        assert graphs.captures == 1 and graphs.replays > 0, "the captured step never replayed"
    finally:
        graphs.detach()
    return {
        **{"size": size.name, "precision": precision, "batch": batch, "speedup": timing.ratio("eager", "graphs")},
        "paired_speedups": timing.paired_ratios("eager", "graphs"),
        **{"timing": timing.summary(), "noise": timing.noise_cell(), "peak_memory_bytes": memory},
    }


def report(identity: list[dict], timings: list[dict]) -> str:
    """Markdown: per precision, the identity check (with the Lightning loop's step ratio on a GPU), then per precision
    and batch the bare step's times, speed-up and peak memory (GPU only)."""
    rows = []
    for c in identity:
        tol, loop, graphs = c["tolerance"], c["loop_step_s"], c["graphs"]
        identical = "yes" if c["identical"] else f"NO (tol {tol['update_rel']:g} / {tol['loss_rel']:g})"
        timed = c["backend"] == "cuda" and loop["graphs"] > 0
        cells = [c["precision"], f"{c['update_rel_diff']:.1e} / {c['loss_rel_diff']:.1e}", identical]
        cells += [f"{graphs['captures']} / {graphs['invalidations']}"]
        rows.append([*cells, harness.times(loop["eager"] / loop["graphs"]) if timed else "-"])
    headers = "precision|update / loss rel diff|identical|captures / re-captures|in Lightning loop"
    tables = [harness.table(headers, rows)]
    rows = []
    for t in timings:
        median, paired, peak = t["timing"]["median_s"], t["paired_speedups"], t["peak_memory_bytes"]
        cells = [t["precision"], t["batch"], harness.ms(median["eager"]), harness.ms(median["graphs"])]
        cells += [harness.times(t["speedup"]), f"{min(paired):.2f}-{max(paired):.2f}"]
        rows.append([*cells, f"{harness.mib(peak['eager'])} / {harness.mib(peak['graphs'])}", t["noise"]])
    if rows:
        headers = "precision|batch|eager step|graphed step|speed-up|paired range|peak mem eager / graphs|clean rounds"
        tables.append(harness.table(headers, rows))
    return "\n\n".join(tables)


def main(argv: list[str] | None = None) -> int:
    """Identity check (and, on a GPU, step timing) per size and precision; exit 1 when a run is not identical."""
    parser = harness.bench_parser(__doc__.split("\n\n")[0], repeats=(5, 5))
    add = parser.add_argument
    add("--steps", type=int, default=harness.Quick(20, 40), help="training steps of the identity check (40, quick 20)")
    add("--precision", nargs="+", default=list(TOLERANCE), choices=list(TOLERANCE))
    add("--backend", choices=["cuda", "replay"], default="cuda", help="replay: the identity check on the CPU")
    args = harness.parse(parser, argv)
    if args.steps < 4:
        parser.error("--steps must be >= 4 (warm-up, capture, truncation and re-capture need room)")
    on_gpu = args.backend == "cuda"
    json_path = args.out_dir / "cuda_graphs.json"
    if on_gpu and not torch.cuda.is_available():
        reason = "no CUDA device: torch.cuda.is_available() is False on this machine"
        print("no CUDA device: skipped (torch.cuda.is_available() is False on this machine)")
        harness.write_json(json_path, {"skipped": True, "machine": harness.machine_info(), "reason": reason})
        return 0
    size = QUICKSTART if on_gpu or not args.quick else TINY
    identity, timings = [], []
    for precision in args.precision:
        identity.append(compare_training(size, args.steps, precision, "cuda" if on_gpu else "cpu", args.backend))
        for batch in sorted({1, size.batch}) if on_gpu else []:
            timings.append(time_steps(size, precision, batch, **harness.timing_options(args)))
    print(f"CUDA graphs vs eager ({args.backend} backend, {args.steps} steps per identity run)\n")
    print(report(identity, timings))
    settings = {"steps": args.steps, "precision": args.precision, "backend": args.backend, "repeats": args.repeats}
    settings.update(size=asdict(size), tolerance=TOLERANCE)
    payload = {"skipped": False, "machine": harness.machine_info(), "settings": settings, "identity": identity}
    harness.emit(json_path, {**payload, "timing": timings})
    return 0 if all(check["identical"] for check in identity) else 1


if __name__ == "__main__":
    raise SystemExit(main())
