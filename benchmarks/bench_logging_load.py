"""Logging under load: per-step rank logging into a local sqlite MLflow store, memory and step-time overhead.

Trains the quickstart model (``configs/quickstart.yaml``'s architecture and callbacks; smaller batches) on
synthetic masked-LM batches in ONE Lightning fit with ``log_every_n_steps=1`` and ``RankMonitor(log_every_n_steps=1)``,
cut into blocks of 50 steps, each in one mode, interleaved: ``off`` (no logger, RankMonitor skipped: the baseline),
``resilient`` (``ResilientMLFlowLogger``: buffered, sent by a thread) and ``async`` (``MLFlowLogger(synchronous=
False)``). Reported against the ``off`` blocks beside them: step time, training-thread CPU, time in logger calls,
the sender thread's CPU, RSS growth, and the points stored (docs/results.md, "Logging under load").

    python benchmarks/bench_logging_load.py --steps 1500 --sync-steps 300 --threads 1
    python benchmarks/bench_logging_load.py --quick      # smoke run: a few blocks of every mode
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import harness
import torch
import yaml
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import MLFlowLogger
from torch.utils.data import DataLoader, IterableDataset

from comera_lightning.callbacks import ContractionPlanner, RankAdaptation, RankMonitor
from comera_lightning.lit.mlm import IGNORE, MaskedLM
from comera_lightning.nn import size_report
from comera_lightning.training.loggers import ResilientMLFlowLogger

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
MODES = ("off", "resilient", "async")
BLOCK, RSS_EVERY = 50, 25  # steps per interleaved block, steps between RSS samples


def rss_kb() -> int:
    """Resident set size of this process in KB."""
    return harness.resident_bytes() // 1024


class SyntheticMLM(IterableDataset):
    """Endless masked-LM batches: random token ids, every position masked with probability 0.15."""

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, pool: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.batches = []
        for _ in range(pool):
            ids = torch.randint(5, vocab_size, (batch_size, seq_len), generator=g)
            masked = torch.rand(batch_size, seq_len, generator=g) < 0.15
            masked[:, 0] = True
            self.batches.append(
                {
                    "input_ids": torch.where(masked, torch.full_like(ids, 4), ids),
                    "attention_mask": torch.ones_like(ids),
                    "labels": torch.where(masked, ids, torch.full_like(ids, IGNORE)),
                }
            )

    def __iter__(self):
        while True:
            yield from self.batches


def time_logger(logger, mode: str, timers: dict[str, dict]) -> None:
    """Wrap ``logger.log_metrics`` (and a ResilientMLFlowLogger's ``flush`` when run by its sender thread)."""
    log_metrics = logger.log_metrics

    def timed_log_metrics(*args, **kwargs):
        start = time.perf_counter()
        try:
            return log_metrics(*args, **kwargs)
        finally:
            timers["log_calls"][mode] += time.perf_counter() - start

    logger.log_metrics = timed_log_metrics
    if not isinstance(logger, ResilientMLFlowLogger):
        return
    flush, main = logger.flush, threading.main_thread()

    def timed_flush():
        if threading.current_thread() is main:
            return flush()
        cpu = time.thread_time()
        try:
            return flush()
        finally:
            timers["sender_cpu"][mode] += time.thread_time() - cpu

    logger.flush = timed_flush  # the logger's sender looks ``flush`` up on every call, so it runs this


class GatedRankMonitor(RankMonitor):
    """RankMonitor that runs its per-step hook only in logging blocks."""

    enabled = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.enabled:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class BlockScheduler(Callback):
    """Switch mode every ``BLOCK`` steps (the mode furthest behind its step budget goes next), time every step
    (start of a batch to the start of the next: forward, backward, optimiser, hooks, logging), sample RSS."""

    def __init__(self, budgets: dict[str, int], loggers: dict[str, list], monitor: GatedRankMonitor) -> None:
        self.budgets, self.loggers, self.monitor = budgets, loggers, monitor
        self.mode = "off"
        self.done = {mode: 0 for mode in budgets}
        self.blocks: list[dict] = []  # {"mode", "start_step", "times", "cpu", "rss_start_kb"}
        self.steps_by_mode: dict[str, int] = {mode: 0 for mode in budgets}
        self.rss: list[tuple[int, int]] = []
        self._last: float | None = None
        self._last_cpu = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now, cpu, step = time.perf_counter(), time.thread_time(), trainer.global_step
        if self._last is not None and self.blocks:
            self.blocks[-1]["times"].append(now - self._last)
            self.blocks[-1]["cpu"].append(cpu - self._last_cpu)
        if step % BLOCK == 0:
            self.mode = min(self.budgets, key=lambda m: (self.done[m] / self.budgets[m], list(self.budgets).index(m)))
            self.done[self.mode] += BLOCK
            trainer.loggers = list(self.loggers[self.mode])
            self.monitor.enabled = self.mode != "off"
            self.blocks.append(
                {"mode": self.mode, "start_step": step, "times": [], "cpu": [], "rss_start_kb": rss_kb()}
            )
        self.steps_by_mode[self.mode] += 1
        if step % RSS_EVERY == 0:
            self.rss.append((step, self.blocks[-1]["rss_start_kb"] if step % BLOCK == 0 else rss_kb()))
        self._last, self._last_cpu = now, cpu

    def on_train_end(self, trainer, pl_module) -> None:
        self.rss.append((trainer.global_step, rss_kb()))
        self.blocks[-1]["rss_end_kb"] = self.rss[-1][1]
        # every logger gets RankMonitor's last call and Lightning's finalize
        trainer.loggers = [lg for group in self.loggers.values() for lg in group]
        self.monitor.enabled = False


def paired_overheads(blocks: list[dict], mode: str, warm_steps: int, series: str = "times") -> list[float]:
    """Per block of ``mode``: its median step time (or main-thread CPU, ``series="cpu"``) over the mean of the
    medians of the nearest ``off`` blocks before and after, minus 1."""
    medians = [(b["mode"], b["start_step"], statistics.median(b[series]) if b[series] else None) for b in blocks]
    ratios = []
    for i, (m, start, median) in enumerate(medians):
        if m != mode or median is None or start < warm_steps:
            continue
        before = next(
            (x for k, s, x in reversed(medians[:i]) if k == "off" and x is not None and s >= warm_steps), None
        )
        after = next((x for k, s, x in medians[i + 1 :] if k == "off" and x is not None), None)
        neighbours = [x for x in (before, after) if x is not None]
        if neighbours:
            ratios.append(median / statistics.fmean(neighbours) - 1.0)
    return ratios


def count_points(uri: str, run_id: str, key: str) -> int:
    """Points of metric ``key`` stored in ``run_id`` at ``uri``."""
    from mlflow.tracking import MlflowClient

    return len(MlflowClient(uri).get_metric_history(run_id, key))


def mode_entry(mode: str, scheduler: BlockScheduler, timers: dict, warm: int, growth: dict, off: dict | None) -> dict:
    """One mode's numbers: steps, step times, CPU, RSS growth and, against ``off``, the paired overheads."""
    blocks = [b for b in scheduler.blocks if b["mode"] == mode and b["start_step"] >= warm]
    times, cpus = [t for b in blocks for t in b["times"]], [t for b in blocks for t in b["cpu"]]
    steps = scheduler.steps_by_mode[mode]
    per_step = lambda seconds: 1e3 * seconds / max(steps, 1)  # noqa: E731
    median = lambda values: 100 * statistics.median(values) if values else None  # noqa: E731
    entry = {
        "steps": steps,
        "timed_steps": len(times),
        "step_ms_median": 1e3 * statistics.median(times) if times else None,
        "main_thread_cpu_ms_per_step_median": 1e3 * statistics.median(cpus) if cpus else None,
        "rss_growth_kb_per_100_own_steps": 100 * growth[mode] / max(len(times), 1),
    }
    if off is not None:
        entry.update(
            overhead_paired_median_pct=median(paired_overheads(scheduler.blocks, mode, warm)),
            main_thread_cpu_overhead_paired_median_pct=median(paired_overheads(scheduler.blocks, mode, warm, "cpu")),
            log_calls_ms_per_step=per_step(timers["log_calls"][mode]),
        )
    if mode == "resilient":
        entry["sender_cpu_ms_per_step"] = per_step(timers["sender_cpu"][mode])
    return entry


def report(result: dict) -> str:
    """The markdown table of every mode and the RSS line."""
    fmt = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    rows = [
        [
            mode,
            e["steps"],
            fmt(e["step_ms_median"]),
            fmt(e.get("overhead_paired_median_pct"), "+.1f"),
            fmt(e.get("main_thread_cpu_overhead_paired_median_pct"), "+.1f"),
            fmt(e.get("log_calls_ms_per_step")),
            fmt(e.get("sender_cpu_ms_per_step")),
            f"{e['rss_growth_kb_per_100_own_steps']:+.1f}",
            e.get("rank_points_in_store", "-"),
        ]
        for mode, e in result["modes"].items()
    ]
    m = result["memory"]
    return "\n".join(
        [
            f"batch {result['batch_size']} x {result['seq_len']}; {result['total_steps']} steps in "
            f"{result['fit_seconds']:.0f} s; RankMonitor sends {result['rank_monitor_values_per_step']} values a step; "
            f"load average {result['load_average'][0]:.1f} on {result['cpus']} CPUs",
            "",
            harness.table(
                [
                    "mode",
                    "steps",
                    "step ms (median)",
                    "wall overhead vs off, %",
                    "main-thread CPU overhead, %",
                    "logger calls ms/step",
                    "sender thread CPU ms/step",
                    "RSS KB / 100 own steps",
                    "rank points stored",
                ],
                rows,
            ),
            f"\nRSS (KB): start {m['rss_start_kb']:,}, end {m['rss_end_kb']:,}, max {m['rss_max_kb']:,}; slope after "
            f"step {result['warmup_steps']}: {m['slope_kb_per_100_steps_after_warmup']:+.1f} KB / 100 steps",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved fit, print the table, write the JSON."""
    parser = harness.bench_parser(__doc__, threads=1, out_dir=None)
    parser.add_argument(
        "--steps", type=int, default=harness.Quick(50, 2000), help="steps of each of off and resilient (default 2000)"
    )
    parser.add_argument(
        "--sync-steps", type=int, default=harness.Quick(50, 150), help="steps of async (slow: fewer by default)"
    )
    parser.add_argument("--modes", default="off,resilient,async", help=f"comma list of {','.join(MODES)}")
    parser.add_argument(
        "--warmup", type=int, default=harness.Quick(0, 300), help="steps left out of the timing and the RSS slope"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="quickstart: 32")
    parser.add_argument("--seq-len", type=int, default=32, help="quickstart: 64")
    parser.add_argument("--out", type=Path, default=harness.RESULTS_DIR / "logging_load.json")
    args = harness.parse(parser, argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "off" not in modes or not set(modes) <= set(MODES):
        parser.error(f"--modes must include off and only name {', '.join(MODES)}")
    budgets = {m: args.sync_steps if m == "async" else args.steps for m in modes}
    total = -(-sum(budgets.values()) // BLOCK) * BLOCK
    config = yaml.safe_load(QUICKSTART.read_text())
    model_kwargs = {**config["model"]["init_args"], "max_len": max(args.seq_len, 8)}
    callback_kwargs = {c["class_path"]: dict(c.get("init_args") or {}) for c in config["trainer"]["callbacks"]}
    torch.manual_seed(0)
    model = MaskedLM(**model_kwargs)
    data = DataLoader(SyntheticMLM(model_kwargs["vocab_size"], args.seq_len, args.batch_size), batch_size=None)
    store_dir = Path(tempfile.mkdtemp(prefix="comera_logging_load_"))
    timers = {"log_calls": defaultdict(float), "sender_cpu": defaultdict(float)}
    loggers: dict[str, list] = {"off": []}
    uris = {mode: f"sqlite:///{store_dir / f'{mode}.db'}" for mode in modes if mode != "off"}
    for mode, uri in uris.items():
        logger = (
            ResilientMLFlowLogger(
                experiment_name="logging_load", run_name=mode, tracking_uri=uri, local_dir=str(store_dir / "runs")
            )
            if mode == "resilient"
            else MLFlowLogger(experiment_name="logging_load", run_name=mode, tracking_uri=uri, synchronous=False)
        )
        time_logger(logger, mode, timers)
        loggers[mode] = [logger]
    monitor = GatedRankMonitor(log_every_n_steps=1, save_artifacts=False)
    scheduler = BlockScheduler(budgets, loggers, monitor)
    callbacks = [
        RankAdaptation(**callback_kwargs.get("RankAdaptation", {})),
        ContractionPlanner(**callback_kwargs.get("ContractionPlanner", {})),
        monitor,
        scheduler,
    ]
    trainer = Trainer(
        max_steps=total,
        logger=[lg for group in loggers.values() for lg in group] or False,
        callbacks=callbacks,
        log_every_n_steps=1,
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=str(store_dir / "runs"),
    )
    print(
        f"comera logging load: {total} steps ({', '.join(f'{m} {b}' for m, b in budgets.items())}), blocks of "
        f"{BLOCK}, batch {args.batch_size} x {args.seq_len}, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    fit_start = time.perf_counter()
    trainer.fit(model, train_dataloaders=data)
    fit_seconds = time.perf_counter() - fit_start

    warm = args.warmup
    rss_warm = [p for p in scheduler.rss if p[0] >= warm] or scheduler.rss
    growth = defaultdict(float)  # RSS growth over each mode's own blocks (after warm-up)
    for block, following in zip(scheduler.blocks, [*scheduler.blocks[1:], None], strict=True):
        end = following["rss_start_kb"] if following is not None else block.get("rss_end_kb")
        if end is not None and block["start_step"] >= warm:
            growth[block["mode"]] += end - block["rss_start_kb"]
    per_mode = {"off": mode_entry("off", scheduler, timers, warm, growth, None)}
    for mode in (m for m in modes if m != "off"):
        per_mode[mode] = mode_entry(mode, scheduler, timers, warm, growth, per_mode["off"])
    metrics = monitor.collect_metrics(trainer, size_report(model))
    rank_key = next(k for k in metrics if k.startswith("rank/"))
    for mode, uri in uris.items():  # RankMonitor logs every step of its blocks, and at the fit's start and end
        logger = loggers[mode][0]
        per_mode[mode].update(
            rank_points_in_store=count_points(uri, logger.run_id, rank_key),
            train_loss_points_in_store=count_points(uri, logger.run_id, "train/loss"),
        )
    import mlflow

    result = {
        "model": {
            k: model_kwargs[k] for k in ("vocab_size", "d_model", "num_heads", "d_ff", "num_layers", "layer_config")
        },
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "threads": torch.get_num_threads(),
        "total_steps": trainer.global_step,
        "block": BLOCK,
        "warmup_steps": warm,
        "rank_monitor_values_per_step": len(metrics),
        "budgets": budgets,
        "fit_seconds": fit_seconds,
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "machine": harness.machine_info(),
        "mlflow": mlflow.__version__,
        "memory": {
            "rss_start_kb": scheduler.rss[0][1],
            "rss_end_kb": scheduler.rss[-1][1],
            "rss_max_kb": max(kb for _, kb in scheduler.rss),
            "slope_kb_per_100_steps_after_warmup": 100 * (harness.slope(rss_warm) or math.nan),
            "samples": scheduler.rss,
        },
        "modes": per_mode,
    }
    print("\n" + report(result))
    harness.emit(args.out, result)
    shutil.rmtree(store_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
