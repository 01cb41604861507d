"""How a tensor train's cores are initialised and how fast each learns: ``standard`` or ``mup``.

``standard`` (the default) draws every core so that the reconstructed weight has a chosen std (Glorot's
``sqrt(1 / (M + N))`` for a linear, 1 for an embedding), split evenly over the cores, and trains every core at one
rate. That sets the size of the *weight*, not of what each core computes, so the intermediate activations and the
update each core makes grow or shrink with the width, and the best rate moves when the model widens.

``mup`` applies the Maximal Update Parameterisation to every core, reading a tensor train as a chain of small
dense maps (Qiu et al., "Compute Better Spent", 2024, do the same for block tensor trains). Contract ``x`` with the
cores from left to right: an input core ``(r_{k-1}, m_k, r_k)`` maps ``r_{k-1} m_k`` numbers to ``r_k`` (its fan-in
is ``r_{k-1} m_k``); an output core ``(r_{k-1}, n_k, r_k)`` maps ``r_{k-1}`` numbers to ``n_k r_k`` (fan-in
``r_{k-1}``); a TT-matrix embedding core ``(r_{k-1}, v_k, e_k, r_k)`` picks its ``v_k`` slice by the token id and
maps ``r_{k-1}`` to ``e_k r_k`` (fan-in ``r_{k-1}``). For every core, with ``f`` its fan-in:

* **init** ``std = 1 / sqrt(f)``: each map keeps the RMS of what it reads, so the layer's output entries are
  Theta(1) for Theta(1) inputs at any width (an embedding's entries have variance 1, as ``nn.Embedding``'s);
* **rate** ``lr * min(1, base / f)``: an AdamW step moves every entry of a core by about its rate, and
  the core's output by ``rate * f`` (the update lines up with what the core reads), so ``rate ~ 1 / f`` keeps the
  change of every core's output, and of the layer's, Theta(1) as the width grows. Below ``base`` inputs a core's
  fan-in is treated as a fixed size (muP's "finite" dimensions: an embedding's first core, the first input core
  of a small linear) and learns at ``lr`` itself, so ``lr`` keeps the meaning it has at the reference width.

The multipliers are fixed when the layer is built (from its starting ranks): a rank cut during training does
not retune the optimiser, and a resumed run rebuilds the same groups. ``docs/parameterization.md`` has the
derivation and the coordinate check that tests it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "MUP_BASE_FAN_IN",
    "PARAMETERIZATIONS",
    "Parameterization",
    "check_parameterization",
    "core_fan_ins",
    "mup_init_stds",
    "mup_lr_scales",
]

Parameterization = Literal["standard", "mup"]
PARAMETERIZATIONS: tuple[str, ...] = ("standard", "mup")
#: the fan-in at which a core learns at the group's own rate under ``mup``: d_model 128, the reference width of the
#: tuned recipes, so a dense-sized core of a d_model-128 model learns at ``lr_cores`` as before
MUP_BASE_FAN_IN = 128


def check_parameterization(value: str) -> str:
    """``value`` if it names a parameterisation, else a ValueError that lists them."""
    if value not in PARAMETERIZATIONS:
        raise ValueError(f"parameterization must be one of {list(PARAMETERIZATIONS)}, got {value!r}")
    return value


def core_fan_ins(core_shapes: Sequence[Sequence[int]], num_input_cores: int) -> list[int]:
    """The fan-in of every core of a train read as a chain of dense maps (see the module docstring).

    ``core_shapes`` are ``(r_{k-1}, s_k, r_k)`` for a TT linear, whose first ``num_input_cores`` cores span the
    input; ``(r_{k-1}, v_k, e_k, r_k)`` for a TT-matrix embedding (``num_input_cores = 0``: the token id selects a
    slice, only the incoming rank is summed over).
    """
    if not 0 <= num_input_cores <= len(core_shapes):
        raise ValueError(f"num_input_cores must be in [0, {len(core_shapes)}], got {num_input_cores}")
    fan_ins = []
    for k, shape in enumerate(core_shapes):
        incoming = int(shape[0])
        fan_ins.append(incoming * int(shape[1]) if k < num_input_cores else incoming)
    return fan_ins


def mup_init_stds(fan_ins: Sequence[int], scale: float = 1.0) -> list[float]:
    """Per-core init stds ``1 / sqrt(f)``; ``scale`` multiplies the last core's (the output's RMS follows it)."""
    stds = [1.0 / math.sqrt(max(int(f), 1)) for f in fan_ins]
    if stds:
        stds[-1] *= float(scale)
    return stds


def mup_lr_scales(fan_ins: Sequence[int], base: int = MUP_BASE_FAN_IN) -> list[float]:
    """Per-core learning-rate multipliers ``min(1, base / f)``."""
    if base < 1:
        raise ValueError(f"base must be >= 1, got {base}")
    return [min(1.0, base / max(int(f), 1)) for f in fan_ins]
