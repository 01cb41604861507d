"""One entry point for every benchmark behind docs/results.md.

    python -m benchmarks.run all --quick            # every comparison, small (a few minutes)
    python -m benchmarks.run all                    # what docs/results.md reports (hours on 2 quiet CPU cores;
                                                    # each module says its own time)
    python -m benchmarks.run step --batch 1         # one comparison; arguments after the name go to its module
    python -m benchmarks.run --list

``all`` runs the comparisons one after another (never in parallel: they would disturb each other's timings) and
collects the printed tables in ``<out-dir>/summary.md`` (a single comparison: ``summary_<name>.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks import harness


class Comparison(NamedTuple):
    """A comparison: its module (``benchmarks.<script>``), the arguments it always gets, what it measures."""

    script: str
    fixed_args: tuple[str, ...]
    what: str


COMPARISONS: dict[str, Comparison] = {
    name: Comparison(*entry)
    for name, entry in {
        "step": (
            "bench_training_step",
            ("--part", "step"),
            "training step of the six-encoder transformer: dense+AdamW "
            "vs dense+GaLore vs CoMERA (rank 30, and truncated to 1/4), batch 1 and 32: time, tokens/s, peak memory",
        ),
        "scaling": (
            "bench_training_step",
            ("--part", "scaling"),
            "step time and peak memory against d_model (256..2048), dense vs CoMERA",
        ),
        "lookup": (
            "bench_embedding_lookup",
            (),
            "TTM embedding lookup 30522x768: half-merge (with/without dedup) vs per-row chain vs nn.Embedding",
        ),
        "planner": (
            "bench_tt_linear",
            (),
            "TTLinear contraction planner vs torch.einsum vs tensorly+opt_einsum vs nn.Linear over a grid",
        ),
        "llm": (
            "studies.llm",
            (),
            "LLaMA-style decoder pre-training (configs/llm_cpu.yaml): dense+AdamW vs dense+GaLore vs "
            "CoMERA, same tokens or same training seconds; perplexity, parameters, step time and peak memory",
        ),
        "activation-memory": (
            "bench_activation_memory",
            (),
            "six-encoder peak training memory and step time with and "
            "without activation checkpointing, dense vs CoMERA, batch 32 x 128",
        ),
        "cuda-graphs": ("bench_cuda_graphs", (), "captured vs eager training step on a CUDA GPU (skipped without one)"),
        "compiled": (
            "bench_compiled",
            (),
            "six-encoder training step under torch.compile (in place, as the Compile callback does) vs eager, "
            "dense vs CoMERA, batch 8: time, graph breaks, compile time",
        ),
        "inference": (
            "bench_inference",
            (),
            "decoding with vs without the KV cache (CoMERA 10x vs dense, d_model 512 and "
            "1024, batch 1 and 8) and batch-1/32 forward of the six-encoder and the MLM: TT vs untensorised vs "
            "dense; tokens/s, latency, peak memory",
        ),
        "soak": (
            "bench_soak",
            (),
            "a long training process (20k steps per mode: no logger, MLflow at the configs' rates "
            "and every step, truncations and checkpoints): RSS, Python heap and open files per 10k steps",
        ),
        "text-data": (
            "bench_text_data",
            (),
            "TextLMDataModule at scale: tokenising tokens/s (1 thread vs every core), a "
            "loader epoch at llm_60m shapes against the llm_60m step's demand, peak RSS at 1x and 10x the corpus",
        ),
        "fsdp-memory": (
            "bench_fsdp_memory",
            (),
            "bytes of parameters, gradients and AdamW state per process of the "
            "quickstart MLM under FSDP2 (2 gloo processes) vs 1 process, before and after a cut",
        ),
    }.items()
}


def run_one(name: str, args: list[str]) -> tuple[int, str]:
    """Run comparison ``name`` with extra ``args``; returns its exit code and what it printed."""
    comparison = COMPARISONS[name]
    module = importlib.import_module(f"benchmarks.{comparison.script}")
    captured = io.StringIO()

    class _Tee(io.TextIOBase):
        def write(self, text: str) -> int:
            captured.write(text)
            return sys.__stdout__.write(text)

        def flush(self) -> None:
            sys.__stdout__.flush()

    with contextlib.redirect_stdout(_Tee()):
        code = module.main([*comparison.fixed_args, *args])
    return int(code or 0), captured.getvalue()


def main(argv: list[str] | None = None) -> int:
    """List the comparisons, or run one or all of them and write the summary."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument(
        "comparison",
        nargs="?",
        choices=[*COMPARISONS, "all"],
        help="which comparison to run ('all': every one in turn)",
    )
    parser.add_argument("--list", action="store_true", help="list the comparisons and exit")
    parser.add_argument("--quick", action="store_true", help="small versions (passed on to every script)")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=harness.RESULTS_DIR,
        help="where JSON/PNG/summary.md go (default benchmarks/results)",
    )
    args, rest = parser.parse_known_args(argv)
    if args.list or args.comparison is None:
        for name, comparison in COMPARISONS.items():
            print(
                f"{name:17s} python -m benchmarks.{comparison.script} {' '.join(comparison.fixed_args)}\n"
                f"{'':17s} {comparison.what}"
            )
        return 0 if args.list else 2
    if args.comparison == "all" and rest:
        parser.error(f"'all' takes only --quick and --out-dir; pass {' '.join(rest)} to a single comparison instead")
    common = [*(["--quick"] if args.quick else []), "--out-dir", str(args.out_dir)]
    names = list(COMPARISONS) if args.comparison == "all" else [args.comparison]
    sections = [
        f"# Benchmark summary ({'quick' if args.quick else 'full'})\n",
        "```",
        repr(harness.machine_info()),
        "```",
    ]
    failed = []
    for name in names:
        started = time.perf_counter()
        print(f"\n## {name}: {COMPARISONS[name].what}\n", flush=True)
        code, printed = run_one(name, [*common, *rest])
        elapsed = time.perf_counter() - started
        sections += [f"\n## {name} ({elapsed:.0f} s, exit {code})\n", printed]
        if code != 0:
            failed.append(name)
    summary = args.out_dir / ("summary.md" if args.comparison == "all" else f"summary_{args.comparison}.md")
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text("\n".join(sections))
    print(f"\nsummary: {summary}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
