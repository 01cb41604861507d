"""ContractionPlanner: pick each TT linear's contraction order for the real batch shape.

At the first training batch, and again whenever a layer's ranks change (physical truncation), the
callback watches one forward pass to learn how many rows every ``TTLinear`` receives (that batch runs
with the per-call choice of the same cost model), then at the batch end fixes each layer's plan: the
cost model's choice, or with ``autotune=True`` the fastest of the model's top candidates timed on the
layer's own device. Plans are reported once per (re)plan.

Planning runs eagerly at the batch end, never inside the forward: under ``torch.compile`` the watching
hook only records shapes (no graph break), and the compiled forward reads the layer's plan as a
constant (re-traced once when it is set).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from ..nn.linear import TTLinear
from ..nn.tensorize import tt_layers
from ..tt.contract import compute_dtype, plan_costs, tt_linear

__all__ = ["ContractionPlanner"]


class ContractionPlanner(Callback):
    """Fix every TTLinear's contraction plan for the shapes it actually sees.

    Layers with a ``bottleneck_activation`` are left alone: they always run ``act(x L) R``.

    Args:
        autotune: time the ``candidates`` best-modelled plans on the device and keep the fastest.
        candidates: how many plans to time when autotuning.
        repeats: timed forward+backward repetitions per candidate (after one warm-up).
        verbose: print the chosen plans (rank zero only).
    """

    def __init__(self, autotune: bool = False, candidates: int = 3, repeats: int = 3, verbose: bool = True) -> None:
        if candidates < 1 or repeats < 1:
            raise ValueError(f"candidates and repeats must be >= 1, got {candidates}, {repeats}")
        self.autotune = autotune
        self.candidates = candidates
        self.repeats = repeats
        self.verbose = verbose
        self.plans: dict[str, dict[str, Any]] = {}
        self._planned_ranks: dict[str, list[int]] = {}
        self._seen: dict[str, tuple[int, torch.device, torch.dtype]] = {}
        self._hooks: list[Any] = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        stale = [
            (name, layer)
            for name, layer in tt_layers(pl_module)
            if isinstance(layer, TTLinear)
            and layer.bottleneck_activation is None
            and self._planned_ranks.get(name) != layer.ranks
        ]
        if not stale or self._hooks:
            return
        for name, layer in stale:
            layer.set_contraction_plan(None)
            self._hooks.append(layer.register_forward_pre_hook(self._make_hook(name)))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        seen, self._seen = self._seen, {}
        for name, layer in tt_layers(pl_module):
            if name in seen and isinstance(layer, TTLinear):  # the hooks are on the TT linears
                self.plans[name] = self.plan_layer(layer, *seen[name])
                layer.set_contraction_plan(self.plans[name]["plan"])
                self._planned_ranks[name] = list(layer.ranks)
        if seen and self.verbose:
            rank_zero_info("ContractionPlanner:\n" + self.report())

    def _make_hook(self, name: str):
        def hook(layer: TTLinear, args: tuple) -> None:
            # records only (traceable by torch.compile); a layer called several times per step keeps its first call
            x = args[0]
            self._seen.setdefault(name, (int(math.prod(x.shape[:-1])), x.device, compute_dtype(x)))

        return hook

    def plan_layer(self, layer: TTLinear, rows: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """Choose a plan for ``layer`` at ``rows`` rows whose batch GEMMs run in ``dtype``: modelled, or timed
        when ``autotune``."""
        costs = sorted(
            plan_costs(layer.in_modes, layer.out_modes, layer.ranks, rows, device.type, dtype.itemsize),
            key=lambda c: c.seconds,
        )
        entry: dict[str, Any] = {
            "rows": rows,
            "ranks": list(layer.ranks),
            "plan": costs[0].plan,
            "modelled_seconds": {c.plan: c.seconds for c in costs},
        }
        if self.autotune:
            timings = {c.plan: self._time_plan(layer, rows, device, dtype, c.plan) for c in costs[: self.candidates]}
            entry["timed_seconds"] = timings
            entry["plan"] = min(timings, key=timings.__getitem__)
        return entry

    def _time_plan(self, layer: TTLinear, rows: int, device: torch.device, dtype: torch.dtype, plan: str) -> float:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            cores = [c.detach().clone().requires_grad_(True) for c in layer.gated_cores()]
            # a private generator: timing must not shift the training RNG stream (exact resumes)
            generator = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(
                rows, math.prod(layer.in_modes), device=device, dtype=dtype, generator=generator, requires_grad=True
            )
            best = float("inf")
            for i in range(self.repeats + 1):
                _synchronize(device)
                start = time.perf_counter()
                tt_linear(x, cores, layer.in_modes, plan).sum().backward()
                _synchronize(device)
                if i:  # the first run is a warm-up
                    best = min(best, time.perf_counter() - start)
        return best

    def report(self) -> str:
        """One line per planned layer: name, rows, ranks, plan (and timings when autotuned)."""
        lines = []
        for name, entry in self.plans.items():
            timed = entry.get("timed_seconds")
            extra = "" if not timed else " timed " + ", ".join(f"{p}={t * 1e3:.2f}ms" for p, t in timed.items())
            lines.append(f"  {name}: rows={entry['rows']} ranks={entry['ranks']} -> {entry['plan']}{extra}")
        return "\n".join(lines)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}  # plans depend on the device and are re-made after a restart


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
