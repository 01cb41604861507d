"""TT-matrix embedding lookup: optimised half-merge vs the plain per-row chain vs nn.Embedding.

Run from the repository root::

    python benchmarks/bench_embedding_lookup.py            # full run: rank 32 x 3 id distributions, ranks 8/64 on Zipf
    python benchmarks/bench_embedding_lookup.py --quick    # rank 32, uniform + Zipf ids, about 20-30 s
    python benchmarks/bench_embedding_lookup.py --ranks 32 --distributions zipf stdlib --threads 2
    python benchmarks/bench_embedding_lookup.py --wait-quiet 60 --out-dir /tmp/emb   # on a shared machine

The table is the paper's word embedding: 30522 x 768 as a ``TTEmbedding`` with the paper's modes
(vocab 16*20*10*10 = 32000 >= 30522, dim 4*4*8*6; ``paper_embedding_modes``) at rank 32
(``configs/mnli_6enc.yaml``'s ``embedding_rank``), looked up for a batch of 32 x 128 token ids.

Candidates, all reading the same table:

* ``ttm+dedup``: ``comera_lightning.tt.ttm_lookup(cores, ids, deduplicate=True)``: half-merge lookup of
  each distinct id once, scattered back with ``index_select``;
* ``ttm``: the same without deduplication (what ``TTEmbedding(deduplicate=False)`` does);
* ``chain``: ``ttm_lookup_chain``, the plain per-row lookup: gather one slice of every core per token
  and multiply along the chain;
* ``nn.Embedding``: a dense 30522 x 768 table (initialised with the TT table's rows).

TT candidates start from ``layer.gated_cores()`` (gates folded in, as ``TTEmbedding.forward`` does), so
one step includes that batch-free work. Before timing, every candidate's rows are checked against the
dense reconstruction of the TT table (``max_rel_err`` in the JSON), and the TT candidates' core and gate
gradients against each other.

Id distributions (seeded): ``uniform`` over the vocabulary (few repeats: dedup can only lose);
``zipf`` (text-like power law, exponent ``--zipf-exponent`` 1.1, frequency ranks mapped to ids by a
seeded permutation); ``stdlib``: real token ids, 32 rows of the code-MLM corpus (the Python standard
library's validation files, byte-level BPE trained with ``vocab_size=30522`` by ``CodeMLMDataModule``,
cached under ``--cache-dir``; about 12 s the first time, then about 1 s).

Measured per case (rank x distribution), interleaved round by round with ``harness.interleave``
(contended rounds left out and retried, ratios of medians):

* forward: one lookup under ``torch.no_grad()``;
* forward+backward: grads set to None, lookup, ``rows.backward(g)`` with a fixed random ``g``, i.e. the
  gradient of ``sum(rows * g)`` into every core and gate (nn.Embedding: into its dense weight);
* peak memory of one forward+backward step (``harness.peak_memory``: live tensor bytes measured by
  MemTracker, parameters and gradients included) and of one forward (no grad).

Targets (issue 6): the optimised lookup at least 5x faster and 3x lighter than the plain chain (forward+
backward, at the paper's rank). Where a target is missed, both lookups are profiled
(``torch.profiler`` key averages, top ops by self CPU time) and the profile goes to stdout and JSON;
``--profile`` profiles always.

Output: markdown tables (times, memory, ratios, verdicts) on stdout; ``embedding_lookup.json`` (machine,
settings, every sample and round) and ``embedding_lookup.png`` (grouped bars) in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

import harness
from harness import interleave, mib, ms, peak_memory, table, times

from comera_lightning.models.transformer import paper_embedding_modes
from comera_lightning.nn import TTEmbedding
from comera_lightning.tt.cores import ttm_to_dense
from comera_lightning.tt.ttm import ttm_lookup, ttm_lookup_chain

VOCAB, DIM = 30522, 768
PAPER_RANK = 32
BATCH, SEQ_LEN = 32, 128
DISTRIBUTIONS = ("uniform", "zipf", "stdlib")
TT_NAMES = ("ttm+dedup", "ttm", "chain")
NAMES = (*TT_NAMES, "nn.Embedding")
OPTIMISED = ("ttm+dedup", "ttm")
TARGET_SPEEDUP, TARGET_MEMORY = 5.0, 3.0
# (rank, distribution) cases: the paper's rank on every distribution, a rank sweep on text-like ids
FULL_CASES = [*((PAPER_RANK, d) for d in DISTRIBUTIONS), (8, "zipf"), (64, "zipf")]
QUICK_CASES = [(PAPER_RANK, "uniform"), (PAPER_RANK, "zipf")]


# ------------------------------------------------------------------------------------------------------
# token ids


def zipf_ids(vocab: int, shape: Sequence[int], exponent: float, seed: int) -> torch.Tensor:
    """Ids with P(frequency rank k) ~ 1 / k**exponent; ranks are mapped to ids by a seeded permutation."""
    if exponent <= 0:
        raise ValueError(f"the Zipf exponent must be > 0, got {exponent}")
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-exponent)
    ranks = torch.multinomial(weights, math.prod(shape), replacement=True, generator=g)
    return torch.randperm(vocab, generator=g)[ranks].reshape(*shape)


def stdlib_ids(vocab: int, batch: int, seq_len: int, seed: int, cache_dir: str,
               root: str | None = None) -> torch.Tensor:
    """``batch`` seeded rows of real BPE token ids of the Python standard library (code-MLM corpus).

    The tokenizer is ``CodeMLMDataModule``'s (trained on the training files with ``vocab_size=vocab``,
    cached); the rows come from the validation files (all files if those are too short). ``root``: another
    folder of ``*.py`` files instead of the standard library (tests).
    """
    from comera_lightning.data.code_mlm import CodeMLMDataModule, chunk_stream
    from comera_lightning.data.tokenizer import encode_texts

    dm = CodeMLMDataModule(root=root, vocab_size=vocab, seq_len=seq_len, cache_dir=cache_dir, seed=seed)
    special = dm.special_ids
    train, val = dm.split_files()
    rows = torch.zeros(0, seq_len, dtype=torch.long)
    for files in (val, val + train):
        texts = [(dm.corpus_root / rel).read_bytes().decode("utf-8", errors="replace") for rel in files]
        docs = encode_texts(dm.tokenizer, texts)
        rows = chunk_stream(docs, seq_len, cls_id=special.cls, sep_id=special.sep, pad_id=special.pad)
        if len(rows) > batch:
            break
    if len(rows) < batch:
        raise ValueError(f"the standard library gives only {len(rows)} rows of {seq_len} tokens, need {batch}")
    pick = torch.randperm(len(rows) - 1, generator=torch.Generator().manual_seed(seed))[:batch]  # last row is padded
    return rows[pick.sort().values].long()


def make_ids(distribution: str, vocab: int, batch: int, seq_len: int, seed: int, zipf_exponent: float,
             cache_dir: str) -> torch.Tensor:
    """A ``(batch, seq_len)`` int64 id tensor drawn from ``distribution`` (one of ``DISTRIBUTIONS``)."""
    if distribution == "uniform":
        return torch.randint(vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    if distribution == "zipf":
        return zipf_ids(vocab, (batch, seq_len), zipf_exponent, seed)
    if distribution == "stdlib":
        return stdlib_ids(vocab, batch, seq_len, seed, cache_dir)
    raise ValueError(f"unknown id distribution {distribution!r}; choose from {', '.join(DISTRIBUTIONS)}")


# ------------------------------------------------------------------------------------------------------
# candidates


@dataclass(frozen=True)
class Shape:
    """The table and the batch: ``vocab x dim`` with TT-matrix modes, ``batch x seq_len`` ids."""

    vocab: int = VOCAB
    dim: int = DIM
    vocab_modes: tuple[int, ...] | None = None
    dim_modes: tuple[int, ...] | None = None
    batch: int = BATCH
    seq_len: int = SEQ_LEN

    def modes(self) -> tuple[list[int] | None, list[int] | None]:
        if self.vocab_modes is not None or self.dim_modes is not None:
            return (list(self.vocab_modes) if self.vocab_modes else None,
                    list(self.dim_modes) if self.dim_modes else None)
        return paper_embedding_modes(self.vocab, self.dim)


@dataclass
class Candidates:
    """Zero-argument steps per candidate (forward and forward+backward) and what they read and write."""

    layer: TTEmbedding
    dense: torch.nn.Embedding
    ids: torch.Tensor
    forward: dict[str, Callable[[], torch.Tensor]]
    train: dict[str, Callable[[], None]]
    modules: dict[str, torch.nn.Module]


def build_candidates(shape: Shape, rank: int, ids: torch.Tensor, seed: int) -> Candidates:
    """The TT table at ``rank``, a dense nn.Embedding holding the same rows, and the four candidates' steps."""
    torch.manual_seed(seed)
    vocab_modes, dim_modes = shape.modes()
    layer = TTEmbedding(shape.vocab, shape.dim, rank, vocab_modes=vocab_modes, dim_modes=dim_modes)
    with torch.no_grad():
        table_rows = ttm_to_dense(layer.gated_cores())[: shape.vocab]
    dense = torch.nn.Embedding.from_pretrained(table_rows.clone(), freeze=False)
    flat = ids.reshape(-1)
    row_modes = list(layer.vocab_modes)
    grad_out = torch.randn(flat.numel(), shape.dim, generator=torch.Generator().manual_seed(seed + 1))

    lookups: dict[str, Callable[[], torch.Tensor]] = {
        "ttm+dedup": lambda: ttm_lookup(layer.gated_cores(), flat, deduplicate=True),
        "ttm": lambda: ttm_lookup(layer.gated_cores(), flat, deduplicate=False),
        "chain": lambda: ttm_lookup_chain(layer.gated_cores(), flat, row_modes),
        "nn.Embedding": lambda: F.embedding(flat, dense.weight),
    }
    modules = {name: (dense if name == "nn.Embedding" else layer) for name in lookups}

    def forward_step(lookup: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.no_grad():
                return lookup()

        return run

    def train_step(lookup: Callable[[], torch.Tensor], module: torch.nn.Module) -> Callable[[], None]:
        params = list(module.parameters())

        def run() -> None:
            for p in params:  # zero_grad(set_to_none=True): every step allocates its gradients afresh
                p.grad = None
            lookup().backward(grad_out)

        return run

    return Candidates(
        layer=layer, dense=dense, ids=ids,
        forward={n: forward_step(f) for n, f in lookups.items()},
        train={n: train_step(f, modules[n]) for n, f in lookups.items()},
        modules=modules,
    )


def check_agreement(cands: Candidates) -> dict:
    """Max relative errors: every candidate's rows against the dense TT table, TT gradients against ``ttm``."""
    flat = cands.ids.reshape(-1)
    with torch.no_grad():
        reference = ttm_to_dense(cands.layer.gated_cores())[flat]
    scale = reference.abs().max().item() or 1.0
    rows = {n: ((f() - reference).abs().max().item() / scale) for n, f in cands.forward.items()}
    grads: dict[str, list[torch.Tensor]] = {}
    for name in TT_NAMES:
        cands.train[name]()
        grads[name] = [p.grad.clone() for p in cands.layer.parameters()]
    grad_err = {}
    for name in TT_NAMES:
        errs = [(a - b).abs().max().item() / (b.abs().max().item() or 1.0) for a, b in zip(grads[name], grads["ttm"])]
        grad_err[name] = max(errs)
    return {"rows_max_rel_err_vs_dense_table": rows, "grads_max_rel_err_vs_ttm": grad_err}


# ------------------------------------------------------------------------------------------------------
# measurement


def profile_steps(steps: dict[str, Callable[[], object]], iterations: int = 3, top: int = 8) -> dict:
    """Top ops by self CPU time over ``iterations`` steps of each candidate (torch.profiler key averages)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, step in steps.items():
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(iterations):
                step()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) or 1.0
        out[name] = {
            "self_cpu_ms_per_step_total": total / 1e3 / iterations,
            "top_ops": [
                {"op": e.key, "calls_per_step": e.count / iterations,
                 "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / iterations,
                 "share": e.self_cpu_time_total / total}
                for e in events[:top]
            ],
        }
    return out


def run_case(shape: Shape, rank: int, distribution: str, ids: torch.Tensor, *, repeats: int, min_sample_s: float,
             max_other_load: float, wait_quiet_s: float, seed: int, profile: bool) -> dict:
    """One (rank, distribution) case: agreement check, interleaved fwd and fwd+bwd timing, peak memory."""
    cands = build_candidates(shape, rank, ids, seed)
    agreement = check_agreement(cands)
    kw = dict(repeats=repeats, min_sample_s=min_sample_s, max_other_load=max_other_load,
              wait_quiet_s=wait_quiet_s, seed=seed)
    fwd = interleave(cands.forward, **kw)
    train = interleave(cands.train, **kw)
    memory, memory_fwd = {}, {}
    for name in NAMES:
        cands.train[name]()  # steady state: gradients of the previous step exist, as in training
        memory[name] = peak_memory(cands.train[name], modules=[cands.modules[name]])
        for p in cands.modules[name].parameters():  # inference: no gradients lying around
            p.grad = None
        memory_fwd[name] = peak_memory(cands.forward[name], modules=[cands.modules[name]])
    flat = ids.reshape(-1)
    unique = int(torch.unique(flat).numel())
    mem = {n: memory[n]["total"] for n in NAMES}
    ratios = {
        "chain_over_ttm_dedup_time_train": train.ratio("chain", "ttm+dedup"),
        "chain_over_ttm_time_train": train.ratio("chain", "ttm"),
        "chain_over_ttm_dedup_time_fwd": fwd.ratio("chain", "ttm+dedup"),
        "chain_over_ttm_time_fwd": fwd.ratio("chain", "ttm"),
        "chain_over_ttm_dedup_memory": mem["chain"] / mem["ttm+dedup"],
        "chain_over_ttm_memory": mem["chain"] / mem["ttm"],
        "ttm_over_ttm_dedup_time_train": train.ratio("ttm", "ttm+dedup"),
        "ttm_over_ttm_dedup_time_fwd": fwd.ratio("ttm", "ttm+dedup"),
        "ttm_over_ttm_dedup_memory": mem["ttm"] / mem["ttm+dedup"],
        "embedding_over_ttm_dedup_time_train": train.ratio("nn.Embedding", "ttm+dedup"),
        "embedding_over_ttm_dedup_time_fwd": fwd.ratio("nn.Embedding", "ttm+dedup"),
        "embedding_over_ttm_dedup_memory": mem["nn.Embedding"] / mem["ttm+dedup"],
        "embedding_over_ttm_time_train": train.ratio("nn.Embedding", "ttm"),
        "embedding_over_ttm_memory": mem["nn.Embedding"] / mem["ttm"],
    }
    result = {
        "rank": rank,
        "ranks": cands.layer.ranks,
        "distribution": distribution,
        "tokens": flat.numel(),
        "unique_ids": unique,
        "agreement": agreement,
        "time_forward": fwd.summary(),
        "time_train": train.summary(),
        "noise_forward": fwd.noise_cell(),
        "noise_train": train.noise_cell(),
        "contended": fwd.contended or train.contended,
        "memory_train_bytes": memory,
        "memory_forward_bytes": memory_fwd,
        "ratios": ratios,
        "paired_chain_over_ttm_dedup_train": train.paired_ratios("chain", "ttm+dedup"),
    }
    if profile:
        result["profile_train"] = profile_steps({n: cands.train[n] for n in ("ttm+dedup", "ttm", "chain")})
    return result


# ------------------------------------------------------------------------------------------------------
# verdicts and reporting


def evaluate_targets(results: list[dict], paper_rank: int) -> dict:
    """Optimised (dedup and plain) vs chain at the paper's rank, per distribution: >= 5x time, >= 3x memory."""
    rows = []
    for r in results:
        if r["rank"] != paper_rank:
            continue
        for variant, key in (("ttm+dedup", "ttm_dedup"), ("ttm", "ttm")):
            speed = r["ratios"][f"chain_over_{key}_time_train"]
            memory = r["ratios"][f"chain_over_{key}_memory"]
            rows.append({"distribution": r["distribution"], "variant": variant, "speedup": speed,
                         "memory_ratio": memory, "speed_met": speed >= TARGET_SPEEDUP,
                         "memory_met": memory >= TARGET_MEMORY, "contended": r["contended"]})
    best = {}
    for row in rows:  # per distribution, the better optimised variant (dedup is a switch users choose)
        cur = best.get(row["distribution"])
        if cur is None or row["speedup"] > cur["speedup"]:
            best[row["distribution"]] = row
    return {
        "target_speedup": TARGET_SPEEDUP,
        "target_memory_ratio": TARGET_MEMORY,
        "rank": paper_rank,
        "measured_on": "forward+backward time, peak memory of forward+backward",
        "cases": rows,
        "speed_met": bool(rows) and all(b["speed_met"] for b in best.values()),
        "memory_met": bool(rows) and all(b["memory_met"] for b in best.values()),
        "dedup_speed_met_everywhere": bool(rows) and all(r["speed_met"] for r in rows if r["variant"] == "ttm+dedup"),
    }


def explain_profile(profile: dict) -> list[str]:
    """One line per profiled candidate: its top three ops and their share of self CPU time."""
    lines = []
    for name, p in profile.items():
        top = ", ".join(f"{o['op']} {o['share']:.0%} ({o['self_cpu_ms_per_step']:.2f} ms, "
                        f"{o['calls_per_step']:g} calls)" for o in p["top_ops"][:3])
        lines.append(f"- {name}: {p['self_cpu_ms_per_step_total']:.1f} ms self CPU per step; top ops: {top}")
    return lines


def render(results: list[dict], targets: dict, meta: dict) -> str:
    """The markdown report: per-case times and memory, ratios, target verdicts (and profiles if any)."""
    out = [
        f"# TTM embedding lookup ({meta['vocab']} x {meta['dim']}, modes {meta['vocab_modes']} x {meta['dim_modes']}, "
        f"ids {meta['batch']} x {meta['seq_len']}, fp32, CPU, {meta['threads']} threads)",
        "",
        "Times: medians over interleaved rounds (ms); fwd = one lookup without grad; train = lookup + backward "
        "into every core and gate (nn.Embedding: its dense weight). Memory: peak live tensor bytes of one "
        "forward+backward (MemTracker; parameters and gradients included), MiB. `rounds`: clean/total rounds "
        "(median load of other processes), `!` = contended.",
        "",
        "## Times and memory",
        "",
    ]
    rows = []
    for r in results:
        tf, tt = r["time_forward"]["median_s"], r["time_train"]["median_s"]
        m = r["memory_train_bytes"]
        for name in NAMES:
            rows.append([r["distribution"], r["rank"], f"{r['unique_ids']}/{r['tokens']}", name, ms(tf[name]),
                         ms(tt[name]), mib(m[name]["total"]), mib(m[name]["activations"] + m[name]["temporaries"]),
                         f"{r['agreement']['rows_max_rel_err_vs_dense_table'][name]:.1e}",
                         r["noise_train"] if name == NAMES[0] else ""])
    out.append(table(["ids", "rank", "unique/tokens", "candidate", "fwd ms", "train ms", "peak MiB",
                      "act+temp MiB", "rows rel err", "rounds (train)"], rows))
    out += ["", "## Ratios (x > 1: the second one is better)", ""]
    rows = []
    for r in results:
        q = r["ratios"]
        rows.append([r["distribution"], r["rank"],
                     times(q["chain_over_ttm_dedup_time_fwd"]), times(q["chain_over_ttm_dedup_time_train"]),
                     times(q["chain_over_ttm_dedup_memory"]),
                     times(q["chain_over_ttm_time_train"]), times(q["chain_over_ttm_memory"]),
                     times(q["ttm_over_ttm_dedup_time_train"]), times(q["ttm_over_ttm_dedup_memory"]),
                     times(q["embedding_over_ttm_dedup_time_train"]), times(q["embedding_over_ttm_dedup_memory"])])
    out.append(table(["ids", "rank", "chain/dedup fwd", "chain/dedup train", "chain/dedup mem",
                      "chain/ttm train", "chain/ttm mem", "ttm/dedup train", "ttm/dedup mem",
                      "nn.Emb/dedup train", "nn.Emb/dedup mem"], rows))
    out += ["", f"## Targets (rank {targets['rank']}, forward+backward)", ""]
    contended = [r for r in results if r["contended"]]
    if contended:
        out += [f"WARNING: {len(contended)} case(s) include contended rounds (`!`): rerun them on a quiet machine.", ""]
    if not targets["cases"]:
        out.append(f"(no case at rank {targets['rank']}: no verdict)")
    for c in targets["cases"]:
        out.append(f"- {c['distribution']} ids, {c['variant']}: chain/optimised time {c['speedup']:.2f}x "
                   f"(target {TARGET_SPEEDUP:g}x: {'MET' if c['speed_met'] else 'NOT MET'}), memory "
                   f"{c['memory_ratio']:.2f}x (target {TARGET_MEMORY:g}x: {'MET' if c['memory_met'] else 'NOT MET'})"
                   + (" (contended!)" if c["contended"] else ""))
    if targets["cases"]:
        out.append(f"- Overall (better optimised variant per distribution): speed "
                   f"{'MET' if targets['speed_met'] else 'NOT MET'}, memory {'MET' if targets['memory_met'] else 'NOT MET'}")
    profiled = [r for r in results if "profile_train" in r]
    if profiled:
        out += ["", "## Profiles (forward+backward, top ops by self CPU time)", ""]
        for r in profiled:
            out.append(f"{r['distribution']} ids, rank {r['rank']}:")
            out += explain_profile(r["profile_train"])
    return "\n".join(out)


def plot(results: list[dict], path: Path, paper_rank: int) -> Path:
    """Grouped bars (fwd time, train time, peak train memory) per candidate, per case (ids, rank); log scale."""
    import numpy as np

    main = sorted(results, key=lambda r: (r["rank"] != paper_rank, r["rank"]))  # paper's rank first
    fig, axes = harness.new_figure(3, width=5.0, height=4.0)
    panels = [("forward time (ms)", lambda r, n: r["time_forward"]["median_s"][n] * 1e3),
              ("forward+backward time (ms)", lambda r, n: r["time_train"]["median_s"][n] * 1e3),
              ("peak memory fwd+bwd (MiB)", lambda r, n: r["memory_train_bytes"][n]["total"] / 2**20)]
    x = np.arange(len(main))
    width = 0.8 / len(NAMES)
    for ax, (title, value) in zip(axes, panels):
        for k, name in enumerate(NAMES):
            ax.bar(x + (k - (len(NAMES) - 1) / 2) * width, [value(r, name) for r in main], width, label=name)
        ax.set_xticks(x, [f"{r['distribution']}\nr{r['rank']}" for r in main])
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("TTM embedding lookup (lower is better)")
    return harness.save_figure(fig, path)


def _modes_arg(text: str) -> tuple[int, ...]:
    try:
        modes = tuple(int(v) for v in text.replace("x", ",").split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"modes must be integers separated by commas, e.g. 16,20,10,10; got {text!r}")
    if not modes or any(m < 1 for m in modes):
        raise argparse.ArgumentTypeError(f"modes must be positive integers, got {text!r}")
    return modes


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run every (rank, distribution) case, print tables, write JSON and PNG."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="rank 32, uniform + zipf ids, fewer rounds")
    parser.add_argument("--ranks", nargs="+", type=int, default=None,
                        help="TT ranks; with --ranks or --distributions every rank runs on every distribution "
                             "(default: rank 32 on all three distributions plus ranks 8 and 64 on zipf ids; "
                             "quick: rank 32 on uniform and zipf)")
    parser.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=None,
                        help="id distributions (see --ranks)")
    parser.add_argument("--repeats", type=int, default=None, help="minimum clean rounds (default 5, quick 3)")
    parser.add_argument("--min-sample-ms", type=float, default=None, help="inner loop length (default 20, quick 10)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--max-other-load", type=float, default=0.15,
                        help="leave out (and retry) rounds in which other processes used more than this share "
                             "of all CPUs (default 0.15; 1 disables)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="per timing run, wait up to this long for the machine to go quiet (default 0)")
    parser.add_argument("--zipf-exponent", type=float, default=1.1)
    parser.add_argument("--profile", action="store_true", help="profile every case (default: only on a missed target)")
    parser.add_argument("--vocab-size", type=int, default=VOCAB)
    parser.add_argument("--embedding-dim", type=int, default=DIM)
    parser.add_argument("--vocab-modes", type=_modes_arg, default=None,
                        help="e.g. 16,20,10,10 (default: the paper's for 30522 x 768, else automatic)")
    parser.add_argument("--dim-modes", type=_modes_arg, default=None, help="e.g. 4,4,8,6")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--cache-dir", default=".cache/comera", help="tokenizer cache of the stdlib ids")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args(argv)

    cases = list(QUICK_CASES if args.quick else FULL_CASES)
    if args.ranks or args.distributions:  # explicit choices: every rank on every distribution
        ranks_given = args.ranks or sorted({r for r, _ in cases})
        dists_given = args.distributions or list(dict.fromkeys(d for _, d in cases))
        cases = [(r, d) for r in ranks_given for d in dists_given]
    ranks = list(dict.fromkeys(r for r, _ in cases))
    distributions = list(dict.fromkeys(d for _, d in cases))
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    min_sample_s = (args.min_sample_ms if args.min_sample_ms is not None else (10.0 if args.quick else 20.0)) / 1e3
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    if any(r < 1 for r in ranks):
        parser.error(f"--ranks must be >= 1, got {ranks}")
    if min(args.vocab_size, args.embedding_dim, args.batch, args.seq_len) < 1:
        parser.error("--vocab-size, --embedding-dim, --batch and --seq-len must be >= 1")
    if "stdlib" in distributions and args.seq_len < 3:
        parser.error("--seq-len must be >= 3 for stdlib ids ([CLS] ... [SEP])")
    if args.zipf_exponent <= 0:
        parser.error(f"--zipf-exponent must be > 0, got {args.zipf_exponent}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    shape = Shape(args.vocab_size, args.embedding_dim, args.vocab_modes, args.dim_modes, args.batch, args.seq_len)
    try:  # build once to surface bad modes as a CLI error before any work
        probe = TTEmbedding(shape.vocab, shape.dim, 1, vocab_modes=shape.modes()[0], dim_modes=shape.modes()[1])
    except ValueError as exc:
        parser.error(f"bad table shape/modes: {exc}")
    paper_rank = PAPER_RANK if PAPER_RANK in ranks else ranks[len(ranks) // 2]
    meta = {
        "machine": harness.machine_info(), "vocab": shape.vocab, "dim": shape.dim,
        "vocab_modes": list(probe.vocab_modes), "dim_modes": list(probe.dim_modes),
        "batch": shape.batch, "seq_len": shape.seq_len, "ranks": ranks, "distributions": distributions,
        "repeats": repeats, "min_sample_s": min_sample_s, "max_other_load": args.max_other_load,
        "wait_quiet_s": args.wait_quiet, "zipf_exponent": args.zipf_exponent, "seed": args.seed,
        "quick": args.quick, "threads": torch.get_num_threads(), "dtype": "float32", "verdict_rank": paper_rank,
    }
    started = time.perf_counter()
    ids_by_dist = {}
    for dist in distributions:
        t0 = time.perf_counter()
        try:
            ids_by_dist[dist] = make_ids(dist, shape.vocab, shape.batch, shape.seq_len, args.seed,
                                         args.zipf_exponent, args.cache_dir)
        except (ValueError, OSError) as exc:
            print(f"# {dist} ids unavailable, skipped: {exc}", file=sys.stderr)
            meta.setdefault("skipped_distributions", {})[dist] = str(exc)
            continue
        meta.setdefault("ids_setup_s", {})[dist] = time.perf_counter() - t0
    results = []
    cases = [(rank, dist) for rank, dist in cases if dist in ids_by_dist]
    for i, (rank, dist) in enumerate(cases):
        t0 = time.perf_counter()
        r = run_case(shape, rank, dist, ids_by_dist[dist], repeats=repeats, min_sample_s=min_sample_s,
                     max_other_load=args.max_other_load, wait_quiet_s=args.wait_quiet, seed=args.seed,
                     profile=args.profile)
        r["wall_s"] = time.perf_counter() - t0
        results.append(r)
        print(f"# [{i + 1}/{len(cases)}] rank {rank} {dist}: chain/dedup train "
              f"{r['ratios']['chain_over_ttm_dedup_time_train']:.2f}x, mem {r['ratios']['chain_over_ttm_dedup_memory']:.2f}x "
              f"({r['wall_s']:.1f}s)", file=sys.stderr, flush=True)
    if not results:
        print("no case could run (every id distribution was unavailable)", file=sys.stderr)
        return 1
    targets = evaluate_targets(results, paper_rank)
    missed = not (targets["speed_met"] and targets["memory_met"])
    if missed and not args.profile:  # explain a miss with where the time goes
        for r in results:
            if r["rank"] == paper_rank:
                cands = build_candidates(shape, r["rank"], ids_by_dist[r["distribution"]], args.seed)
                r["profile_train"] = profile_steps({n: cands.train[n] for n in ("ttm+dedup", "ttm", "chain")})
    meta["wall_s"] = time.perf_counter() - started
    print(render(results, targets, meta))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = harness.write_json(args.out_dir / "embedding_lookup.json",
                                   {"meta": meta, "targets": targets, "cases": results})
    png_path = plot(results, args.out_dir / "embedding_lookup.png", paper_rank)
    print(f"\nJSON: {json_path}\nPNG: {png_path}  (wall {meta['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
