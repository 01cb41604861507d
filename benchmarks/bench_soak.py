"""Soak: does a long CoMERA training process keep growing in memory? RSS, Python heap and open files over a run.

A small masked LM (the quickstart architecture at d_model 32, random token batches held in memory, so only
training, callbacks and logging allocate) trains ``--steps`` optimiser steps with RankAdaptation, RankMonitor
and ContractionPlanner, in one fresh process per mode:

* ``off``: no logger;
* ``mlflow``: ResilientMLFlowLogger on a sqlite store, Lightning logging every 25 steps and RankMonitor every 50
  (the shipped configs' rates);
* ``mlflow-every-step``: the same, logging every step;
* ``truncate+ckpt``: no logger, the late stage from step 500 with a truncation check every 100 steps, and a
  checkpoint every 1,000 steps.

Every ``--sample-every`` steps a callback records the resident set (``/proc/self/statm``), the Python objects'
memory blocks (``sys.getallocatedblocks``) and the open file descriptors; ``--trace-python`` adds the traced
Python heap and its top growing lines (``tracemalloc``, which makes each step about twice as slow). The modes run
``--parallel`` at a time (one thread each). The growth per 10k
steps is the least-squares slope of RSS after the warm-up (``--warmup``, default 2,000 steps), against the
target of 10 MB per 10k steps.

    python -m benchmarks.bench_soak                       # 20,000 steps per mode (about 20 minutes on 2 cores)
    python -m benchmarks.bench_soak --quick               # the plumbing in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, Dataset

from benchmarks import harness
from comera_lightning.callbacks import ContractionPlanner, RankAdaptation, RankMonitor
from comera_lightning.lit import MaskedLM
from comera_lightning.training import ResilientMLFlowLogger

MODES = ("off", "mlflow", "mlflow-every-step", "truncate+ckpt")
TARGET_MB_PER_10K = 10.0
VOCAB, SEQ, BATCH = 512, 32, 16


class RandomMLMBatches(Dataset):
    """A fixed set of random masked-LM rows (15 % of the positions are targets)."""

    def __init__(self, rows: int = 512, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, VOCAB, (rows, SEQ), generator=gen)
        self.targets = torch.rand(rows, SEQ, generator=gen) < 0.15

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = torch.where(self.targets[i], self.ids[i], torch.full_like(self.ids[i], -100))
        return {
            "input_ids": self.ids[i].masked_fill(self.targets[i], 4),
            "labels": labels,
            "attention_mask": torch.ones(SEQ, dtype=torch.long),
        }


class MemorySampler(Callback):
    """Every ``every`` optimiser steps: RSS, traced Python heap, open descriptors; the top growing sites at the end."""

    def __init__(self, every: int, trace_python: bool = False) -> None:
        self.every, self.trace_python = every, trace_python
        self.samples: list[dict] = []
        self._first_snapshot = None

    def _sample(self, step: int) -> None:
        sample = {
            "step": step,
            "rss_bytes": harness.resident_bytes(),
            "python_blocks": sys.getallocatedblocks(),
            "open_fds": len(os.listdir("/proc/self/fd")),
        }
        if self.trace_python:
            sample["python_heap_bytes"] = tracemalloc.get_traced_memory()[0]
        self.samples.append(sample)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.trace_python:
            tracemalloc.start(1)
        self._sample(0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every == 0 and step != self.samples[-1]["step"]:
            self._sample(step)
            if self.trace_python and self._first_snapshot is None and step >= 2 * self.every:
                self._first_snapshot = tracemalloc.take_snapshot()

    def top_growth(self, limit: int = 8) -> list[dict]:
        if self._first_snapshot is None:
            return []
        stats = tracemalloc.take_snapshot().compare_to(self._first_snapshot, "lineno")
        return [
            {"bytes": s.size_diff, "count": s.count_diff, "where": s.traceback.format()[-1:]} for s in stats[:limit]
        ]


def run_mode(mode: str, steps: int, every: int, workdir: Path, trace_python: bool = False) -> dict:
    """One mode, in this process: train and sample."""
    torch.manual_seed(0)
    task = MaskedLM(
        vocab_size=VOCAB,
        d_model=32,
        num_heads=2,
        d_ff=128,
        num_layers=2,
        max_len=SEQ,
        dropout=0.0,
        layer_config=dict(rank=8, embedding_rank=8, min_features=16),
    )
    sampler = MemorySampler(every, trace_python)
    truncating = mode == "truncate+ckpt"
    callbacks = [
        RankAdaptation(
            gamma=0.01,
            late_start_step=500 if truncating else None,
            target_compression=5.0,
            truncate_every_n_steps=100 if truncating else None,
        ),
        RankMonitor(log_every_n_steps=1 if mode == "mlflow-every-step" else 50, save_artifacts=False),
        ContractionPlanner(verbose=False),
        sampler,
    ]
    logger = False
    if mode.startswith("mlflow"):
        logger = ResilientMLFlowLogger(
            experiment_name="soak", tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}", run_name=mode
        )
    if truncating:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=workdir / "ckpt", every_n_train_steps=1000, save_top_k=-1))
    trainer = Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=logger,
        default_root_dir=workdir,
        log_every_n_steps=1 if mode == "mlflow-every-step" else 25,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=truncating,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    loader = DataLoader(RandomMLMBatches(), batch_size=BATCH, shuffle=True, drop_last=True)
    trainer.fit(task, loader)
    return {"mode": mode, "samples": sampler.samples, "top_growth": sampler.top_growth()}


def growth_per_10k(samples: list[dict], key: str, warmup: int) -> float | None:
    """Least-squares slope of ``key`` against the step after ``warmup``, in bytes per 10,000 steps."""
    per_step = harness.slope([(s["step"], s[key]) for s in samples if s["step"] >= warmup])
    return None if per_step is None else 1e4 * per_step


def main(argv: list[str] | None = None) -> int:
    """Run, print the tables, write JSON/MD/PNG; returns 0 (run.py's contract)."""
    parser = harness.bench_parser(__doc__, threads=1)
    parser.add_argument(
        "--steps",
        type=int,
        default=harness.Quick(300, 20000),
        help="optimiser steps per mode (default 20000, quick 300)",
    )
    parser.add_argument(
        "--sample-every", type=int, default=harness.Quick(50, 1000), help="steps between samples (1000, quick 50)"
    )
    parser.add_argument(
        "--warmup", type=int, default=harness.Quick(100, 2000), help="steps left out of the slope (2000, quick 100)"
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--parallel", type=int, default=2, help="modes running at once, one thread each (default 2)")
    parser.add_argument("--trace-python", action="store_true", help="tracemalloc's heap and top growing lines")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = harness.parse(parser, argv)
    steps, every, warmup = args.steps, args.sample_every, args.warmup
    if min(steps, every) < 1 or warmup < 0 or warmup >= steps:
        parser.error(f"need steps >= 1, sample-every >= 1 and 0 <= warmup < steps; got {steps}, {every}, {warmup}")
    if args.child:  # one mode in a fresh process
        with tempfile.TemporaryDirectory() as folder:
            result = run_mode(args.child, steps, every, Path(folder), args.trace_python)
        args.child_out.write_text(json.dumps(result))
        return 0

    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        pending, running = list(args.modes), {}
        while pending or running:
            while pending and len(running) < args.parallel:
                mode = pending.pop(0)
                out = Path(folder) / f"{mode}.json"
                command = harness.module_command(
                    __spec__.name,
                    "--child",
                    mode,
                    "--child-out",
                    str(out),
                    "--steps",
                    str(steps),
                    "--sample-every",
                    str(every),
                    "--warmup",
                    str(warmup),
                    "--threads",
                    "1",
                    *(["--trace-python"] if args.trace_python else []),
                )
                running[mode] = (subprocess.Popen(command, env=harness.child_env()), out)
            for mode, (process, out) in list(running.items()):
                if process.poll() is not None:
                    del running[mode]
                    if process.returncode:
                        raise SystemExit(f"bench_soak: mode {mode} failed (exit {process.returncode})")
                    results[mode] = json.loads(out.read_text())
            time.sleep(0.5)
    keys = ("rss_bytes", "python_blocks", "open_fds", *(("python_heap_bytes",) if args.trace_python else ()))
    for mode in args.modes:
        results[mode]["growth_per_10k"] = {key: growth_per_10k(results[mode]["samples"], key, warmup) for key in keys}
    rows = []
    for mode, r in results.items():
        g = r["growth_per_10k"]
        rss = g["rss_bytes"]
        rows.append(
            [
                mode,
                harness.mib(r["samples"][0]["rss_bytes"]),
                harness.mib(r["samples"][-1]["rss_bytes"]),
                "-" if rss is None else f"{rss / 1e6:+.2f}",
                "-" if g["python_blocks"] is None else f"{g['python_blocks']:+,.0f}",
                "-" if g["open_fds"] is None else f"{g['open_fds']:+.1f}",
                "-" if rss is None else ("met" if rss / 1e6 < TARGET_MB_PER_10K else "MISSED"),
            ]
        )
    markdown = f"Soak, {steps} steps per mode, samples every {every}, slopes after step {warmup}:\n\n" + harness.table(
        [
            "mode",
            "RSS start MiB",
            "RSS end MiB",
            "RSS MB / 10k steps",
            "Python blocks / 10k steps",
            "open files / 10k steps",
            f"< {TARGET_MB_PER_10K:.0f} MB / 10k",
        ],
        rows,
    )
    print(markdown)
    fig, axes = harness.new_figure(ncols=2, width=5.5)
    for mode, r in results.items():
        steps_axis = [s["step"] for s in r["samples"]]
        axes[0].plot(steps_axis, [s["rss_bytes"] / 2**20 for s in r["samples"]], label=mode)
        axes[1].plot(steps_axis, [s["python_blocks"] / 1e3 for s in r["samples"]], label=mode)
    for ax, what in zip(axes, ("resident set (MiB)", "Python memory blocks (thousands)"), strict=True):
        ax.set_xlabel("optimiser step")
        ax.set_ylabel(what)
        ax.axvline(warmup, color="grey", linestyle=":")
        ax.legend()
    payload = {
        "machine": harness.machine_info(),
        "settings": harness.settings(args),
        "steps": steps,
        "target_mb_per_10k": TARGET_MB_PER_10K,
        "results": results,
    }
    harness.emit(Path(args.out_dir) / f"soak{'_quick' if args.quick else ''}.json", payload, fig=fig, markdown=markdown)
    return 0


if __name__ == "__main__":
    main()
