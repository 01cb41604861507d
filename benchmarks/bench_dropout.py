"""Packed dropout masks against torch's dropout: the six-encoder's dropout sites, forward + backward.

``comera_lightning.nn.dropout`` draws four 16-bit lanes per 64-bit random number and keeps a ``bool`` mask;
torch's CPU dropout draws a float per element (``bernoulli_``) and keeps a float mask. This times,
interleaved in one process (``harness.interleave``), forward + backward of both at the shapes where the
six-encoder model (``configs/mnli_6enc.yaml``, batch 32 x 128) drops:

- ``hidden``: ``nn.Dropout`` vs ``PackedDropout`` on ``(32, 128, 768)`` (embeddings and both residual branches);
- ``attention``: ``F.scaled_dot_product_attention`` with ``dropout_p`` (its math path on a CPU) vs
  ``comera_lightning.nn.dropout.attention(packed_masks=True)``, 12 heads of 64 over 128 keys with a key mask,
  and the same attention without dropout (the flash kernel) for scale.

    python benchmarks/bench_dropout.py                 # batch 32, run alone
    python benchmarks/bench_dropout.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from comera_lightning.nn.dropout import PackedDropout, attention  # noqa: E402


def hidden_candidates(batch: int, seq_len: int, d_model: int, p: float) -> dict:
    x = torch.randn(batch, seq_len, d_model, requires_grad=True)
    upstream = torch.randn(batch, seq_len, d_model)
    torch_layer, packed_layer = nn.Dropout(p), PackedDropout(p)

    def step(layer: nn.Module) -> None:
        x.grad = None
        layer(x).backward(upstream)

    return {"torch": lambda: step(torch_layer), "packed": lambda: step(packed_layer)}


def attention_candidates(batch: int, seq_len: int, heads: int, head_dim: int, p: float) -> dict:
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, requires_grad=True) for _ in range(3))
    key_mask = torch.ones(batch, 1, 1, seq_len, dtype=torch.bool)
    key_mask[::2, ..., seq_len * 3 // 4:] = False  # half the sequences padded, as real batches are
    upstream = torch.randn(batch, heads, seq_len, head_dim)

    def step(fn) -> None:
        for t in (q, k, v):
            t.grad = None
        fn().backward(upstream)

    return {
        "torch": lambda: step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=p)),
        "packed": lambda: step(lambda: attention(q, k, v, attn_mask=key_mask, dropout_p=p, packed_masks=True)),
        "no dropout": lambda: step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-other-load", type=float, default=0.15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batch, seq_len, repeats = (2, 16, 1) if args.quick else (args.batch, 128, args.repeats)
    sites = {"hidden (B, 128, 768)": hidden_candidates(batch, seq_len, 768, args.p),
             "attention (B, 12, 128, 128)": attention_candidates(batch, seq_len, 12, 64, args.p)}
    results, rows = [], []
    for site, cands in sites.items():
        timing = harness.interleave(cands, repeats=repeats, min_sample_s=0.05, max_other_load=args.max_other_load)
        med = {name: timing.median(name) for name in cands}
        results.append({"site": site, "median_s": med, "timing": timing.summary()})
        rows.append([site, harness.ms(med["torch"]), harness.ms(med["packed"]),
                     harness.ms(med["no dropout"]) if "no dropout" in med else "-",
                     harness.times(med["torch"] / med["packed"])])
    print(f"### dropout p={args.p}, batch {batch} x {seq_len}, forward + backward\n")
    print(harness.table(["site", "torch ms", "packed ms", "without dropout ms", "torch / packed"], rows))
    path = harness.write_json(args.out_dir / "dropout.json", {"p": args.p, "batch": batch, "seq_len": seq_len,
                                                               "results": results, "machine": harness.machine_info()})
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
