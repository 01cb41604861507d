"""The GPU checks (issues 29 and 42) in one run: CUDA graphs, the six-encoder training step in bf16, a bf16
``comera fit`` that truncates and resumes (plain, and under FSDP2 on one GPU), the ``Compile`` callback, and
``llm_60m`` dense against CoMERA at equal wall-clock.

Each check runs in its own process under a time limit, in this order (cheapest and most certain first, the long
llm check last), and the summary is rewritten after every check, so a run cut off by the device's limit still
returns what it finished:

1. ``cuda_graphs``: ``bench_cuda_graphs.py --quick``, captured against eager at the quickstart size, fp32 and
   bf16-mixed, identity and speed-up (batch 1 and 32);
2. ``training_step``: ``bench_training_step.py --part step``, dense + AdamW, dense + GaLore, CoMERA r30 at batch 1
   and 32 x 128, bf16-mixed, with ``torch.cuda.max_memory_allocated`` and profiles;
3. ``fit_resume``: ``comera fit`` of the quickstart on CUDA in bf16-mixed with the quality study's early late-stage
   schedule (``tuned_study``'s ``comera_early``: the late stage from 10 % of the steps, the size target reached by
   50 %, ``ScheduledLateStage(ramp_steps=...)``): ranks shrink, truncations happen, the final validation loss is
   finite, and the last checkpoint (written after the cuts) resumes;
4. ``fsdp2``: the same fit and resume with ``callbacks/fsdp2.yaml`` (FSDP2 through ``FSDP2Strategy``, one GPU):
   the cuts are resharded and the distributed checkpoint folder resumes;
5. ``compile``: short quickstart fits (rank callbacks in mask mode, no validation) eager, with the ``Compile``
   callback (``callbacks/compile.yaml``) and with ``Compile(mode="reduce-overhead")``, one after the other:
   whether each finishes, its median steps/s as a ratio to the eager fit's, torch's graph, graph-break and
   CUDA-graph-skip counts;
6. ``llm_60m``: ``llm_study.py`` on ``configs/llm_60m.yaml`` (the standard library as corpus, a BPE tokenizer
   trained on it): dense and CoMERA, each ``--llm-budget-s`` seconds of training by the ``matched`` protocol, or
   what the deadline leaves.

Output in ``--out`` (the device tool brings back at most 8 files): ``summary.md`` and ``summary.json`` (targets and
verdicts; a check that failed or timed out shows as FAILED), ``checks.log`` (this driver's log), ``results.tar.gz``
(every check's JSON, markdown, PNG and log). Without CUDA the checks are skipped (exit 0); ``--cpu-dry-run`` runs
tiny versions of all six on the CPU to test the plumbing (32-true; FSDP2 over gloo; ``Compile`` with the
``aot_eager`` backend). ``benchmarks/gpu_checks.sh`` installs the carried wheels and calls this.

    python benchmarks/gpu_checks.py --out /tmp/gpu_checks                 # on a GPU machine
    python benchmarks/gpu_checks.py --cpu-dry-run --out /tmp/gpu_dry      # the plumbing, on a CPU (about 20 minutes)
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from tuned_study import EARLY_LATE_FRACTION, EARLY_RAMP_FRACTION

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
# the targets
TARGET_STEP_SPEEDUP = 2.0  # CoMERA's step vs dense at batch 32, bf16
TARGET_MEMORY_VS_GALORE = 9.0  # dense + GaLore's peak memory over CoMERA's at batch 1
TARGET_GRAPHS_SPEEDUP = 1.3  # CUDA graphs vs eager at batch 1
# the llm check besides its two training budgets: corpus, tokenizer, step timing, validations, imports
LLM_OVERHEAD_S = 120.0
# the fit checks: the first fit's steps, then the resume's (both end on a validation, every 50 steps)
FIT_STEPS, RESUME_STEPS = 200, 250
# the fits under the checks that end with FAILED when they did not finish
FIT_CHECKS = ("fit_resume", "fsdp2")
# the compile check's fits, in order: None is the eager reference, else Compile's mode ("default": torch's)
COMPILE_VARIANTS: dict[str, str | None] = {"eager": None, "default": "default", "reduce-overhead": "reduce-overhead"}
COMPILE_STEPS, COMPILE_WARMUP = 150, 30  # dry: 40 and 10
CHECK_FAILED = ("failed", "timed out")


@dataclass
class Check:
    """One check: a name, the command lines it runs (in order, in its own folder) and its time limit."""

    name: str
    commands: list[list[str]]
    limit_s: float


def _python(script: str, *args: str) -> list[str]:
    return [sys.executable, str(BENCH / script), *args]


def _env() -> dict[str, str]:
    """The checks' environment: unbuffered logs, and the benchmarks and the repository importable (the fits'
    ``gpu_checks.FitProbe`` callback is imported by ``comera fit``)."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), str(REPO), os.environ.get("PYTHONPATH")])),
    }


def checks(work: Path, dry: bool) -> list[Check]:
    """The first five checks, on CUDA in bf16 (``dry``: tiny versions on the CPU); :func:`llm_check` is the sixth."""
    cuda_graphs = _python("bench_cuda_graphs.py", "--out-dir", str(work / "cuda_graphs"))
    step = _python(
        "bench_training_step.py",
        "--part",
        "step",
        "--precision",
        "bf16-mixed",
        "--profile",
        "always",
        "--out-dir",
        str(work / "training_step"),
    )
    me = [sys.executable, str(Path(__file__).resolve())]
    fit = [*me, "--fit-check", str(work / "fit_resume")]
    fsdp2 = [*me, "--fit-check", str(work / "fsdp2"), "--fit-config", "callbacks/fsdp2"]
    compiled = [*me, "--compile-check", str(work / "compile")]
    # on the GPU the CUDA-graph check takes the quickstart size only (launch-bound, where graphs matter): the base
    # size would double its minutes, which the llm check needs more
    cuda_graphs += ["--quick"] + (["--backend", "replay"] if dry else ["--repeats", "3"])
    if dry:
        step += ["--quick"]
        for command in (fit, fsdp2, compiled):
            command += ["--cpu-dry-run"]
    else:
        step += ["--device", "cuda", "--min-total-s", "5"]
    # GPU limits (seconds): the five short checks' 540 are a cap each, the run's deadline (540) holds them all,
    # and the llm check trains for what they leave. A fit costs about 10-15 s of start-up (imports, CUDA, data
    # cache); fsdp2 two fits (the tokenizer cached by fit_resume); compile three fits and two compilations.
    # dry: bf16 is emulated on a CPU, and the step check alone takes about 4 minutes on 2 cores
    return [
        Check("cuda_graphs", [cuda_graphs], 300 if dry else 120),
        Check("training_step", [step], 600 if dry else 150),
        Check("fit_resume", [fit], 300 if dry else 90),
        Check("fsdp2", [fsdp2], 300 if dry else 75),
        Check("compile", [compiled], 300 if dry else 105),
    ]


def llm_check(work: Path, dry: bool, budget_s: float) -> Check:
    """``llm_60m`` dense and CoMERA, ``budget_s`` of training each by the matched protocol, on the standard library."""
    llm = _python(
        "llm_study.py",
        "--config",
        str(REPO / "configs" / "llm_60m.yaml"),
        "--protocols",
        "matched",
        "--methods",
        "dense",
        "comera",
        "--precision",
        "bf16-mixed",
        "--widths",
        "--budget-s",
        f"{budget_s:.0f}",
        "--out-dir",
        str(work / "llm_60m"),
        "--cache-dir",
        str(work / "cache"),
        "--set",
        "data.root=stdlib",
        "--set",
        "data.files='**/*.py'",
        "--set",
        "data.val_files=null",
        "--set",
        "data.tokenizer_path=null",
        # 5 % of the standard library's 1,790 files (31 MB) held out: about 15 validation batches of 128 x 256
        "--set",
        "data.val_fraction=0.05",
        "--set",
        "data.tokenizer_sample_mb=16",
    )
    if dry:
        llm += ["--quick", "--set", "data.files='*.py'", "--set", "data.num_workers=0"]
    else:
        llm += ["--accelerator", "cuda", "--repeats", "3"]
    return Check("llm_60m", [llm], 400 if dry else 2 * budget_s + LLM_OVERHEAD_S)


# ------------------------------------------------------------------------------------------------------
# check 3: a bf16 comera fit that truncates, and its resume


def fit_check(folder: Path, dry: bool) -> dict[str, Any]:
    """``comera fit`` of the quickstart in bf16-mixed (``dry``: 32-true on the CPU) with the late stage from step 60
    and truncations every 20 steps, 200 steps; then a resume from its last checkpoint (written after the
    truncations) to step 240; returns :func:`inspect_fit` of both checkpoints."""
    folder.mkdir(parents=True, exist_ok=True)
    callbacks = folder / "early_late_stage.yaml"
    callbacks.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: RankAdaptation\n      init_args: {gamma: 0.005, late_start_step: 60,"
        " target_compression: 20.0, truncate_every_n_steps: 20, min_dead_fraction: 0.2}\n"
        "    - class_path: ContractionPlanner\n      init_args: {verbose: false}\n"
        "    - class_path: RankMonitor\n      init_args: {log_every_n_steps: 10}\n"
        "    - class_path: ModelCheckpoint\n      init_args: {save_last: true}\n"
    )
    cli = [
        sys.executable,
        "-m",
        "comera_lightning",
        "fit",
        "--config",
        "quickstart",
        "--config",
        str(callbacks),
        # bf16 on a CPU without bf16 units is emulated and many times slower: the dry run keeps 32-true
        "--trainer.precision",
        "32-true" if dry else "bf16-mixed",
        "--trainer.accelerator",
        "cpu" if dry else "cuda",
        "--trainer.default_root_dir",
        str(folder),
        "--trainer.val_check_interval",
        "50",
        "--trainer.limit_val_batches",
        "2",
    ]
    if dry:
        cli += ["--data.max_files", "40", "--data.max_sequences", "2000"]
    subprocess.run([*cli, "--trainer.max_steps", "200"], cwd=folder, check=True)
    first = inspect_fit(folder)
    subprocess.run([*cli, "--trainer.max_steps", "240", "--ckpt_path", first["checkpoint"]], cwd=folder, check=True)
    resumed = inspect_fit(folder)
    if resumed["checkpoint"] == first["checkpoint"] and resumed["global_step"] == first["global_step"]:
        raise RuntimeError(f"the resumed fit wrote no new last checkpoint under {folder}")
    return {"first": first, "resumed": resumed}


def inspect_fit(folder: Path) -> dict[str, Any]:
    """Ranks, truncations and steps of the fit's last checkpoint against a fresh model of the same config."""
    import torch

    from comera_lightning.lit import MaskedLM
    from comera_lightning.nn import tt_layers

    found = sorted(folder.rglob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no last.ckpt under {folder}: the fit wrote no checkpoint")
    ckpt = torch.load(found[-1], map_location="cpu", weights_only=True)
    model = MaskedLM.load_from_checkpoint(found[-1], map_location="cpu")
    fresh = MaskedLM(**{k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")})
    rank_state = next((v for k, v in ckpt.get("callbacks", {}).items() if "RankAdaptation" in k), {})
    ranks_now = {n: list(layer.ranks) for n, layer in tt_layers(model)}
    ranks_start = {n: list(layer.ranks) for n, layer in tt_layers(fresh)}
    return {
        "checkpoint": str(found[-1]),
        "global_step": int(ckpt["global_step"]),
        "truncations": rank_state.get("truncations"),
        "stage": rank_state.get("stage"),
        "rank_sum_start": sum(map(sum, ranks_start.values())),
        "rank_sum_end": sum(map(sum, ranks_now.values())),
        "ranks_end": ranks_now,
    }


# ------------------------------------------------------------------------------------------------------
# reading the checks' results


def _load(pattern: str) -> dict | None:
    paths = sorted(glob.glob(pattern))
    return json.loads(Path(paths[-1]).read_text()) if paths else None


def verdict(measured: float | None, target: float, higher_is_better: bool = True) -> str:
    """'met' / 'MISSED' / 'n/a' of a measured value against a target."""
    if measured is None:
        return "n/a"
    return "met" if (measured >= target if higher_is_better else measured <= target) else "MISSED"


def read_results(work: Path) -> dict[str, Any]:
    """The targets and headline numbers from what the checks wrote (missing parts stay None)."""
    out: dict[str, Any] = {}
    graphs = _load(str(work / "cuda_graphs" / "cuda_graphs.json"))
    if graphs and not graphs.get("skipped"):
        out["cuda_graphs_identical"] = all(c["identical"] for c in graphs["identity"])
        batch1 = [t["speedup"] for t in graphs.get("timing", []) if t.get("batch") == 1]
        out["cuda_graphs_speedup_batch1"] = min(batch1) if batch1 else None
        out["cuda_graphs_speedups"] = {
            f"{t['size']} {t['precision']} batch {t.get('batch')}": t["speedup"] for t in graphs.get("timing", [])
        }
    step = _load(str(work / "training_step" / "training_step*.json"))
    if step:
        results = step["results"]
        realistic = max(results, key=int)
        out["step_speedup_dense_over_comera"] = results[realistic]["ratios"]["time dense/CoMERA"]
        out["step_batch"] = int(realistic)
        if "1" in results:
            # MemTracker's peak of the candidate's own live tensors (the measure of every CPU row): the allocator's
            # max_memory_allocated counts the other candidates resident beside it (kept in the archive)
            cands = results["1"]["candidates"]
            peak = {n: e["memory"]["total"] for n, e in cands.items() if not e.get("skipped")}
            galore, comera = peak.get("dense+GaLore"), peak.get("CoMERA r30")
            out["memory_galore_over_comera_batch1"] = galore / comera if galore and comera else None
        out["step_profiles"] = {b: p.get("why") for b, p in step.get("profiles", {}).items()}
    fit = work / "fit_resume" / "fit_check.json"
    if fit.exists():
        out["fit_resume"] = json.loads(fit.read_text())
    llm = _load(str(work / "llm_60m" / "llm_study*.json"))
    if llm:
        runs = {r["method"]: r for r in llm.get("runs", [])}
        ppl = {m: r["final"]["metrics"].get("val/perplexity") for m, r in runs.items()}
        out["llm_perplexity"] = ppl
        out["llm_tokens_per_s"] = {m: r["tokens"] / r["train_s"] for m, r in runs.items()}
        out["llm_train_s"] = {m: r["train_s"] for m, r in runs.items()}
        out["llm_compression"] = {m: r["final"]["compression_ratio"] for m, r in runs.items()}
    return out


def summary_markdown(results: dict[str, Any], status: dict[str, dict], machine: dict) -> str:
    """The summary: what ran, then the issue's targets with verdicts."""
    rows = [[name, s["status"], f"{s['wall_s']:.0f} s", s.get("detail", "")] for name, s in status.items()]
    lines = [
        f"## GPU checks on {machine.get('cuda') or 'no GPU (' + machine.get('cpu', '') + ')'}",
        "",
        harness.table(["check", "status", "wall", "detail"], rows),
        "",
    ]
    fit = results.get("fit_resume") or {}
    ppl = results.get("llm_perplexity") or {}
    first, resumed = fit.get("first") or {}, fit.get("resumed") or {}
    fit_ok = (
        bool(fit)
        and (first.get("truncations") or 0) > 0
        and first["rank_sum_end"] < first["rank_sum_start"]
        and resumed.get("global_step", 0) > first["global_step"]
    )
    targets = [
        [
            f"CoMERA step >= 2x faster than dense (bf16, batch {results.get('step_batch', 32)})",
            harness.times(results.get("step_speedup_dense_over_comera")),
            verdict(results.get("step_speedup_dense_over_comera"), TARGET_STEP_SPEEDUP),
        ],
        [
            "CoMERA >= 9x less peak memory than dense + GaLore (batch 1)",
            harness.times(results.get("memory_galore_over_comera_batch1")),
            verdict(results.get("memory_galore_over_comera_batch1"), TARGET_MEMORY_VS_GALORE),
        ],
        [
            "CUDA graphs >= 1.3x faster than eager (batch 1)",
            harness.times(results.get("cuda_graphs_speedup_batch1")),
            verdict(results.get("cuda_graphs_speedup_batch1"), TARGET_GRAPHS_SPEEDUP),
        ],
        [
            "bf16 fit: ranks shrink, truncations, the checkpoint resumes",
            (
                f"rank sum {first['rank_sum_start']} -> {first['rank_sum_end']}, {first['truncations']} truncations by "
                f"step {first['global_step']}, resumed to step {resumed['global_step']}"
            )
            if fit
            else "-",
            "met" if fit_ok else ("n/a" if not fit else "MISSED"),
        ],
        [
            "llm_60m at equal wall-clock: CoMERA perplexity <= dense",
            " vs ".join(f"{m} {v:.2f}" for m, v in ppl.items() if v is not None) or "-",
            verdict(ppl.get("comera"), ppl["dense"], higher_is_better=False) if ppl.get("dense") else "n/a",
        ],
    ]
    lines += [harness.table(["target (issue 29)", "measured", "verdict"], targets)]
    if results.get("llm_tokens_per_s"):
        lines += ["", "llm_60m tokens/s: " + ", ".join(f"{m} {v:,.0f}" for m, v in results["llm_tokens_per_s"].items())]
    for batch, why in (results.get("step_profiles") or {}).items():
        lines += ["", f"Training-step profile at batch {batch}: {why}"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------
# running


def run_checks(
    out: Path, dry: bool, llm_budget_s: float, deadline_s: float, log: Callable[[str], None]
) -> dict[str, dict]:
    """Run every check in order within ``deadline_s``, rewriting the summary after each; returns their status."""
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    status: dict[str, dict] = {}
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), str(REPO), os.environ.get("PYTHONPATH")])),
    }
    machine = harness.machine_info()
    for check in [*checks(work, dry), None]:
        left = deadline_s - (time.perf_counter() - started)
        if check is None:  # the llm check trains for what the deadline leaves, at most llm_budget_s per method
            budget = min(llm_budget_s, 5.0 if dry else (left - LLM_OVERHEAD_S) / 2)
            check = llm_check(work, dry, max(budget, 1.0))
            if budget < 15 and not dry:
                left = 0.0
        folder = work / check.name
        folder.mkdir(parents=True, exist_ok=True)
        if left < 30:
            status[check.name] = {"status": "not run (deadline)", "wall_s": 0.0}
            log(f"{check.name}: not run, {left:.0f} s left of the deadline")
            continue
        t0 = time.perf_counter()
        stop_at = t0 + min(check.limit_s, left)
        state, detail = "ok", ""
        with open(folder / "log.txt", "w") as out_log:
            for command in check.commands:
                limit = stop_at - time.perf_counter()
                log(f"{check.name}: {' '.join(command)}")
                # its own process group: a check stopped at its limit takes its children (a fit, loader workers)
                proc = subprocess.Popen(
                    command, cwd=folder, env=env, stdout=out_log, stderr=subprocess.STDOUT, start_new_session=True
                )
                try:
                    rc = proc.wait(timeout=max(limit, 1.0))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    state, detail = "timed out", f"after {time.perf_counter() - t0:.0f} s"
                    break
                if rc != 0:
                    state, detail = "failed", f"exit {rc}: see {check.name}/log.txt"
                    break
        status[check.name] = {"status": state, "wall_s": time.perf_counter() - t0, "detail": detail}
        log(f"{check.name}: {state} in {status[check.name]['wall_s']:.0f} s {detail}")
        write_summary(out, work, status, machine)
    return status


def _worth_keeping(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """The archive's filter: results and logs, not checkpoints, exported weights or data caches (fit_check.json
    already holds what the checkpoints say), so the archive stays far below the device's 16 MiB a file."""
    name = info.name
    if name.endswith((".ckpt", ".safetensors", ".bin", ".pt")) or "/cache" in name or "/.cache" in name:
        return None
    return info


def write_summary(out: Path, work: Path, status: dict[str, dict], machine: dict) -> None:
    """summary.json, summary.md and results.tar.gz from what the checks wrote so far."""
    results = read_results(work)
    harness.write_json(out / "summary.json", {"machine": machine, "status": status, "results": results})
    (out / "summary.md").write_text(summary_markdown(results, status, machine))
    partial = out / "results.tar.gz.tmp"
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(work, arcname="gpu_checks", filter=_worth_keeping)
    partial.replace(out / "results.tar.gz")


def main(argv: list[str] | None = None) -> int:
    """Run the checks (or skip them without CUDA); exit 1 when a check failed or timed out."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or BENCH / "results" / "gpu_checks"),
        help="where the summary and the archive go (default $OUT, else benchmarks/results/gpu_checks)",
    )
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny versions of every check on the CPU")
    parser.add_argument(
        "--llm-budget-s", type=float, default=75.0, help="training seconds of each llm_60m method (default 75)"
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="every check ends within this many seconds of the start; the llm check trains for what "
        "the others leave (default 540: the device's 10-minute command less the install; "
        "1200 with --cpu-dry-run, where bf16 is emulated)",
    )
    parser.add_argument("--fit-check", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fit_check is not None:  # check 3, in its own process
        harness.write_json(args.fit_check / "fit_check.json", fit_check(args.fit_check, args.cpu_dry_run))
        return 0
    if args.deadline_s is None:
        args.deadline_s = 1200.0 if args.cpu_dry_run else 540.0
    if args.llm_budget_s <= 0 or args.deadline_s <= 0:
        parser.error("--llm-budget-s and --deadline-s must be positive seconds")
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "checks.log", "a") as log_file:

        def log(line: str) -> None:
            stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
            print(stamped, flush=True)
            log_file.write(stamped + "\n")
            log_file.flush()

        if not torch.cuda.is_available() and not args.cpu_dry_run:
            log("no CUDA device: skipped (torch.cuda.is_available() is False); --cpu-dry-run tests the plumbing")
            harness.write_json(args.out / "summary.json", {"skipped": True, "machine": harness.machine_info()})
            return 0
        status = run_checks(args.out, args.cpu_dry_run, args.llm_budget_s, args.deadline_s, log)
    print("\n" + (args.out / "summary.md").read_text())
    return 0 if all(s["status"] == "ok" for s in status.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
