"""Training step of the six-encoder transformer: dense + AdamW vs dense + GaLore vs CoMERA.

The model of ``configs/mnli_6enc.yaml`` trained three ways (dense+AdamW, dense+GaLore, CoMERA r30), one full step
each, timed interleaved at batch 1 and ``--batch``, with peak memory; a missed target (CoMERA's step 4x dense's) is
explained by a profile. benchmarks/README.md describes it.

    python -m benchmarks.bench_training_step --wait-quiet 60
    python -m benchmarks.bench_training_step --quick               # smoke run, about 1 min
    python -m benchmarks.bench_training_step --device cuda --precision bf16-mixed   # on a GPU: *_cuda_bf16.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks import harness
from benchmarks.harness import Shape, build_model, make_batch, paper_shape
from comera_lightning.models import SequenceClassifier
from comera_lightning.nn import size_report, tt_layers
from comera_lightning.optim import comera_parameter_groups
from comera_lightning.rank_adaptation import objectives

DENSE, GALORE, COMERA = "dense+AdamW", "dense+GaLore", "CoMERA r30"
GALORE_SETTINGS = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
GALORE_MISSING = "galore-torch is not installed: `pip install -e .[galore]` (galore-torch==1.0)"
TARGET_SPEEDUP_VS_DENSE = 4.0
TARGET_MEMORY_VS_GALORE = 9.0
DEVICES, PRECISIONS = ("cpu", "cuda"), ("32-true", "bf16-mixed")
Loss, Hook = Callable[[], Tensor], Callable[[], None]


@dataclass(frozen=True)
class Execution:
    """Where every candidate lives and its precision: ``bf16-mixed`` runs forward and loss under bfloat16 autocast
    with float32 parameters and state (as Lightning's), ``32-true`` plain float32."""

    device: str = "cpu"
    precision: str = "32-true"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")

    def autocast(self) -> AbstractContextManager:
        """The context of forward + loss."""
        bf16 = self.precision == "bf16-mixed"
        return torch.autocast(self.device, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    @property
    def stem(self) -> str:
        """Suffix of the output files: empty for float32 on the CPU, else e.g. ``_cuda_bf16``."""
        return ("" if self.device == "cpu" else f"_{self.device}") + ("_bf16" if self.precision == "bf16-mixed" else "")

    def describe(self) -> str:
        """For titles: e.g. ``float32 CPU, 2 threads`` or ``bf16-mixed (float32 weights) CUDA (NVIDIA H200)``."""
        precision = "float32" if self.precision == "32-true" else "bf16-mixed (float32 weights)"
        cuda = self.device == "cuda"
        where = f"CUDA ({torch.cuda.get_device_name()})" if cuda else f"CPU, {torch.get_num_threads()} threads"
        return f"{precision} {where}"


CPU_FP32 = Execution()


def trainable_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (TT cores and gates included)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------------------
# candidates: one training setup each


@dataclass
class Candidate:
    """One benchmarked training setup: ``step()`` runs one full training step and returns the loss."""

    name: str
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    step: Loss | None = None
    skipped: str | None = None
    info: dict = field(default_factory=dict)
    extra_tensors: Callable[[], list[Tensor]] = list  # tensors outside the optimiser state (projectors)

    @property
    def parameters(self) -> int | None:
        return None if self.model is None else trainable_parameters(self.model)

    def prime(self) -> Candidate:
        """One step, so that optimiser state exists before anything is measured."""
        self.info["first_loss"] = float(self.step())
        return self


def train_step(
    optimizer: torch.optim.Optimizer, loss: Loss, before_step: Hook | None = None, after_step: Hook | None = None
) -> Loss:
    """A training step: zero_grad, ``loss()``, backward, ``before_step``, ``optimizer.step()``, ``after_step``."""

    def step() -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        value = loss()
        value.backward()
        for hook in (before_step, optimizer.step, after_step):
            if hook is not None:
                hook()
        return value.detach()

    return step


class RankAdaptationWork:
    """What ``RankAdaptation`` does on every optimiser step of the early stage, through the same functions (truncation
    and the late stage are not per-step work)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, gamma: float = 0.01) -> None:
        self.layers = [layer for _, layer in tt_layers(model)]
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.weights = objectives.early_stage_weights(gamma)

    def before_step(self) -> None:
        """The rank penalty's gradient added to finite gate gradients."""
        gates, masks, slice_parameters = objectives.rank_gates(self.layers, self.params)
        if gates and objectives.all_finite(g.grad for g in gates):
            objectives.add_rank_objective_(self.params, gates, masks, self.weights, slice_parameters)

    def after_step(self) -> None:
        """The masks refreshed from finite gates."""
        if objectives.all_finite(g.detach() for layer in self.layers for g in layer.gates):
            objectives.refresh_masks_(self.layers)


def comera_candidate(
    name: str, model: nn.Module, optimizer: torch.optim.Optimizer, loss: Loss, gamma: float = 0.01
) -> Candidate:
    """A CoMERA step: ``optimizer`` plus RankAdaptation's per-step work; primed."""
    work = RankAdaptationWork(model, optimizer, gamma)
    cand = Candidate(name, model, optimizer, train_step(optimizer, loss, work.before_step, work.after_step)).prime()
    cand.info["ranks"] = {n: layer.ranks for n, layer in tt_layers(model)}
    return cand


def import_galore() -> tuple[type | None, str | None]:
    """(``GaLoreAdamW``, None), or (None, why not and how to install it)."""
    try:
        from galore_torch import GaLoreAdamW
    except ImportError as err:
        return None, f"{GALORE_MISSING}; import failed with: {err}"
    return GaLoreAdamW, None


def galore_optimizer(
    params: Iterable[nn.Parameter], targets: list[nn.Parameter], lr: float, weight_decay: float, settings: dict
) -> torch.optim.Optimizer | None:
    """``GaLoreAdamW`` with ``targets`` projected (``settings``) and the other ``params`` in a plain group
    (None when galore-torch is missing)."""
    cls, missing = import_galore()
    if missing:
        return None
    target_ids = {id(p) for p in targets}
    others = [p for p in params if id(p) not in target_ids]
    groups = [{"params": others}, {"params": targets, **settings}]
    return cls(groups, lr=lr, weight_decay=weight_decay, no_deprecation_warning=True)


def galore_candidate(
    name: str, model: nn.Module, targets: list[nn.Parameter], loss: Loss, lr: float, weight_decay: float, settings: dict
) -> Candidate:
    """A GaLore step at steady state (no projection refresh), ``info['refresh_step']`` one that refreshes every
    projection (SVD); primed. Skipped, with the install command, when galore-torch is missing."""
    optimizer = galore_optimizer(model.parameters(), targets, lr, weight_decay, settings)
    if optimizer is None:
        return Candidate(name, skipped=import_galore()[1])
    gap = settings["update_proj_gap"]

    def states() -> list[dict]:
        return [optimizer.state[p] for p in targets if optimizer.state.get(p)]

    plain = train_step(optimizer, loss)

    def steady() -> Tensor:
        # GaLore refreshes when its per-parameter counter is a multiple of the gap (before incrementing)
        for state in states():
            state["step"] += state["step"] % gap == 0
        return plain()

    def refresh() -> Tensor:
        for state in states():
            state["step"] = (state["step"] // gap + 1) * gap
        return plain()

    def projectors() -> list[Tensor]:
        mats = [state["projector"].ortho_matrix for state in states()]
        return [m for mat in mats for m in (mat if isinstance(mat, list) else [mat])]

    cand = Candidate(name, model, optimizer, steady, extra_tensors=projectors)
    cand.info["first_loss"] = float(plain())  # creates the projectors (SVD)
    mats = projectors()
    # galore-torch 1.0 keeps a slice of the SVD factor, so the whole factor's storage stays allocated
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in mats}
    cand.info.update(
        settings=dict(settings),
        galore_parameters=sum(p.numel() for p in targets),
        galore_tensors=len(targets),
        refresh_step=refresh,
        projector_bytes=sum(t.numel() * t.element_size() for t in mats),
        projector_storage_bytes=sum(storages.values()),
    )
    return cand


def classifier_loss(model: nn.Module, ids: Tensor, labels: Tensor, execution: Execution = CPU_FP32) -> Loss:
    """Cross-entropy of the classifier on one batch under ``execution.autocast()``."""

    def loss() -> Tensor:
        with execution.autocast():
            return F.cross_entropy(model(ids), labels)

    return loss


def dense_adamw(shape: Shape, ids: Tensor, labels: Tensor, seed: int = 0, execution: Execution = CPU_FP32) -> Candidate:
    """Dense model + ``torch.optim.AdamW``; primed."""
    model = build_model(shape, tt=False, seed=seed, device=execution.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr_other, weight_decay=0.0)
    step = train_step(optimizer, classifier_loss(model, ids, labels, execution))
    return Candidate(DENSE, model, optimizer, step).prime()


def galore_targets(model: SequenceClassifier) -> list[nn.Parameter]:
    """The encoder's 2-D linear weights (attention projections, fc1, fc2): what GaLore's README projects."""
    return [m.weight for m in model.encoder.layers.modules() if isinstance(m, nn.Linear)]


def dense_galore(
    shape: Shape,
    ids: Tensor,
    labels: Tensor,
    seed: int = 0,
    settings: dict | None = None,
    execution: Execution = CPU_FP32,
) -> Candidate:
    """Dense model + ``GaLoreAdamW`` (:func:`galore_candidate`)."""
    model = build_model(shape, tt=False, seed=seed, device=execution.device)
    loss = classifier_loss(model, ids, labels, execution)
    settings = GALORE_SETTINGS if settings is None else settings
    return galore_candidate(GALORE, model, galore_targets(model), loss, shape.lr_other, 0.0, settings)


def comera(
    shape: Shape,
    ids: Tensor,
    labels: Tensor,
    seed: int = 0,
    model: nn.Module | None = None,
    name: str = COMERA,
    execution: Execution = CPU_FP32,
) -> Candidate:
    """CoMERA model (``model``, already on the device, or a new one) + AdamW over ``comera_parameter_groups`` +
    RankAdaptation's per-step work; primed."""
    model = build_model(shape, tt=True, seed=seed, device=execution.device) if model is None else model
    groups = comera_parameter_groups(model, shape.lr_cores, shape.lr_gates, shape.lr_other, weight_decay=0.0)
    return comera_candidate(name, model, torch.optim.AdamW(groups), classifier_loss(model, ids, labels, execution))


# ------------------------------------------------------------------------------------------------------
# measuring


def measure_memory(cand: Candidate, inputs: Iterable[Tensor]) -> dict:
    """``harness.peak_memory`` of one step of ``cand`` (inputs and GaLore's projectors tracked too)."""
    return harness.peak_memory(
        cand.step, modules=[cand.model], optimizers=[cand.optimizer], tensors=[*cand.extra_tensors(), *inputs]
    )


def measure(cands: list[Candidate], inputs: Iterable[Tensor], seed: int = 0, **timing) -> tuple[harness.Timing, dict]:
    """``(timing, entries by name)``: the steps timed interleaved (``timing``: :func:`harness.interleave`'s keywords),
    then per candidate its parameters, median and fastest step, peak memory, kernel work and ``info`` (a skipped one:
    why). On CUDA also the allocator's peak over a step (every candidate resident), ``cuda_peak_bytes``, and what the
    step itself added, ``cuda_step_peak_bytes``."""
    inputs = list(inputs)
    live = [c for c in cands if c.skipped is None]
    timing = harness.interleave({c.name: c.step for c in live}, seed=seed, **timing)
    entries = {c.name: {"skipped": c.skipped} for c in cands}
    for c in live:
        memory, entry = measure_memory(c, inputs), entries[c.name]
        entry.update(parameters=c.parameters, median_s=timing.median(c.name), min_s=timing.minimum(c.name))
        entry.update(memory=memory, kernel=harness.kernel_work(c.step))
        entry.update({k: v for k, v in c.info.items() if k != "refresh_step"})
        if next(c.model.parameters()).is_cuda:
            peak = memory["cuda_allocator_peak_bytes"]
            entry.update(cuda_peak_bytes=peak, cuda_step_peak_bytes=peak - memory["cuda_allocated_before_bytes"])
    return timing, entries


def time_galore_refresh(cand: Candidate, samples: int) -> dict:
    """Extra time of GaLore's projection-refresh step: each refresh step minus a steady step right before."""
    sync = torch.cuda.synchronize if next(cand.model.parameters()).is_cuda else lambda: None
    steady, refresh = [], []
    for _ in range(samples):
        sync()
        t0 = time.perf_counter()
        cand.step()
        sync()
        t1 = time.perf_counter()
        cand.info["refresh_step"]()
        sync()
        steady.append(t1 - t0)
        refresh.append(time.perf_counter() - t1)
    extra = [max(r - s, 0.0) for r, s in zip(refresh, steady, strict=True)]
    return {"steady_s": steady, "refresh_s": refresh, "extra_s": extra, "extra_median_s": statistics.median(extra)}


def explain(comera_profile: dict, other_profile: dict, against: str = DENSE) -> str:
    """A "why" line from two ``harness.profile_ops``: CoMERA's top ops, and the op types it did not make 2x cheaper
    than ``against`` (their time alone caps the speedup); CUDA profiles add the GPU's own time."""
    top = ", ".join(f"{t['op']} {t['share']:.0%}" for t in comera_profile["top"][:4])
    c_ops, d_ops = comera_profile["ops_s"], other_profile["ops_s"]
    stuck = {k: v for k, v in c_ops.items() if v > 0.5 * d_ops.get(k, 0.0)}
    stuck_s = sum(stuck.values())
    ranked = sorted(stuck.items(), key=lambda kv: -kv[1])[:4]
    worst = ", ".join(f"{k} {v * 1e3:.0f} ms (vs {d_ops.get(k, 0.0) * 1e3:.0f})" for k, v in ranked)
    bound = other_profile["total_self_cpu_s"] / max(stuck_s, 1e-12)
    line = (
        f"CoMERA step's top ops: {top}. Op types CoMERA did not make >= 2x cheaper than {against} take "
        f"{stuck_s * 1e3:.0f} ms of its {comera_profile['total_self_cpu_s'] * 1e3:.0f} ms ({worst}); they alone "
        f"cap the speedup over {against} at {bound:.1f}x ({against} profiled step: "
        f"{other_profile['total_self_cpu_s'] * 1e3:.0f} ms)"
    )
    if "total_self_device_s" in comera_profile and "total_self_device_s" in other_profile:
        top = ", ".join(f"{op} {t * 1e3:.2f} ms" for op, t in list(comera_profile["device_ops_s"].items())[:4])
        line += (
            f". On the GPU (self device time per step): CoMERA {comera_profile['total_self_device_s'] * 1e3:.2f} ms, "
            f"{against} {other_profile['total_self_device_s'] * 1e3:.2f} ms; CoMERA's costliest ops there: {top} "
            f"(the CPU times above are the host's dispatch and launches)"
        )
    return line


def run_batch(
    shape: Shape, batch: int, refresh_samples: int, seed: int = 0, execution: Execution = CPU_FP32, **timing
) -> tuple[dict, dict]:
    """``(results, candidates)``: all three candidates at one batch size (``timing``: :func:`measure`'s), GaLore's
    refresh step and the TT layers' sizes."""
    ids, labels = make_batch(shape, batch, seed, execution.device)
    t0 = time.perf_counter()
    cands = [
        dense_adamw(shape, ids, labels, seed, execution=execution),
        dense_galore(shape, ids, labels, seed, execution=execution),
        comera(shape, ids, labels, seed, execution=execution),
    ]
    print(f"  built and primed {len(cands)} candidates in {time.perf_counter() - t0:.0f} s")
    timing, entries = measure(cands, (ids, labels), seed=seed, **timing)
    print(f"  timed ({timing.noise_cell()} clean rounds) and measured at {time.perf_counter() - t0:.0f} s")
    live = [c for c in cands if c.skipped is None]
    for c in live:
        if c.name == GALORE and refresh_samples > 0:
            entries[c.name]["refresh"] = time_galore_refresh(c, refresh_samples)
        if tt_layers(c.model):
            entries[c.name]["size_report"] = size_report(c.model).as_dict()
    paired = {f"{a.name}/{b.name}": timing.paired_ratios(a.name, b.name) for a in live for b in live if a is not b}
    noise = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in paired.items()}
    results = {"batch": batch, "tokens_per_step": batch * shape.seq_len, "timing": timing.summary()}
    return {**results, "candidates": entries, "paired_ratio_noise": noise}, {c.name: c for c in cands}


def finish_batch(res: dict, svd_extra_s: float | None) -> None:
    """Amortised GaLore step, tokens/s and the ratios of one batch's results (in place)."""
    cands = res["candidates"]
    g = cands[GALORE]
    if not g["skipped"]:
        extra = g.get("refresh", {}).get("extra_median_s", svd_extra_s)
        g["refresh_extra_s"] = extra
        if "refresh" in g:
            g["refresh_extra_source"] = "measured at this batch"
        elif extra is not None:
            g["refresh_extra_source"] = "measured at batch 1 (the SVDs do not depend on the batch)"
        else:
            g["refresh_extra_source"] = "not measured (--refresh-samples 0): amortised = steady"
        g["amortised_s"] = g["median_s"] + (extra or 0.0) / g["settings"]["update_proj_gap"]
    step = {n: None if e["skipped"] else e.get("amortised_s", e["median_s"]) for n, e in cands.items()}
    mem = {n: None if e["skipped"] else e["memory"]["total"] for n, e in cands.items()}
    for name, entry in cands.items():
        if not entry["skipped"]:
            entry["tokens_per_s"] = res["tokens_per_step"] / step[name]
    res["ratios"] = {
        "time dense/CoMERA": harness.ratio(step[DENSE], step[COMERA]),
        "memory dense/CoMERA": harness.ratio(mem[DENSE], mem[COMERA]),
        "time GaLore(amortised)/CoMERA": harness.ratio(step[GALORE], step[COMERA]),
        "memory GaLore/CoMERA": harness.ratio(mem[GALORE], mem[COMERA]),
    }


def verdicts(results: dict[int, dict], realistic: int) -> list[dict]:
    """The targets, judged on the measured ratios of the batches measured so far."""
    targets: list[tuple[str, int, str, Callable[[float], bool]]] = []  # (target, batch, ratio, met)
    if realistic in results:
        seq = results[realistic]["tokens_per_step"] // realistic
        what = f"CoMERA step >= {TARGET_SPEEDUP_VS_DENSE:g}x faster than dense (batch {realistic} x {seq})"
        targets.append((what, realistic, "time dense/CoMERA", lambda r: r >= TARGET_SPEEDUP_VS_DENSE))
    if 1 in results:
        what = f"CoMERA peak memory >= {TARGET_MEMORY_VS_GALORE:g}x below dense+GaLore (batch 1)"
        targets.append((what, 1, "memory GaLore/CoMERA", lambda r: r >= TARGET_MEMORY_VS_GALORE))
        what = "CoMERA step faster than dense+GaLore (batch 1, GaLore amortised)"
        targets.append((what, 1, "time GaLore(amortised)/CoMERA", lambda r: r > 1.0))
    measured = [(target, batch, results[batch]["ratios"][key], met) for target, batch, key, met in targets]
    return [{"target": t, "batch": b, "measured": m, "met": None if m is None else met(m)} for t, b, m, met in measured]


def galore_note(galore: dict) -> str:
    """What GaLore's projection refresh costs and its projectors hold (empty when it was skipped)."""
    if galore["skipped"]:
        return ""
    return (
        f"\n\ndense+GaLore: projection refresh (SVD) costs {harness.ms(galore.get('refresh_extra_s') or 0.0)} ms extra "
        f"once per {galore['settings']['update_proj_gap']} steps; its projectors hold "
        f"{harness.mib(galore['projector_storage_bytes'])} MiB of storage for {harness.mib(galore['projector_bytes'])} "
        f"MiB of matrices (galore-torch keeps slices of the SVD factors), counted under 'other'."
    )


CUDA_HEADER = "CUDA peak MiB (all resident; + this step)"
STEP_HEADERS = (
    "candidate|trainable params|step ms (median)|tokens/s|peak MiB|params|grads|opt state|opt-step work|activations"
    "|temporaries|other"
)


def _cuda_cell(entry: dict) -> str:
    """The CUDA allocator's peak over the step (every candidate resident), + what the step added."""
    return f"{harness.mib(entry['cuda_peak_bytes'])} (+{harness.mib(entry['cuda_step_peak_bytes'])})"


def _has_cuda(entries: Iterable[dict]) -> bool:
    return any("cuda_peak_bytes" in e for e in entries)


def _step_row(name: str, e: dict, cuda: bool) -> list:
    """One candidate's row of a batch's table."""
    if e["skipped"]:
        return [name, "-", "skipped: " + e["skipped"], *["-"] * (11 if cuda else 10)]
    m = e["memory"]
    step = harness.ms(e["median_s"]) + (f" (amortised {harness.ms(e['amortised_s'])})" if "amortised_s" in e else "")
    persistent = m.get("optimizer_state_persistent", m["optimizer_state"])
    memory = (m["total"], m["parameters"], m["gradients"], persistent, max(m["optimizer_state"] - persistent, 0))
    memory += (m["activations"], m["temporaries"], m["other"] + m["buffers"])
    kernel = f"{e['kernel']['minor_faults']:,} / {e['kernel']['system_s']:.2f} s"
    cells = [name, f"{e['parameters']:,}", step, f"{e['tokens_per_s']:,.0f}", *map(harness.mib, memory)]
    return [*cells, *([_cuda_cell(e)] if cuda else []), kernel]


def step_tables(results: dict[int, dict], checks: list[dict]) -> str:
    """Markdown: one table per batch (time, tokens/s, memory breakdown, on CUDA the allocator's peak), then ratios
    and verdicts."""
    parts = []
    for batch, res in results.items():
        cuda = _has_cuda(res["candidates"].values())
        headers = STEP_HEADERS + (f"|{CUDA_HEADER}" if cuda else "") + "|page faults / system time"
        parts.append(
            f"### batch {batch} x {res['tokens_per_step'] // batch} tokens "
            f"(rounds clean/total: {res['timing']['rounds_clean']}/{res['timing']['rounds_total']})\n\n"
            + harness.table(headers, [_step_row(n, e, cuda) for n, e in res["candidates"].items()])
            + galore_note(res["candidates"][GALORE])
        )
    ratio = lambda x: "skipped" if x is None else harness.times(x)  # noqa: E731
    keys = list(next(iter(results.values()))["ratios"])
    rows = [[k, *(ratio(r["ratios"][k]) for r in results.values())] for k in keys]
    parts.append(harness.table(["ratio", *(f"batch {b}" for b in results)], rows))
    verdict = {True: "met", False: "MISSED", None: "n/a (skipped)"}
    checked = [[c["target"], ratio(c["measured"]), verdict[c["met"]]] for c in checks]
    parts.append(harness.table("target|measured|verdict", checked))
    return "\n\n".join(parts)


def plot_step(results: dict[int, dict], shape: Shape, execution: Execution = CPU_FP32):
    """Bars: step time and peak memory per candidate, one bar per batch size (log scales)."""
    names = list(next(iter(results.values()))["candidates"])

    def draw(ax, label, value):
        series = {
            f"batch {b}": [0 if r["candidates"][n]["skipped"] else value(r["candidates"][n]) for n in names]
            for b, r in results.items()
        }
        harness.bars(ax, names, series, label)

    title = (
        f"{shape.num_layers}-encoder transformer (d_model {shape.d_model}, seq {shape.seq_len}, "
        f"vocab {shape.vocab_size}), {execution.describe()}"
    )
    fig, axes = harness.new_figure(2, 6.5, 4.2)
    draw(axes[0], "training step (ms, median; GaLore amortised)", lambda e: e.get("amortised_s", e["median_s"]) * 1e3)
    draw(axes[1], "peak memory (MiB, MemTracker)", lambda e: e["memory"]["total"] / 2**20)
    fig.suptitle(title)
    return fig


def run_batches(args: argparse.Namespace, shape: Shape, batches: list[int], execution: Execution = CPU_FP32) -> dict:
    """Every batch, profiles where a target is missed (or always); returns the JSON payload."""
    results: dict[int, dict] = {}
    svd_extra = None
    profiles: dict[str, dict] = {}
    for b in batches:
        print(f"batch {b}:", flush=True)
        # by default samples of >= 1 s and >= 40 s of clean rounds in all: single short steps varied by 30 %
        timing = dict(
            min_sample_s=0.01 if args.quick else 1.0, min_total_s=args.min_total_s, **harness.timing_options(args)
        )
        res, cands = run_batch(shape, b, args.refresh_samples if b == 1 else 0, execution=execution, **timing)
        finish_batch(res, svd_extra)
        svd_extra = res["candidates"][GALORE].get("refresh_extra_s", svd_extra)
        results[b] = res
        # the realistic batch is profiled when any target is missed, batch 1 when one of its own is
        missed = any(c["met"] is False and b in (batches[-1], c["batch"]) for c in verdicts(results, batches[-1]))
        if args.profile == "always" or (args.profile == "auto" and missed):
            # batch 1's targets compare CoMERA with GaLore, the realistic batch's with dense
            other = GALORE if b == 1 and b != batches[-1] and not cands[GALORE].skipped else DENSE
            print(f"  profiling the {COMERA} and {other} steps", flush=True)
            prof = {"comera": harness.profile_ops(cands[COMERA].step), "other": harness.profile_ops(cands[other].step)}
            why = explain(prof["comera"], prof["other"], other)
            profiles[str(b)] = {"batch": b, "against": other, **prof, "why": why}
        del cands
    checks = verdicts(results, batches[-1])
    print("\n" + step_tables(results, checks))
    for prof in profiles.values():
        print(f"\nwhy (profile at batch {prof['batch']}, vs {prof['against']}): {prof['why']}")
    return {"results": results, "verdicts": checks, "profiles": profiles}


# ------------------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    """The command line: the shared options and the step's own."""
    quick, positive = harness.Quick, harness.positive_int
    parser = harness.bench_parser(__doc__, repeats=(2, 3))
    add = parser.add_argument
    add("--min-total-s", type=float, default=quick(0.0, 40.0), help="clean timed seconds per candidate and batch (40)")
    add("--batch", type=positive, default=quick(4, 32), help="the realistic batch (32 sequences, quick 4)")
    add("--layers", type=positive, default=quick(1, None), help="encoder layers (default the config's 6)")
    add("--refresh-samples", type=int, default=quick(1, 2), help="GaLore refresh steps timed at batch 1 (0 skips)")
    profile = "profile CoMERA against dense (realistic batch) and GaLore (batch 1); auto: where a target is missed"
    add("--profile", choices=["auto", "always", "never"], default="auto", help=profile)
    add("--keep-freed-memory", action="store_true", help="glibc malloc keeps freed memory, as KeepFreedMemory does")
    add("--device", choices=DEVICES, default="cpu", help="where every candidate lives (default cpu)")
    add("--precision", choices=PRECISIONS, default="32-true", help="bf16-mixed: autocast as Lightning's bf16-mixed")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the step comparison, print the tables and verdicts, write JSON and the PNG; returns 0."""
    parser = build_parser()
    args = harness.parse(parser, argv)
    if args.refresh_samples < 0:
        parser.error(f"--refresh-samples must be >= 0, got {args.refresh_samples}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device cuda: torch.cuda.is_available() is False (no CUDA device, or torch {torch.__version__} "
            f"is a CPU-only build); run on a GPU machine with a CUDA build of torch, or use --device cpu"
        )
    execution = Execution(args.device, args.precision)
    paper, stem = paper_shape(), execution.stem
    if args.keep_freed_memory:
        harness.keep_freed_memory_for_run()
        stem += "_keep_freed_memory"
    settings = {**harness.settings(args), "threads": torch.get_num_threads(), "dtype": "float32"}
    settings["autocast_dtype"] = "bfloat16" if execution.precision == "bf16-mixed" else None
    settings["cuda_device"] = torch.cuda.get_device_name() if execution.device == "cuda" else None
    settings.update(float32_matmul_precision=torch.get_float32_matmul_precision(), argv=argv or sys.argv[1:])
    started = time.perf_counter()
    shape = replace(paper, num_layers=args.layers or paper.num_layers)
    batches = [1] if args.batch == 1 else [1, args.batch]
    where = f"{shape.num_layers} layers, d_model {shape.d_model}, seq {shape.seq_len}, batches {batches}"
    print(f"## training step: {where}, {args.repeats} rounds, {execution.describe()}", flush=True)
    payload = run_batches(args, shape, batches, execution)
    settings.update(shape=shape.__dict__, batches=batches, galore=GALORE_SETTINGS)
    harness.emit(
        args.out_dir / f"training_step{stem}.json",
        {"machine": harness.machine_info(), "settings": settings, **payload},
        fig=plot_step(payload["results"], shape, execution),
    )
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
