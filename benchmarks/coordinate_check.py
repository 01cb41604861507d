"""The coordinate check of a parameterisation: does a layer's output, and its change in a step, keep its size as the
model widens?

A ``width -> 4 width -> width`` MLP of TT layers (rank width / 8) or low-rank ``A B`` layers (rank width / 4) trains
a few AdamW steps on a fixed batch; per width, the RMS of the hidden and output activations at init and of their
change. Flat rows keep muP's promise (``comera_lightning.tt.parameterization``); a row that grows with the width is a
rate that has to shrink as the model widens.

    python -m benchmarks.coordinate_check               # the table in docs/parameterization.md
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from benchmarks import harness
from comera_lightning.nn import TTLinear
from comera_lightning.optim import comera_parameter_groups

WIDTHS = (128, 256, 512, 1024)
KINDS = ("tt", "low-rank")


def rms(t: torch.Tensor) -> float:
    return float(t.detach().pow(2).mean().sqrt())


def coordinate_check(
    parameterization: str, kind: str, width: int, lr: float = 1e-2, steps: int = 3, seed: int = 0
) -> dict[str, float]:
    """RMS of the hidden and output activations at init and of their change after ``steps`` AdamW steps."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    torch.manual_seed(seed)
    low_rank = kind == "low-rank"
    rank = width // 4 if low_rank else width // 8
    up_modes = {"in_modes": [width], "out_modes": [4 * width]} if low_rank else {}
    down_modes = {"in_modes": [4 * width], "out_modes": [width]} if low_rank else {}
    up = TTLinear(width, 4 * width, rank, parameterization=parameterization, **up_modes)
    down = TTLinear(4 * width, width, rank, parameterization=parameterization, **down_modes)
    model = nn.Sequential(up, nn.GELU(), down)
    x, target = torch.randn(256, width), torch.randn(256, width)
    optimizer = torch.optim.AdamW(comera_parameter_groups(model, lr, lr, lr), weight_decay=0.0)
    with torch.no_grad():
        hidden0, out0 = up(x), model(x)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), target).backward()
        optimizer.step()
    with torch.no_grad():
        hidden1, out1 = up(x), model(x)
    changes = {"hidden_change": rms(hidden1 - hidden0), "output_change": rms(out1 - out0)}
    return {"hidden": rms(hidden0), "output": rms(out0), **changes}


def table(widths=WIDTHS) -> str:
    """The markdown table of every (parameterisation, layer kind, quantity) across ``widths``, with its spread."""
    rows = []
    for parameterization in ("standard", "mup"):
        for kind in KINDS:
            checks = [coordinate_check(parameterization, kind, w) for w in widths]
            for key in ("output", "hidden_change", "output_change"):
                values = [c[key] for c in checks]
                spread = f"{max(values) / min(values):.2f}x"
                rows.append([parameterization, kind, key.replace("_", " "), *(f"{v:.3f}" for v in values), spread])
    headers = ["parameterisation", "layers", "RMS of", *(f"d {w}" for w in widths), "largest / smallest"]
    return harness.table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(table(args.widths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
