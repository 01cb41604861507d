"""``comera fit --rank_adaptation.<name>``: the RankAdaptation options users change most, written into the
config's RankAdaptation callback (LightningCLI cannot reach into a callback of a config's list)."""

from __future__ import annotations

import importlib
from typing import Any

from jsonargparse import Namespace

from ..callbacks import RankAdaptation

# the RankAdaptation options users change most, as --rank_adaptation.<name> on `comera fit` with any shipped config
RANK_ADAPTATION_KNOBS: dict[str, tuple[type, str]] = {
    "target_compression": (float, "late-stage size target as a compression ratio (replaces target_size)"),
    "target_size": (int, "late-stage size target in parameters (replaces target_compression)"),
    "late_start_step": (int, "optimiser step at which the late stage starts (replaces late_start_fraction)"),
    "late_start_fraction": (
        float,
        "share of the run's steps after which the late stage starts (replaces late_start_step)",
    ),
    "gamma": (float, "weight of the rank penalty in the early stage"),
    "truncate_every_n_steps": (int, "how often (optimiser steps) layers are physically truncated"),
}
# a knob given replaces its partner from the config (both set would mean two rules, the first to fire wins)
_EXCLUSIVE_KNOBS = {
    "target_compression": "target_size",
    "target_size": "target_compression",
    "late_start_step": "late_start_fraction",
    "late_start_fraction": "late_start_step",
}


def apply_rank_adaptation_knobs(config: Namespace, knobs: Namespace | None) -> None:
    """Write the ``--rank_adaptation.*`` values that were given into the init_args of every RankAdaptation
    callback of ``config`` (a parsed ``fit`` config); refuse them, naming the fix, when it has none."""
    given = {key: value for key, value in (vars(knobs) if knobs else {}).items() if value is not None}
    if not given:
        return
    callbacks = [
        c
        for c in config.get("trainer", {}).get("callbacks") or []
        if isinstance(c, Namespace) and _is_rank_adaptation(c.get("class_path"))
    ]
    if not callbacks:
        options = ", ".join(f"--rank_adaptation.{key}" for key in given)
        raise ValueError(
            f"{options}: this config has no RankAdaptation callback (a dense baseline trains no "
            "ranks), so there is nothing to set; drop the option(s), or add the callback "
            "(--config callbacks/rank_adaptation.yaml)"
        )
    for callback in callbacks:
        init_args = callback.get("init_args")
        if init_args is None:
            init_args = callback["init_args"] = Namespace()
        for key, value in given.items():
            init_args[key] = value
            if key in _EXCLUSIVE_KNOBS and _EXCLUSIVE_KNOBS[key] not in given:
                init_args[_EXCLUSIVE_KNOBS[key]] = None


def _is_rank_adaptation(class_path: Any) -> bool:
    if not isinstance(class_path, str) or "." not in class_path:
        return False
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, RankAdaptation)
