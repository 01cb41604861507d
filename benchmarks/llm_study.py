"""Decoder pre-training at CPU scale: dense + AdamW vs dense + GaLore vs CoMERA on ``configs/llm_cpu.yaml``.

What is compared. The LLaMA-style decoder of ``configs/llm_cpu.yaml`` (``CausalLM`` / ``DecoderLM``) learns
next-token prediction on the Python standard library (``CodeLMDataModule``), three ways, from the same seed,
on the same batches in the same order (the sampler depends only on the data seed):

* ``dense``: every linear and the embedding plain ``nn`` layers, AdamW over the task's groups (the config's
  ``lr_other`` for every parameter), the config's warmup;
* ``galore``: the same dense model, ``galore_torch.GaLoreAdamW`` with the decoder blocks' 2-D linear weights in a
  GaLore group (rank ``d_model / 4`` as the GaLore paper's LLaMA runs, update_proj_gap 200, scale 0.25) and
  every other parameter in a plain group, the same learning rate and warmup;
* ``comera``: TT linears and a TT embedding, ``RankAdaptation`` (the config's settings, late stage from the
  config's share of the run) and ``ContractionPlanner``.

Protocols: ``steps`` (the same optimiser steps, so the same tokens) and ``time`` (the same training
wall-clock; the late stage starts at the same share of the budget). The training clock and the recorded
validation curve are those of ``quality_study.py`` (its ``StudyRecorder``: validation passes off the clock,
contention measured from ``/proc/stat``).

Per run: validation loss and perplexity over the run, parameters (trainable, active, dense-equivalent,
compression), median step time, steps done. Separately, the training step of the three is timed interleaved
in this process (``harness.interleave``: forward, loss, backward, optimiser step on one real batch; CoMERA
with RankAdaptation's per-step work, GaLore at steady state with its projection refresh left out, as in
``bench_training_step.py``) and its peak memory measured (``harness.peak_memory``, GaLore's projectors
included), at the config's width and batch, at batch 1, and at the widths of ``--widths`` (default
d_model 1024: heads d/64, ffn 8/3 d rounded to 32, same depth and sequence), where TT factors pay.

Output: a markdown table on stdout (also ``llm_study.md``), ``llm_study.json`` with every number and curve,
``llm_study.png`` (validation perplexity vs steps and vs training seconds), in ``--out-dir``.

    python benchmarks/llm_study.py                          # the config's 1500 steps, 3 methods x 2 protocols
    python benchmarks/llm_study.py --quick                  # smoke run: tiny model, a few steps, no widths
    python benchmarks/llm_study.py --steps 600 --budget-s 120 --threads 1 --wait-quiet 60

GaLore needs ``pip install -e .[galore]``; without it the method is reported as skipped.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from bench_training_step import GALORE_MISSING, RankAdaptationWork, _galore_states, _import_galore  # noqa: E402
from quality_study import (  # noqa: E402
    _quiet_lightning, _ranks, _recorder_class, _size, _timed_rank_adaptation, with_layer_options,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "llm_cpu.yaml"
DEFAULT_CACHE = REPO / ".cache" / "comera"
METHODS = ("dense", "galore", "comera")
PROTOCOLS = ("steps", "time")
GALORE_GAP, GALORE_SCALE = 200, 0.25


@dataclass
class LLMSpec:
    """The study's model, data, CoMERA schedule and run lengths (by default read from ``configs/llm_cpu.yaml``)."""

    task_kwargs: dict[str, Any]
    data_kwargs: dict[str, Any]
    rank_kwargs: dict[str, Any]
    steps: int
    budget_s: float
    val_every: int
    limit_val_batches: int | None
    late_fraction: float
    widths: list[int] = field(default_factory=lambda: [1024])
    seed: int = 0

    def check(self) -> None:
        """Refuse settings that cannot give a meaningful run."""
        if self.steps < 1 or self.val_every < 1:
            raise ValueError(f"steps and val_every must be >= 1, got {self.steps}, {self.val_every}")
        if not (math.isfinite(self.budget_s) and self.budget_s > 0):
            raise ValueError(f"budget_s must be a positive number of seconds, got {self.budget_s}")
        if not 0.0 <= self.late_fraction <= 1.0:
            raise ValueError(f"late_fraction must be in [0, 1], got {self.late_fraction}")


def spec_from_config(path: Path = CONFIG, quick: bool = False) -> LLMSpec:
    """The study of a CausalLM config: its model, data and RankAdaptation settings (``quick``: a tiny version)."""
    config = yaml.safe_load(Path(path).read_text())
    task = {k: v for k, v in config["model"]["init_args"].items() if not k.startswith("generate_")}
    data = dict(config["data"]["init_args"])
    rank = next(c["init_args"] for c in config["trainer"]["callbacks"] if c["class_path"].endswith("RankAdaptation"))
    trainer = config["trainer"]
    steps = int(trainer["max_steps"])
    late_fraction = rank.pop("late_start_step", int(0.4 * steps)) / steps
    spec = LLMSpec(task, data, rank, steps=steps, budget_s=180.0, val_every=int(trainer["val_check_interval"]),
                   limit_val_batches=trainer.get("limit_val_batches"), late_fraction=late_fraction)
    if quick:
        spec.task_kwargs.update(vocab_size=512, d_model=32, num_heads=2, d_ff=64, num_layers=1, max_len=32)
        spec.task_kwargs["optim"] = {**spec.task_kwargs.get("optim", {}), "warmup_steps": 2}
        spec.task_kwargs["layer_config"] = dict(rank=8, embedding_rank=8, min_features=16)
        spec.data_kwargs.update(vocab_size=512, seq_len=32, batch_size=8, max_files=30, max_sequences=400)
        spec.rank_kwargs.update(truncate_every_n_steps=3, target_compression=None, target_size_ratio=0.5)
        spec.steps, spec.budget_s, spec.val_every, spec.limit_val_batches, spec.widths = 6, 2.0, 3, 2, []
    return spec


def wide_task_kwargs(spec: LLMSpec, d_model: int) -> dict[str, Any]:
    """The config's decoder at another width: heads d/64, ffn 8/3 d rounded up to a multiple of 32."""
    return {**spec.task_kwargs, "d_model": d_model, "num_heads": max(1, d_model // 64),
            "d_ff": 32 * math.ceil(8 * d_model / 3 / 32)}


# ------------------------------------------------------------------------------------------------------
# building blocks


def build_datamodule(spec: LLMSpec, cache_dir: Path = DEFAULT_CACHE):
    """The study's datamodule, prepared and set up once (every run reads the very same tensors)."""
    from comera_lightning.data import CodeLMDataModule

    dm = CodeLMDataModule(**spec.data_kwargs, cache_dir=str(cache_dir), seed=spec.seed)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def galore_targets(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The decoder blocks' 2-D linear weights (attention and MLP projections): what GaLore projects."""
    return [m.weight for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]


def galore_optimizer(task, galore_rank: int):
    """``GaLoreAdamW`` over ``task``'s dense decoder at the task's ``lr_other`` (None when not installed)."""
    GaLoreAdamW, missing = _import_galore()
    if missing:
        return None
    targets = galore_targets(task.model)
    target_ids = {id(p) for p in targets}
    others = [p for p in task.parameters() if id(p) not in target_ids]
    settings = {"rank": galore_rank, "update_proj_gap": GALORE_GAP, "scale": GALORE_SCALE, "proj_type": "std"}
    return GaLoreAdamW([{"params": others}, {"params": targets, **settings}], lr=task.optim.lr_other,
                       weight_decay=task.optim.weight_decay, no_deprecation_warning=True)


def build_task(spec: LLMSpec, method: str, task_kwargs: dict[str, Any] | None = None):
    """The LightningModule of ``method``: the same decoder, TT (comera) or dense (dense, galore)."""
    from comera_lightning.lit import CausalLM
    from comera_lightning.lit.base import warmup_decay_factor

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {METHODS}")
    kwargs = dict(spec.task_kwargs if task_kwargs is None else task_kwargs)
    tt = method == "comera"
    torch.manual_seed(spec.seed)
    if method != "galore":
        return CausalLM(**with_layer_options(kwargs, tt_linears=tt, tt_embeddings=tt))

    class GaLoreCausalLM(CausalLM):
        """CausalLM whose optimiser is GaLoreAdamW, with the same warmup (the config's constant schedule)."""

        def configure_optimizers(self):
            optimizer = galore_optimizer(self, max(1, self.model.d_model // 4))
            if self.optim.warmup_steps == 0:
                return optimizer
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: warmup_decay_factor(step, self.optim.warmup_steps, 1, "constant"))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return GaLoreCausalLM(**with_layer_options(kwargs, tt_linears=False, tt_embeddings=False))


def run_one(spec: LLMSpec, method: str, protocol: str, dm, *, max_other_load: float = 0.15,
            wait_quiet_s: float = 0.0) -> dict[str, Any]:
    """Train one (method, protocol) run and return its measurements (see the module docstring)."""
    from lightning.pytorch import Trainer, seed_everything

    from comera_lightning.callbacks import ContractionPlanner, RankAdaptation

    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; use one of {PROTOCOLS}")
    seed_everything(spec.seed, verbose=False)
    task = build_task(spec, method)
    at_start = _size(task)
    budget = spec.budget_s if protocol == "time" else None
    recorder = _recorder_class()(budget, max_other_load)
    callbacks: list[Any] = [recorder]
    rank_cb = None
    if method == "comera":
        if protocol == "steps":
            rank_cb = RankAdaptation(**spec.rank_kwargs, late_start_step=int(round(spec.late_fraction * spec.steps)))
        else:
            rank_cb = _timed_rank_adaptation(recorder.train_seconds, spec.late_fraction * spec.budget_s,
                                             **spec.rank_kwargs)
        callbacks += [rank_cb, ContractionPlanner(verbose=False)]
    if wait_quiet_s > 0:
        harness.wait_until_quiet(max_other_load, time.perf_counter() + wait_quiet_s)
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="comera-llm-") as root, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer = Trainer(
            accelerator="cpu", devices=1, max_steps=1_000_000 if protocol == "time" else spec.steps,
            max_epochs=-1, val_check_interval=spec.val_every, check_val_every_n_epoch=None,
            limit_val_batches=spec.limit_val_batches, num_sanity_val_steps=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root, callbacks=callbacks,
        )
        trainer.fit(task, datamodule=dm)
        if not recorder.validations or recorder.validations[-1]["step"] != trainer.global_step:
            trainer.validate(task, datamodule=dm, verbose=False)
    steps_s = recorder.step_s
    steady = steps_s[1:] if len(steps_s) > 2 else steps_s
    result: dict[str, Any] = {
        "method": method, "protocol": protocol, "steps": int(trainer.global_step), "budget_s": budget,
        "tokens": int(trainer.global_step) * spec.data_kwargs["batch_size"] * spec.data_kwargs["seq_len"],
        "train_s": recorder.train_s_final, "stopped_by_budget": recorder.stopped_by_budget,
        "median_step_s": statistics.median(steady) if steady else None,
        "median_step_s_last_quarter": statistics.median(steps_s[-max(1, len(steps_s) // 4):]) if steps_s else None,
        "final": recorder.validations[-1], "validations": recorder.validations, "size_at_start": at_start,
        "size_final": _size(task), "ranks_final": _ranks(task), "first_batch_hash": recorder.first_batch_hash,
        "other_load": recorder.other_load,
        "contended": recorder.other_load is not None and recorder.other_load > max_other_load,
    }
    if rank_cb is not None:
        result["rank_adaptation"] = {**rank_cb.state_dict(), "metrics": rank_cb.comera_metrics()}
    return result


# ------------------------------------------------------------------------------------------------------
# step time and memory, interleaved in this process


def _step_candidates(spec: LLMSpec, task_kwargs: dict[str, Any], batch: dict[str, torch.Tensor]) -> dict:
    """name -> (model, optimizer, step, extra tensors) for the three methods on one batch; each primed once."""
    cands: dict[str, Any] = {}
    for method in METHODS:
        task = build_task(spec, method, task_kwargs)
        before = after = pre_step = None
        extra: Callable[[], list[torch.Tensor]] = list
        if method == "galore":
            optimizer = galore_optimizer(task, max(1, task.model.d_model // 4))
            if optimizer is None:
                cands[method] = GALORE_MISSING
                continue
            targets = galore_targets(task.model)

            def before(optimizer=optimizer, targets=targets) -> None:  # steady state: skip the SVD refresh
                for state in _galore_states(optimizer, targets):
                    if state["step"] % GALORE_GAP == 0:
                        state["step"] += 1

            def extra(optimizer=optimizer, targets=targets) -> list[torch.Tensor]:
                mats = []
                for state in _galore_states(optimizer, targets):
                    ortho = state["projector"].ortho_matrix
                    mats.extend(ortho if isinstance(ortho, list) else [ortho])
                return mats
        else:
            from comera_lightning.optim import comera_parameter_groups

            optimizer = torch.optim.AdamW(comera_parameter_groups(task, task.optim.lr_cores, task.optim.lr_gates,
                                                                       task.optim.lr_other))
            if method == "comera":  # RankAdaptation's per-step work, around optimizer.step()
                work = RankAdaptationWork(task, optimizer, spec.rank_kwargs.get("gamma", 0.01))
                pre_step, after = work.before_step, work.after_step

        def step(task=task, optimizer=optimizer, before=before, after=after, pre_step=pre_step) -> None:
            if before is not None:
                before()
            optimizer.zero_grad(set_to_none=True)
            loss = task._cross_entropy(*task._logits_and_labels(batch))
            loss.backward()
            if pre_step is not None:
                pre_step()
            optimizer.step()
            if after is not None:
                after()

        step()  # optimiser state (and GaLore's projectors) exist from here on
        cands[method] = (task, optimizer, step, extra)
    return cands


def measure_steps(spec: LLMSpec, task_kwargs: dict[str, Any], batch: dict[str, torch.Tensor], *, repeats: int,
                  max_other_load: float, wait_quiet_s: float, min_sample_s: float) -> dict[str, Any]:
    """Interleaved step times, peak memory and parameters of the three methods on ``batch``."""
    from comera_lightning.nn import size_report

    cands = _step_candidates(spec, task_kwargs, batch)
    live = {m: c for m, c in cands.items() if not isinstance(c, str)}
    timing = harness.interleave({m: c[2] for m, c in live.items()}, repeats=repeats, min_sample_s=min_sample_s,
                                max_other_load=max_other_load, wait_quiet_s=wait_quiet_s, seed=spec.seed)
    out: dict[str, Any] = {"batch": int(batch["input_ids"].shape[0]), "seq_len": int(batch["input_ids"].shape[1]),
                           "d_model": task_kwargs["d_model"], "timing": timing.summary(), "methods": {}}
    for method, cand in cands.items():
        if isinstance(cand, str):
            out["methods"][method] = {"skipped": cand}
            continue
        task, optimizer, step, extra = cand
        memory = harness.peak_memory(step, modules=[task], optimizers=[optimizer],
                                     tensors=[*extra(), *batch.values()])
        report = size_report(task)
        out["methods"][method] = {
            "skipped": None, "median_s": timing.median(method), "memory": memory,
            "params_trainable": sum(p.numel() for p in task.parameters() if p.requires_grad),
            "params_active": report.active_parameters, "compression_ratio": report.compression_ratio,
        }
    for method in live:
        if method != "dense":
            out["methods"][method]["dense_step_over_this"] = timing.ratio("dense", method)
            out["methods"][method]["dense_peak_over_this"] = (
                out["methods"]["dense"]["memory"]["total"] / max(1, out["methods"][method]["memory"]["total"]))
    if "galore" in live and "comera" in live:
        out["galore_over_comera"] = {
            "step": timing.ratio("galore", "comera"),
            "peak_memory": (out["methods"]["galore"]["memory"]["total"]
                            / max(1, out["methods"]["comera"]["memory"]["total"])),
        }
    return out


def _batch(dm, size: int) -> dict[str, torch.Tensor]:
    rows = dm.train_dataset.__getitems__(list(range(size)))
    return {"input_ids": rows["input_ids"].long(), "labels": rows["labels"].long()}


def synthetic_batch(vocab: int, batch: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ids for the width study (the step's cost does not depend on the ids)."""
    ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


# ------------------------------------------------------------------------------------------------------
# the study


def run_study(spec: LLMSpec, *, methods: tuple[str, ...] = METHODS, protocols: tuple[str, ...] = PROTOCOLS,
              cache_dir: Path = DEFAULT_CACHE, repeats: int = 5, max_other_load: float = 0.15,
              wait_quiet_s: float = 0.0, min_sample_s: float = 0.5, log: Callable[[str], None] = print) -> dict:
    """Step/memory measurements first (interleaved), then every (protocol, method) run, one after the other."""
    spec.check()
    t0 = time.perf_counter()
    dm = build_datamodule(spec, cache_dir)
    if "galore" in methods and _import_galore()[1]:
        log(f"galore skipped: {GALORE_MISSING}")
        methods = tuple(m for m in methods if m != "galore")
    steps: list[dict[str, Any]] = []
    timing_kw = dict(repeats=repeats, max_other_load=max_other_load, wait_quiet_s=wait_quiet_s,
                     min_sample_s=min_sample_s)
    for size in (spec.data_kwargs["batch_size"], 1):
        log(f"[step] config width, batch {size}")
        steps.append(measure_steps(spec, spec.task_kwargs, _batch(dm, size), **timing_kw))
    for width in spec.widths:
        kwargs = wide_task_kwargs(spec, width)
        for size in (spec.data_kwargs["batch_size"], 1):
            log(f"[step] d_model {width}, batch {size}")
            batch = synthetic_batch(kwargs["vocab_size"], size, spec.data_kwargs["seq_len"], spec.seed)
            steps.append(measure_steps(spec, kwargs, batch, **timing_kw))
    runs = []
    for protocol in protocols:
        for method in methods:
            log(f"[train] {method} / {protocol}")
            run = run_one(spec, method, protocol, dm, max_other_load=max_other_load, wait_quiet_s=wait_quiet_s)
            m = run["final"]["metrics"]
            log(f"    {run['steps']} steps, {run['train_s']:.1f} s, val/perplexity "
                f"{m.get('val/perplexity', float('nan')):.3f}, compression {run['final']['compression_ratio']:.2f}x"
                + (" CONTENDED" if run["contended"] else ""))
            runs.append(run)
    return {"machine": harness.machine_info(), "spec": asdict(spec), "methods": list(methods),
            "data": {"train_rows": len(dm.train_dataset), "val_rows": len(dm.val_dataset)},
            "step_measurements": steps, "runs": runs, "max_other_load": max_other_load,
            "total_s": time.perf_counter() - t0}


def markdown(result: dict[str, Any]) -> str:
    """Training runs (perplexity, parameters, time) and the interleaved step/memory table."""
    headers = ["method", "protocol", "steps", "tokens", "train s", "median step ms", "val perplexity",
               "val loss", "trainable params", "compression", "other load"]
    rows = []
    for r in result["runs"]:
        m = r["final"]["metrics"]
        rows.append([
            r["method"], r["protocol"] + (f" ({r['budget_s']:g} s)" if r["budget_s"] else ""), r["steps"],
            f"{r['tokens']:,}", f"{r['train_s']:.1f}", harness.ms(r["median_step_s"]) if r["median_step_s"] else "-",
            f"{m.get('val/perplexity', float('nan')):.3f}", f"{m.get('val/loss', float('nan')):.4f}",
            f"{r['final']['params_trainable']:,}", f"{r['final']['compression_ratio']:.2f}x",
            (f"{r['other_load']:.0%}" if r["other_load"] is not None else "n/a") + (" !" if r["contended"] else ""),
        ])
    config = Path(result.get("settings", {}).get("config", CONFIG)).name
    lines = [f"### Decoder pre-training ({config}): dense + AdamW vs dense + GaLore vs CoMERA", "",
             harness.table(headers, rows), "", "#### Training step, interleaved in one process", ""]
    step_rows = []
    for s in result["step_measurements"]:
        for method, v in s["methods"].items():
            if v.get("skipped"):
                step_rows.append([s["d_model"], s["batch"], method, "skipped", "-", "-", "-", "-"])
                continue
            step_rows.append([
                s["d_model"], s["batch"], method, harness.ms(v["median_s"]), harness.mib(v["memory"]["total"]),
                f"{v['params_trainable']:,}", harness.times(v["dense_step_over_this"]) if "dense_step_over_this" in v
                else "1.00x", harness.times(v["dense_peak_over_this"]) if "dense_peak_over_this" in v else "1.00x",
            ])
    lines.append(harness.table(["d_model", "batch", "method", "step ms", "peak MiB", "trainable params",
                                "dense step / this", "dense peak / this"], step_rows))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path:
    """Validation perplexity vs steps and vs training seconds, every run."""
    fig, axes = harness.new_figure(2, width=5.5, height=3.8)
    colours = {"dense": "tab:blue", "galore": "tab:green", "comera": "tab:red"}
    for r in result["runs"]:
        v = r["validations"]
        kw = dict(color=colours[r["method"]], linestyle="-" if r["protocol"] == "steps" else "--",
                  label=f"{r['method']} / {r['protocol']}", marker="o", markersize=3)
        ppl = [p["metrics"].get("val/perplexity", float("nan")) for p in v]
        axes[0].plot([p["step"] for p in v], ppl, **kw)
        axes[1].plot([p["train_s"] for p in v], ppl, **kw)
    axes[0].set_xlabel("optimiser steps")
    axes[1].set_xlabel("training wall-clock seconds (validation excluded)")
    for ax in axes:
        ax.set_ylabel("validation perplexity")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return harness.save_figure(fig, path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=CONFIG, help="a CausalLM config (default configs/llm_cpu.yaml)")
    p.add_argument("--quick", action="store_true", help="tiny model, 6 steps, 2 s budgets, no width study")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps of the same-steps protocol")
    p.add_argument("--budget-s", type=float, default=None, help="training seconds of the same-time protocol")
    p.add_argument("--val-every", type=int, default=None)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    p.add_argument("--widths", type=int, nargs="*", default=None, help="extra d_model widths for the step timing")
    p.add_argument("--repeats", type=int, default=5, help="clean interleaved rounds per step measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--max-other-load", type=float, default=0.15)
    p.add_argument("--wait-quiet", type=float, default=0.0)
    p.add_argument("--tag", default="", help="suffix of the output files")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the study, print its tables and write JSON, PNG and markdown into ``--out-dir``."""
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = spec_from_config(args.config, args.quick)
    spec = replace(spec, seed=args.seed, steps=args.steps or spec.steps, budget_s=args.budget_s or spec.budget_s,
                   val_every=args.val_every or spec.val_every,
                   widths=spec.widths if args.widths is None else list(args.widths))
    spec.check()
    _quiet_lightning()
    result = run_study(spec, methods=tuple(args.methods), protocols=tuple(args.protocols), cache_dir=args.cache_dir,
                       repeats=args.repeats, max_other_load=args.max_other_load, wait_quiet_s=args.wait_quiet,
                       min_sample_s=0.05 if args.quick else 0.5)
    result["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    stem = f"llm_study{args.tag}"
    json_path = harness.write_json(args.out_dir / f"{stem}.json", result)
    png_path = plot(result, args.out_dir / f"{stem}.png")
    text = markdown(result)
    (args.out_dir / f"{stem}.md").write_text(text + "\n")
    print("\n" + text + f"\n\nJSON: {json_path}\nPNG: {png_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
