"""Packed dropout masks against torch's dropout: the six-encoder's dropout sites, forward + backward.

``comera_lightning.nn.dropout`` draws four 16-bit lanes per 64-bit random number and keeps a ``bool`` mask;
torch's CPU dropout draws a float per element and keeps a float mask. Timed interleaved in one process
(``harness.interleave``) at the shapes where the six-encoder (``configs/mnli_6enc.yaml``, batch 32 x 128) drops:
``hidden`` (``nn.Dropout`` vs ``PackedDropout`` on (32, 128, 768)) and ``attention`` (SDPA with ``dropout_p``,
its math path on a CPU, vs ``attention(packed_masks=True)``, 12 heads of 64, a key mask; and SDPA without
dropout for scale). Then the masking op alone at both shapes, the one pass packed dropout makes over its input in
each direction: ``where(keep, x, 0)`` against ``x * keep`` (both then scaled in place), which decides which one
``nn.dropout`` uses. Writes ``dropout.json``.

    python benchmarks/bench_dropout.py                 # batch 32, run alone
    python benchmarks/bench_dropout.py --quick         # smoke run
"""

from __future__ import annotations

import harness
import torch
import torch.nn.functional as F
from torch import nn

from comera_lightning.nn.dropout import PackedDropout, attention


def hidden_candidates(batch: int, seq_len: int, d_model: int, p: float) -> dict:
    """``nn.Dropout`` and ``PackedDropout`` on hidden states."""
    x = torch.randn(batch, seq_len, d_model, requires_grad=True)
    upstream = torch.randn(batch, seq_len, d_model)
    return {
        name: harness.backward_step(lambda layer=layer: layer(x), [x], upstream)
        for name, layer in (("torch", nn.Dropout(p)), ("packed", PackedDropout(p)))
    }


def attention_candidates(batch: int, seq_len: int, heads: int, head_dim: int, p: float) -> dict:
    """SDPA with dropout, packed-mask attention, and SDPA without dropout, on padded sequences."""
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, requires_grad=True) for _ in range(3))
    key_mask = torch.ones(batch, 1, 1, seq_len, dtype=torch.bool)
    key_mask[::2, ..., seq_len * 3 // 4 :] = False  # half the sequences padded, as real batches are
    upstream = torch.randn(batch, heads, seq_len, head_dim)
    return {
        name: harness.backward_step(fn, [q, k, v], upstream)
        for name, fn in (
            ("torch", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=p)),
            ("packed", lambda: attention(q, k, v, attn_mask=key_mask, dropout_p=p, packed_masks=True)),
            ("no dropout", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)),
        )
    }


def masking_candidates(shape: tuple[int, ...], p: float) -> dict:
    """The two ways to apply a ``bool`` keep mask and its scale to a tensor of ``shape``."""
    x = torch.randn(shape)
    keep = torch.rand(shape) >= p
    scale = 1.0 / (1.0 - p)
    return {
        "where": lambda: torch.where(keep, x, 0.0).mul_(scale),
        "mul": lambda: x.mul(keep).mul_(scale),
    }


def main(argv: list[str] | None = None) -> int:
    """Time both sites, print the table, write ``dropout.json``."""
    parser = harness.bench_parser(__doc__, repeats=(1, 8))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--p", type=float, default=0.1)
    args = harness.parse(parser, argv)
    batch, seq_len = (2, 16) if args.quick else (args.batch, 128)
    sites = {
        "hidden (B, 128, 768)": hidden_candidates(batch, seq_len, 768, args.p),
        "attention (B, 12, 128, 128)": attention_candidates(batch, seq_len, 12, 64, args.p),
    }
    results, rows = [], []
    for site, cands in sites.items():
        timing = harness.interleave(cands, min_sample_s=0.05, **harness.timing_options(args))
        med = {name: timing.median(name) for name in cands}
        results.append({"site": site, "median_s": med, "timing": timing.summary()})
        rows.append(
            [
                site,
                harness.ms(med["torch"]),
                harness.ms(med["packed"]),
                harness.ms(med["no dropout"]) if "no dropout" in med else "-",
                harness.times(med["torch"] / med["packed"]),
            ]
        )
    print(f"### dropout p={args.p}, batch {batch} x {seq_len}, forward + backward\n")
    print(harness.table(["site", "torch ms", "packed ms", "without dropout ms", "torch / packed"], rows))
    masking, masking_rows = [], []
    for shape in ((batch, 12, seq_len, seq_len), (batch, seq_len, 768)):
        timing = harness.interleave(
            masking_candidates(shape, args.p), min_sample_s=0.05, **harness.timing_options(args)
        )
        med = {name: timing.median(name) for name in ("where", "mul")}
        masking.append({"shape": list(shape), "median_s": med, "timing": timing.summary()})
        masking_rows.append(
            [
                str(tuple(shape)),
                harness.ms(med["where"]),
                harness.ms(med["mul"]),
                harness.times(med["where"] / med["mul"]),
            ]
        )
    print("\n### the masking op alone (one direction)\n")
    print(harness.table(["shape", "where ms", "mul ms", "where / mul"], masking_rows))
    harness.emit(
        args.out_dir / "dropout.json",
        {
            "p": args.p,
            "batch": batch,
            "seq_len": seq_len,
            "results": results,
            "masking": masking,
            "machine": harness.machine_info(),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
