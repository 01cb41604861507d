"""Logging under load: per-step rank logging to a local sqlite MLflow store, memory and step-time overhead.

Trains the quickstart model (``configs/quickstart.yaml``'s architecture, RankAdaptation and
ContractionPlanner settings; smaller batches, see ``--batch-size``/``--seq-len``) on synthetic masked-LM
batches (random tokens, 15% masked) for thousands of optimiser steps in ONE Lightning fit, with Lightning's
``log_every_n_steps=1`` and ``RankMonitor(log_every_n_steps=1)``. The fit is cut into blocks of ``--block``
steps, and every block runs in one of these modes, interleaved (so the machine's load drifts alike for all):

* ``off``: no logger, RankMonitor skipped (the baseline);
* ``monitor``: RankMonitor computing its values every step, no logger (RankMonitor's own cost);
* ``resilient``: :class:`comera_lightning.training.loggers.ResilientMLFlowLogger` with its defaults: buffered, sent in
  batches by a thread of the training process;
* ``sync``: Lightning's plain ``MLFlowLogger`` (one synchronous ``log_batch`` per call: the old default);
* ``async`` (only if asked with ``--modes``): ``MLFlowLogger(synchronous=False)``, MLflow's own async queue.

Each logging mode writes its own run in its own sqlite file (``--store-dir``, a temp folder on disk by default).
It reports (a) the process RSS sampled every ``--rss-every`` steps: start, end, max and the least-squares slope
in KB per 100 steps after ``--warmup`` steps, and (b) the step time of each mode against the ``off`` blocks next
to it (paired per block: block medians, median of the ratios), the same for the training thread's CPU time per
step (``time.thread_time``: insensitive to other users' load; with ``--threads 1`` the training thread does all
the compute), with the main-thread time spent in logger calls and in RankMonitor, and the CPU time of the sender
thread. It counts the points of one rank key and of ``train/loss`` in every store (one per logged step).

    python benchmarks/bench_logging_load.py [--steps 2000] [--sync-steps 150] [--block 50] [--modes off,resilient]

Writes ``benchmarks/results/logging_load.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import yaml
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import MLFlowLogger
from torch.utils.data import DataLoader, IterableDataset

from comera_lightning.callbacks import ContractionPlanner, RankAdaptation, RankMonitor
from comera_lightning.lit.mlm import IGNORE, MaskedLM
from comera_lightning.training.loggers import ResilientMLFlowLogger
from comera_lightning.nn import size_report

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


# --- memory -------------------------------------------------------------------------------------------
def rss_kb() -> int | None:
    """Resident set size of this process in KB (psutil if installed, else /proc/self/statm)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss // 1024
    except ImportError:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
        except OSError:
            return None


def slope_per_100(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of (step, KB) in KB per 100 steps."""
    if len(points) < 2:
        return float("nan")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 100.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")


# --- data and model -----------------------------------------------------------------------------------
class SyntheticMLM(IterableDataset):
    """Endless masked-LM batches: random token ids, every position masked with probability 0.15."""

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, pool: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.batches = []
        for _ in range(pool):
            ids = torch.randint(5, vocab_size, (batch_size, seq_len), generator=g)
            masked = torch.rand(batch_size, seq_len, generator=g) < 0.15
            masked[:, 0] = True
            labels = torch.where(masked, ids, torch.full_like(ids, IGNORE))
            self.batches.append({"input_ids": torch.where(masked, torch.full_like(ids, 4), ids),
                                 "attention_mask": torch.ones_like(ids), "labels": labels})

    def __iter__(self):
        while True:
            yield from self.batches


def quickstart() -> tuple[dict, dict, dict]:
    config = yaml.safe_load(QUICKSTART.read_text())
    model = dict(config["model"]["init_args"])
    callbacks = {c["class_path"]: dict(c.get("init_args") or {}) for c in config["trainer"]["callbacks"]}
    return model, callbacks, config


# --- instrumentation ----------------------------------------------------------------------------------
class Timers:
    """Main-thread seconds spent in logger calls and in RankMonitor, per mode; sender-thread CPU seconds."""

    def __init__(self) -> None:
        self.log_calls: dict[str, float] = {}
        self.monitor: dict[str, float] = {}
        self.sender_cpu: dict[str, float] = {}  # per mode: CPU of the logger's sender thread in flush()
        self.sender_wall: dict[str, float] = {}
        self.sender_flushes: dict[str, int] = {}
        self.mode = "off"


def time_logger(logger, mode: str, timers: Timers) -> None:
    """Wrap ``logger.log_metrics`` (and a ResilientMLFlowLogger's ``flush`` when run by its sender thread)."""
    original = logger.log_metrics

    def log_metrics(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timers.log_calls[mode] = timers.log_calls.get(mode, 0.0) + time.perf_counter() - start

    logger.log_metrics = log_metrics
    if isinstance(logger, ResilientMLFlowLogger):
        flush = logger.flush
        main = threading.main_thread()

        def timed_flush():
            if threading.current_thread() is main:
                return flush()
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return flush()
            finally:
                timers.sender_wall[mode] = timers.sender_wall.get(mode, 0.0) + time.perf_counter() - wall
                timers.sender_cpu[mode] = timers.sender_cpu.get(mode, 0.0) + time.thread_time() - cpu
                timers.sender_flushes[mode] = timers.sender_flushes.get(mode, 0) + 1

        logger.flush = timed_flush


class GatedRankMonitor(RankMonitor):
    """RankMonitor that runs its per-step hook only in logging blocks, and times itself."""

    def __init__(self, timers: Timers, **kwargs) -> None:
        super().__init__(**kwargs)
        self.timers = timers
        self.enabled = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.enabled:
            return
        mode = self.timers.mode
        start, logged = time.perf_counter(), self.timers.log_calls.get(mode, 0.0)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        spent = time.perf_counter() - start - (self.timers.log_calls.get(mode, 0.0) - logged)
        self.timers.monitor[mode] = self.timers.monitor.get(mode, 0.0) + spent  # without its logger calls


class BlockScheduler(Callback):
    """Switch mode every ``block`` steps (the mode furthest behind its step budget goes next), time every
    step (start of a batch to the start of the next: forward, backward, optimiser, hooks, logging) and
    sample RSS."""

    def __init__(self, budgets: dict[str, int], block: int, loggers: dict[str, list], monitor: GatedRankMonitor,
                 timers: Timers, rss_every: int) -> None:
        self.budgets, self.block, self.loggers, self.monitor = budgets, block, loggers, monitor
        self.timers, self.rss_every = timers, rss_every
        self.done = {mode: 0 for mode in budgets}
        self.blocks: list[dict] = []  # {"mode", "start_step", "times": [...]}
        self.steps_by_mode: dict[str, list[int]] = {mode: [] for mode in budgets}
        self.rss: list[tuple[int, int]] = []
        self._last = None
        self._last_cpu = 0.0

    def _next_mode(self) -> str:
        return min(self.budgets, key=lambda m: (self.done[m] / self.budgets[m], list(self.budgets).index(m)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        step = trainer.global_step
        if self._last is not None and self.blocks:
            self.blocks[-1]["times"].append(now - self._last)
            self.blocks[-1]["cpu"].append(cpu - self._last_cpu)
        if step % self.block == 0:
            mode = self._next_mode()
            self.done[mode] += self.block
            self.timers.mode = mode
            trainer.loggers = list(self.loggers[mode])
            self.monitor.enabled = mode != "off"
            self.blocks.append({"mode": mode, "start_step": step, "times": [], "cpu": [], "rss_start_kb": rss_kb()})
        self.steps_by_mode[self.blocks[-1]["mode"]].append(step)
        if step % self.rss_every == 0:
            self.rss.append((step, self.blocks[-1]["rss_start_kb"] if step % self.block == 0 else rss_kb()))
        self._last, self._last_cpu = now, cpu

    def on_train_end(self, trainer, pl_module) -> None:
        self.rss.append((trainer.global_step, rss_kb()))
        self.blocks[-1]["rss_end_kb"] = self.rss[-1][1]
        # every logger gets RankMonitor's last call and Lightning's finalize
        trainer.loggers = [lg for group in self.loggers.values() for lg in group]
        self.monitor.enabled = False


# --- analysis -----------------------------------------------------------------------------------------
def paired_overheads(blocks: list[dict], mode: str, warm_steps: int, series: str = "times") -> list[float]:
    """Per block of ``mode``: its median step time (or main-thread CPU, ``series="cpu"``) over the mean of the
    medians of the nearest ``off`` blocks before and after, minus 1."""
    means = [(b["mode"], b["start_step"], statistics.median(b[series]) if b[series] else None) for b in blocks]
    ratios = []
    for i, (m, start, mean) in enumerate(means):
        if m != mode or mean is None or start < warm_steps:
            continue
        before = next((x for k, s, x in reversed(means[:i]) if k == "off" and x is not None and s >= warm_steps), None)
        after = next((x for k, s, x in means[i + 1 :] if k == "off" and x is not None), None)
        neighbours = [x for x in (before, after) if x is not None]
        if neighbours:
            ratios.append(mean / statistics.fmean(neighbours) - 1.0)
    return ratios


def count_points(uri: str, run_id: str, key: str) -> int:
    from mlflow.tracking import MlflowClient

    return len(MlflowClient(uri).get_metric_history(run_id, key))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="steps of each of off and resilient (default 2000)")
    parser.add_argument("--sync-steps", type=int, default=150, help="steps of sync/async (slow: fewer by default)")
    parser.add_argument("--modes", default="off,monitor,resilient,sync",
                        help="comma list of off,monitor,resilient,sync,async")
    parser.add_argument("--monitor-steps", type=int, default=300, help="steps of the monitor mode")
    parser.add_argument("--block", type=int, default=50, help="steps per interleaved block")
    parser.add_argument("--warmup", type=int, default=300, help="steps left out of the timing and the RSS slope")
    parser.add_argument("--rss-every", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=8, help="quickstart: 32")
    parser.add_argument("--seq-len", type=int, default=32, help="quickstart: 64")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine OpenMP threads spin under "
                             "oversubscription and make step times erratic; 0 = torch's choice)")
    parser.add_argument("--store-dir", type=Path, default=None, help="folder of the sqlite stores (default: a temp folder)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "logging_load.json")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    known = {"off", "monitor", "resilient", "sync", "async"}
    if "off" not in modes or not set(modes) <= known:
        parser.error(f"--modes must include off and only name {', '.join(sorted(known))}")
    budgets = {m: {"sync": args.sync_steps, "async": args.sync_steps, "monitor": args.monitor_steps}.get(m, args.steps)
               for m in modes}
    total = sum(budgets.values())
    total = -(-total // args.block) * args.block
    wall_start = time.perf_counter()

    model_kwargs, callback_kwargs, config = quickstart()
    model_kwargs["max_len"] = max(args.seq_len, 8)
    torch.manual_seed(0)
    model = MaskedLM(**model_kwargs)
    data = DataLoader(SyntheticMLM(model_kwargs["vocab_size"], args.seq_len, args.batch_size), batch_size=None)

    store_dir = args.store_dir or Path(tempfile.mkdtemp(prefix="comera_logging_load_"))
    store_dir.mkdir(parents=True, exist_ok=True)
    timers = Timers()
    loggers: dict[str, list] = {"off": [], "monitor": []}
    uris = {}
    for mode in modes:
        if mode in ("off", "monitor"):
            continue
        uri = f"sqlite:///{store_dir / f'{mode}.db'}"
        uris[mode] = uri
        if mode == "resilient":
            logger = ResilientMLFlowLogger(experiment_name="logging_load", run_name=mode, tracking_uri=uri,
                                           local_dir=str(store_dir / "runs"))
        else:
            logger = MLFlowLogger(experiment_name="logging_load", run_name=mode, tracking_uri=uri,
                                  synchronous=False if mode == "async" else None)
        time_logger(logger, mode, timers)
        loggers[mode] = [logger]
    monitor = GatedRankMonitor(timers, log_every_n_steps=1, save_artifacts=False)
    scheduler = BlockScheduler(budgets, args.block, loggers, monitor, timers, args.rss_every)
    callbacks = [RankAdaptation(**callback_kwargs.get("RankAdaptation", {})),
                 ContractionPlanner(**callback_kwargs.get("ContractionPlanner", {})), monitor, scheduler]
    all_loggers = [lg for group in loggers.values() for lg in group]
    trainer = Trainer(max_steps=total, logger=all_loggers or False, callbacks=callbacks, log_every_n_steps=1,
                      accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                      default_root_dir=str(store_dir / "runs"))
    print(f"comera logging load: {total} steps ({', '.join(f'{m} {b}' for m, b in budgets.items())}), blocks of "
          f"{args.block}, batch {args.batch_size} x {args.seq_len}, torch threads {torch.get_num_threads()}, "
          f"stores in {store_dir}", flush=True)
    fit_start = time.perf_counter()
    trainer.fit(model, train_dataloaders=data)
    fit_seconds = time.perf_counter() - fit_start

    # --- results ---
    warm = args.warmup
    rss_warm = [p for p in scheduler.rss if p[0] >= warm] or scheduler.rss
    memory = {"rss_start_kb": scheduler.rss[0][1], "rss_after_warmup_kb": rss_warm[0][1],
              "rss_end_kb": scheduler.rss[-1][1], "rss_max_kb": max(kb for _, kb in scheduler.rss),
              "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
              "slope_kb_per_100_steps_after_warmup": slope_per_100(rss_warm),
              "samples": scheduler.rss}
    growth: dict[str, float] = {}  # RSS growth over each mode's own blocks (after warm-up)
    for block, following in zip(scheduler.blocks, scheduler.blocks[1:] + [None]):
        end = following["rss_start_kb"] if following is not None else block.get("rss_end_kb")
        if end is not None and block["start_step"] >= warm:
            growth[block["mode"]] = growth.get(block["mode"], 0.0) + end - block["rss_start_kb"]
    per_mode = {}
    rank_key = None
    for mode in modes:
        times = [t for b in scheduler.blocks if b["mode"] == mode and b["start_step"] >= warm for t in b["times"]]
        cpus = [t for b in scheduler.blocks if b["mode"] == mode and b["start_step"] >= warm for t in b["cpu"]]
        steps_logged = len(scheduler.steps_by_mode[mode])
        entry = {"steps": steps_logged, "timed_steps": len(times),
                 "step_ms_mean": 1e3 * statistics.fmean(times) if times else None,
                 "step_ms_median": 1e3 * statistics.median(times) if times else None,
                 "main_thread_cpu_ms_per_step_median": 1e3 * statistics.median(cpus) if cpus else None,
                 "rss_growth_kb_per_100_own_steps": 100 * growth.get(mode, 0.0) / max(len(times), 1)}
        if mode != "off":
            ratios = paired_overheads(scheduler.blocks, mode, warm)
            entry["overhead_paired_median_pct"] = 100 * statistics.median(ratios) if ratios else None
            entry["overhead_paired_mean_pct"] = 100 * statistics.fmean(ratios) if ratios else None
            entry["paired_blocks"] = len(ratios)
            cpu_ratios = paired_overheads(scheduler.blocks, mode, warm, "cpu")
            entry["main_thread_cpu_overhead_paired_median_pct"] = (100 * statistics.median(cpu_ratios)
                                                                   if cpu_ratios else None)
            entry["log_calls_ms_per_step"] = 1e3 * timers.log_calls.get(mode, 0.0) / max(steps_logged, 1)
            entry["rank_monitor_ms_per_step"] = 1e3 * timers.monitor.get(mode, 0.0) / max(steps_logged, 1)
            entry["overhead_paired_median_pct_minus_monitor_own_work"] = (
                entry["overhead_paired_median_pct"] - 100 * entry["rank_monitor_ms_per_step"] / per_mode["off"]["step_ms_mean"]
                if ratios and per_mode["off"]["step_ms_mean"] else None)
            if mode == "monitor":
                per_mode[mode] = entry
                continue
            logger = loggers[mode][0]
            if rank_key is None:
                rank_key = next(k for k in monitor.collect_metrics(trainer, size_report(model)) if k.startswith("rank/"))
            # RankMonitor logs every step of its blocks, plus once at the start and the end of the fit
            entry["rank_points_in_store"] = count_points(uris[mode], logger.run_id, rank_key)
            entry["train_loss_points_in_store"] = count_points(uris[mode], logger.run_id, "train/loss")
            if mode == "resilient":
                entry["sender_cpu_ms_per_step"] = 1e3 * timers.sender_cpu.get(mode, 0.0) / max(steps_logged, 1)
                entry["sender_wall_ms_per_step"] = 1e3 * timers.sender_wall.get(mode, 0.0) / max(steps_logged, 1)
                entry["sender_flushes"] = timers.sender_flushes.get(mode, 0)
                off_cpu = per_mode["off"]["main_thread_cpu_ms_per_step_median"]
                if off_cpu and entry["main_thread_cpu_overhead_paired_median_pct"] is not None:
                    entry["total_cpu_overhead_pct"] = (entry["main_thread_cpu_overhead_paired_median_pct"]
                                                       + 100 * entry["sender_cpu_ms_per_step"] / off_cpu)
                entry["degraded"] = logger.degraded
        per_mode[mode] = entry
    # the rank logging per step: how many values one step sends
    keys_per_step = len(monitor.collect_metrics(trainer, size_report(model)))
    result = {
        "model": {k: model_kwargs[k] for k in ("vocab_size", "d_model", "num_heads", "d_ff", "num_layers",
                                                "layer_config")},
        "batch_size": args.batch_size, "seq_len": args.seq_len, "threads": torch.get_num_threads(),
        "total_steps": trainer.global_step, "block": args.block, "warmup_steps": warm,
        "rank_monitor_values_per_step": keys_per_step, "budgets": budgets,
        "fit_seconds": fit_seconds, "wall_seconds": time.perf_counter() - wall_start,
        "load_average": os.getloadavg(), "cpus": os.cpu_count(),
        "memory": memory, "modes": per_mode,
        "python": sys.version.split()[0], "torch": torch.__version__,
    }
    import lightning
    import mlflow

    result["lightning"], result["mlflow"] = lightning.__version__, mlflow.__version__

    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    print(f"\nquickstart model (d_model {model_kwargs['d_model']}, {model_kwargs['num_layers']} layers, rank "
          f"{model_kwargs['layer_config']['rank']}), batch {args.batch_size} x {args.seq_len}; "
          f"{trainer.global_step} steps in "
          f"{fit_seconds:.0f} s; RankMonitor sends {keys_per_step} values a step; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    print("| mode | steps | step ms (median) | wall overhead vs off (paired median) | main-thread CPU overhead "
          "(paired median) | logger calls ms/step (main thread) | RankMonitor ms/step (own work) | sender thread CPU "
          "ms/step | RSS KB / 100 own steps | rank points stored |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, e in per_mode.items():
        print(f"| {mode} | {e['steps']} | {fmt(e['step_ms_median'], '.2f')} | "
              f"{fmt(e.get('overhead_paired_median_pct'), '+.1f') + ' %' if mode != 'off' else '-'} | "
              f"{fmt(e.get('main_thread_cpu_overhead_paired_median_pct'), '+.1f') + ' %' if mode != 'off' else '-'} | "
              f"{fmt(e.get('log_calls_ms_per_step'), '.2f')} | {fmt(e.get('rank_monitor_ms_per_step'), '.2f')} | "
              f"{fmt(e.get('sender_cpu_ms_per_step'), '.2f')} | "
              f"{e['rss_growth_kb_per_100_own_steps']:+.1f} | "
              f"{e.get('rank_points_in_store', '-')} |")
    for mode, e in per_mode.items():
        if e.get("total_cpu_overhead_pct") is not None:
            print(f"\n{mode}: CPU per step, training thread + sender thread, vs off: "
                  f"{e['total_cpu_overhead_pct']:+.1f} % (RankMonitor's own work: "
                  f"{100 * e['rank_monitor_ms_per_step'] / per_mode['off']['main_thread_cpu_ms_per_step_median']:.1f} %)")
    m = memory
    print(f"\nRSS (KB): start {m['rss_start_kb']:,}, after warm-up {m['rss_after_warmup_kb']:,}, end "
          f"{m['rss_end_kb']:,}, max {m['rss_max_kb']:,}; slope after step {warm}: "
          f"{m['slope_kb_per_100_steps_after_warmup']:+.1f} KB / 100 steps")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    if args.store_dir is None:
        shutil.rmtree(store_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
