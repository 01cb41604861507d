"""Parameter counts of the paper's six-encoder MNLI model, CoMERA (TT) against its dense twin.

Per layer type and in total (TT sizes from ``size_report``), and the core parameters of one fc1, fc2, attention
projection and the word embedding counted by hand from METHOD.md section 2, asserted equal to the layers' own.
Construction only: a few seconds.

    python benchmarks/param_counts.py [--json]
"""

from __future__ import annotations

import argparse
import json
import re

import harness
import torch
from torch import nn

from comera_lightning.models import SequenceClassifier
from comera_lightning.nn import size_report

PAPER = dict(
    vocab_size=30522,
    num_classes=3,
    d_model=768,
    num_heads=12,
    d_ff=3072,
    num_layers=6,
    max_len=128,
    type_vocab_size=2,
    layer_config=dict(rank=30, embedding_rank=32),
)

# layer type -> regex on the qualified module name
LAYER_TYPES = {
    "word embedding": r"^encoder\.embeddings\.word_embeddings$",
    "position embedding": r"^encoder\.embeddings\.position_embeddings$",
    "token-type embedding": r"^encoder\.embeddings\.token_type_embeddings$",
    "attention q/k/v/out": r"^encoder\.layers\.\d+\.attention\.(query|key|value|output)$",
    "FFN fc1": r"^encoder\.layers\.\d+\.fc1$",
    "FFN fc2": r"^encoder\.layers\.\d+\.fc2$",
    "pooler": r"^pooler$",
    "classifier": r"^classifier$",
    "LayerNorms": r"norm$",
}


def train_params(modes: list[int], ranks: list[int]) -> int:
    """sum_k r_{k-1} * s_k * r_k, written out so the benchmark does not trust the library's own count."""
    assert len(ranks) == len(modes) + 1 and ranks[0] == ranks[-1] == 1
    return sum(ranks[k] * modes[k] * ranks[k + 1] for k in range(len(modes)))


# (layer, example module name, core sizes s_k, ranks) from METHOD.md section 2; TTM core size = v_k * e_k.
HAND = [
    ("FFN fc1", "encoder.layers.0.fc1", [12, 8, 8, 12, 16, 16], [1, 12, 30, 30, 30, 16, 1]),
    ("FFN fc2", "encoder.layers.0.fc2", [16, 16, 12, 8, 8, 12], [1, 16, 30, 30, 30, 12, 1]),
    ("attention q/k/v/out", "encoder.layers.0.attention.query", [12, 8, 8, 8, 8, 12], [1, 12, 30, 30, 30, 12, 1]),
    ("word embedding", "encoder.embeddings.word_embeddings", [16 * 4, 20 * 4, 10 * 8, 10 * 6], [1, 32, 32, 32, 1]),
]


def build(tt: bool) -> nn.Module:
    """The paper's classifier, TT (``tt``) or dense, seeded."""
    torch.manual_seed(0)
    return SequenceClassifier(**dict(PAPER, layer_config=dict(PAPER["layer_config"], tt_linears=tt, tt_embeddings=tt)))


def collect() -> dict:
    """All numbers of the report; raises AssertionError when a hand count disagrees with the model."""
    tt_model, dense_model = build(True), build(False)
    report = size_report(tt_model)
    tt_core = {layer.name: layer.active_parameters for layer in report.layers}
    gate_ids = {id(g) for _, m in tt_model.named_modules() for g in getattr(m, "gates", [])}

    def tt_size(name: str, module: nn.Module) -> int:
        # active cores (when TT) plus every other parameter of the module (bias, LayerNorm), gates excluded
        others = sum(p.numel() for p in module.parameters() if id(p) not in gate_ids)
        if name in tt_core:
            others -= sum(c.numel() for c in module.cores)
            return tt_core[name] + others
        return others

    tt_modules = dict(tt_model.named_modules())
    dense_modules = dict(dense_model.named_modules())
    rows = []
    for kind, pattern in LAYER_TYPES.items():
        names = [n for n in dense_modules if n and re.search(pattern, n)]
        dense = sum(sum(p.numel() for p in dense_modules[n].parameters()) for n in names)
        tt = sum(tt_size(n, tt_modules[n]) for n in names)
        rows.append(
            {
                "layer_type": kind,
                "modules": len(names),
                "tt_modules": sum(n in tt_core for n in names),
                "dense_parameters": dense,
                "tt_parameters": tt,
                "compression": dense / tt,
            }
        )

    dense_total = sum(p.numel() for p in dense_model.parameters())
    tt_total = report.active_parameters
    assert sum(r["dense_parameters"] for r in rows) == dense_total, "layer types do not cover the dense model"
    assert sum(r["tt_parameters"] for r in rows) == tt_total, "layer types do not cover the TT model"
    assert report.dense_equivalent_parameters == dense_total, "size_report's dense equivalent != the dense twin"
    tt_layer_dense = sum(layer.dense_parameters for layer in report.layers)
    tt_layer_active = sum(layer.active_parameters for layer in report.layers)

    hand = []
    for kind, name, sizes, ranks in HAND:
        layer = tt_modules[name]
        by_hand = train_params(sizes, ranks)
        assert layer.ranks == ranks, f"{name}: ranks {layer.ranks}, METHOD.md says {ranks}"
        assert layer.active_parameters() == by_hand == tt_core[name], (
            f"{name}: the layer reports {layer.active_parameters()} core parameters, the hand count is {by_hand}"
        )
        modes = (
            f"{layer.in_modes} -> {layer.out_modes}"
            if hasattr(layer, "in_modes")
            else f"{layer.vocab_modes} x {layer.dim_modes}"
        )
        hand.append(
            {
                "layer": kind,
                "example": name,
                "modes": modes,
                "ranks": ranks,
                "hand_count": by_hand,
                "reported": layer.active_parameters(),
                "dense_parameters": layer.dense_parameters,
                "compression": layer.dense_parameters / by_hand,
            }
        )

    return {
        "config": PAPER,
        "layer_types": rows,
        "total": {
            "dense_parameters": dense_total,
            "tt_parameters": tt_total,
            "compression": dense_total / tt_total,
            "size_report_compression_ratio": report.compression_ratio,
        },
        "tt_layers_only": {
            "dense_parameters": tt_layer_dense,
            "tt_parameters": tt_layer_active,
            "compression": tt_layer_dense / tt_layer_active,
            "count": len(report.layers),
        },
        "hand_counts": hand,
    }


def to_markdown(result: dict) -> str:
    """The report: parameters by layer type with the totals, then the hand counts against the layers'."""
    rows = [
        [
            r["layer_type"],
            f"{r['modules']} ({r['tt_modules']})",
            f"{r['dense_parameters']:,}",
            f"{r['tt_parameters']:,}",
            f"{r['compression']:.1f}x",
        ]
        for r in result["layer_types"]
    ]
    t, only = result["total"], result["tt_layers_only"]
    rows.append(
        [
            "**total**",
            "-",
            f"**{t['dense_parameters']:,}**",
            f"**{t['tt_parameters']:,}**",
            f"**{t['compression']:.1f}x**",
        ]
    )
    hand = [
        [
            h["layer"],
            h["modes"],
            h["ranks"],
            f"{h['hand_count']:,}",
            f"{h['reported']:,}",
            f"{h['dense_parameters']:,}",
            f"{h['compression']:.1f}x",
        ]
        for h in result["hand_counts"]
    ]
    return "\n".join(
        [
            "## Parameters by layer type (paper six-encoder MNLI model, ranks at initialisation)",
            "",
            harness.table(["layer type", "modules (TT)", "dense", "CoMERA TT", "compression"], rows),
            "",
            f"TT layers alone ({only['count']} layers, weights only): {only['dense_parameters']:,} dense -> "
            f"{only['tt_parameters']:,} TT core parameters, {only['compression']:.1f}x.",
            "",
            "## TT core parameters counted by hand (METHOD.md section 2) vs reported",
            "",
            harness.table(["layer", "modes", "ranks", "by hand", "reported", "dense", "compression"], hand),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Print the report (markdown, or JSON with ``--json``); returns 0 (``collect()`` has the numbers)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)
    result = collect()
    print(json.dumps(result, indent=2) if args.json else to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
