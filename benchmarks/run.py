"""One entry point for every benchmark behind docs/results.md.

    python -m benchmarks.run all --quick            # every comparison, small (a few minutes)
    python -m benchmarks.run all                    # what docs/results.md reports (each module says its own time)
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
    """A comparison: its module (``benchmarks.<script>``) and what it measures."""

    script: str
    what: str


COMPARISONS: dict[str, Comparison] = {
    "step": Comparison(
        "bench_training_step",
        "training step of the six-encoder transformer: dense+AdamW vs dense+GaLore vs CoMERA (rank 30), batch 1 and "
        "32: time, tokens/s, peak memory",
    ),
    "planner": Comparison(
        "bench_tt_linear",
        "TTLinear contraction planner vs torch.einsum vs tensorly+opt_einsum vs nn.Linear over a grid",
    ),
    "cuda-graphs": Comparison(
        "bench_cuda_graphs", "captured vs eager training step on a CUDA GPU (skipped without one)"
    ),
    "compiled": Comparison(
        "bench_compiled",
        "six-encoder training step under torch.compile (in place, as the Compile callback does) vs eager, dense vs "
        "CoMERA, batch 8: time, graph breaks, compile time",
    ),
    "inference": Comparison(
        "bench_inference",
        "decoding with vs without the KV cache (CoMERA 10x vs dense, d_model 512 and 1024, batch 1 and 8) and "
        "batch-1/32 forward of the six-encoder and the MLM: TT vs untensorised vs dense",
    ),
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
        code = module.main(args)
    return int(code or 0), captured.getvalue()


def main(argv: list[str] | None = None) -> int:
    """List the comparisons, or run one or all of them and write the summary."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("comparison", nargs="?", choices=[*COMPARISONS, "all"], help="which one ('all': each in turn)")
    parser.add_argument("--list", action="store_true", help="list the comparisons and exit")
    parser.add_argument("--quick", action="store_true", help="small versions (passed on to every script)")
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR, help="where JSON/PNG/summary.md go")
    args, rest = parser.parse_known_args(argv)
    if args.list or args.comparison is None:
        for name, comparison in COMPARISONS.items():
            command = f"python -m benchmarks.{comparison.script}"
            print(f"{name:17s} {command}\n{'':17s} {comparison.what}")
        return 0 if args.list else 2
    if args.comparison == "all" and rest:
        parser.error(f"'all' takes only --quick and --out-dir; pass {' '.join(rest)} to a single comparison instead")
    common = [*(["--quick"] if args.quick else []), "--out-dir", str(args.out_dir)]
    names = list(COMPARISONS) if args.comparison == "all" else [args.comparison]
    sections = [f"# Benchmark summary ({'quick' if args.quick else 'full'})\n", f"```\n{harness.machine_info()!r}\n```"]
    failed = []
    for name in names:
        started = time.perf_counter()
        print(f"\n## {name}: {COMPARISONS[name].what}\n", flush=True)
        code, printed = run_one(name, [*common, *rest])
        sections += [f"\n## {name} ({time.perf_counter() - started:.0f} s, exit {code})\n", printed]
        if code != 0:
            failed.append(name)
    summary = args.out_dir / ("summary.md" if args.comparison == "all" else f"summary_{args.comparison}.md")
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text("\n".join(sections))
    print(f"\nsummary: {summary}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
