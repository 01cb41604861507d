"""DivergenceGuard: drop (or stop at) optimiser steps whose loss or gradients are not finite.

A single NaN/inf step is enough to ruin a CoMERA run: it poisons the cores, and a NaN rank gate reads as
"dead" to the mask refresh, so every slice but one would be switched off. The guard looks at

* the loss of every micro-batch (``on_before_backward``; under gradient accumulation a step is bad when any
  of its micro-batches was), and
* the gradients just before the optimiser step (``on_before_optimizer_step``: after the DDP all-reduce and
  after AMP unscaling, before gradient clipping),

and for a bad step either drops it (``action="skip"``: every gradient of the optimiser is set to ``None``,
so ``optimizer.step()`` changes no parameter, no moment and no step count; RankAdaptation adds no penalty to
a step without gradients, so gates and masks stay as they were) or raises :class:`DivergenceError`
(``action="stop"``) naming the step and what to change. ``max_consecutive_skips`` bad steps in a row also
stop the run: a model that keeps producing NaN does not recover by skipping.

Mixed precision: with ``16-mixed`` the GradScaler already skips steps whose gradients overflowed (and lowers
its scale); that is normal operation, so the guard then checks the loss only. ``bf16-mixed`` has no scaler
and gets both checks. Under DDP the verdict is all-reduced, so every process skips or stops at the same step.
The LR scheduler and ``trainer.global_step`` still advance on a skipped step.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

__all__ = ["DivergenceError", "DivergenceGuard"]

_FIX = (
    "lower the learning rates (model.optim.lr_cores / lr_gates / lr_other), enable gradient clipping "
    "(trainer.gradient_clip_val, e.g. 1.0), add or lengthen LR warmup, and check the data for NaN/inf or "
    "out-of-range values"
)


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or non-finite gradients (see the message for the step and the fix)."""


class DivergenceGuard(Callback):
    """Detect non-finite losses and gradients; skip the optimiser step or stop the run.

    Args:
        action: ``"skip"`` drops the bad step and goes on; ``"stop"`` raises :class:`DivergenceError`.
        max_consecutive_skips: with ``"skip"``, raise once more than this many steps in a row were bad;
            None never stops.
        check_loss: look at the loss of every micro-batch.
        check_gradients: look at the gradients before each optimiser step (ignored when an AMP GradScaler
            handles overflow, i.e. ``precision="16-mixed"``).
    """

    def __init__(
        self,
        action: Literal["skip", "stop"] = "skip",
        max_consecutive_skips: int | None = 10,
        check_loss: bool = True,
        check_gradients: bool = True,
    ) -> None:
        if action not in ("skip", "stop"):
            raise ValueError(f"action must be 'skip' or 'stop', got {action!r}")
        if max_consecutive_skips is not None and max_consecutive_skips < 0:
            raise ValueError(f"max_consecutive_skips must be >= 0 or None, got {max_consecutive_skips}")
        if not (check_loss or check_gradients):
            raise ValueError("DivergenceGuard needs check_loss or check_gradients (or both) to be true")
        self.action = action
        self.max_consecutive_skips = max_consecutive_skips
        self.check_loss = check_loss
        self.check_gradients = check_gradients
        # state (checkpointed)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        # per step
        self._loss_finite: torch.Tensor | None = None
        self._bad_loss_value: torch.Tensor | None = None
        self._batch_idx = -1
        self._scaler_handles_gradients = False

    # --- hooks ---------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._scaler_handles_gradients = getattr(trainer.precision_plugin, "scaler", None) is not None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loss_finite = self._bad_loss_value = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if not self.check_loss:
            return
        finite = torch.isfinite(loss.detach()).all()  # no host sync here: read once per optimiser step
        if self._loss_finite is None or self._bad_loss_value is None:
            self._loss_finite, self._bad_loss_value = finite, loss.detach().float().reshape(-1)[:1]
        else:
            self._bad_loss_value = torch.where(
                self._loss_finite, loss.detach().float().reshape(-1)[:1], self._bad_loss_value
            )
            self._loss_finite = self._loss_finite & finite

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else pl_module.device
        flags = torch.zeros(2, device=device)
        if self._loss_finite is not None:
            flags[0] = (~self._loss_finite).to(device=device, dtype=flags.dtype)
        if self.check_gradients and not self._scaler_handles_gradients and grads:
            flags[1] = (~_all_finite(grads)).to(device=device, dtype=flags.dtype)
        if trainer.world_size > 1:  # one verdict for all processes (losses differ per process)
            flags = trainer.strategy.reduce(flags, reduce_op="sum")
        bad_loss, bad_grads = (bool(v > 0) for v in flags.tolist())
        loss_value = self._bad_loss_value
        self._loss_finite = self._bad_loss_value = None
        if not (bad_loss or bad_grads):
            self.consecutive_skips = 0
            return
        what = self._describe(pl_module, params, bad_loss, bad_grads, loss_value)
        where = f"global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {self._batch_idx})"
        if self.action == "stop":
            raise DivergenceError(
                f"training diverged at {where}: {what}. To fix: {_FIX}; or use "
                f"DivergenceGuard(action='skip') to drop such steps"
            )
        for p in params:  # drop the step: no update, no moment, no weight decay, no step count
            p.grad = None
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.max_consecutive_skips is not None and self.consecutive_skips > self.max_consecutive_skips:
            raise DivergenceError(
                f"training diverged: {self.consecutive_skips} optimizer steps in a row had {what} (last at "
                f"{where}); skipping does not help. To fix: {_FIX}"
            )
        rank_zero_warn(
            f"DivergenceGuard: skipped {where}: {what} ({self.consecutive_skips} in a row, "
            f"{self.skipped_steps} in total)",
            category=UserWarning,
        )

    # --- reporting and state -------------------------------------------------------------------------
    def _describe(
        self,
        pl_module: LightningModule,
        params: list[torch.Tensor],
        bad_loss: bool,
        bad_grads: bool,
        loss_value: torch.Tensor | None,
    ) -> str:
        parts = []
        if bad_loss:
            value = float(loss_value[0]) if loss_value is not None and loss_value.numel() else math.nan
            parts.append(
                f"a non-finite loss ({value})" if not math.isfinite(value) else "a non-finite loss (on another process)"
            )
        if bad_grads:
            names = {id(p): n for n, p in pl_module.named_parameters()}
            bad = [
                names.get(id(p), "?") for p in params if p.grad is not None and not bool(torch.isfinite(p.grad).all())
            ]
            shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            parts.append(f"non-finite gradients ({shown})" if bad else "non-finite gradients (on another process)")
        return " and ".join(parts)

    def comera_metrics(self) -> dict[str, float]:
        """For RankMonitor: how many optimiser steps were dropped so far."""
        return {"comera/skipped_steps": float(self.skipped_steps)}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.consecutive_skips = int(state_dict.get("consecutive_skips", 0))


def _all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor: every element of every tensor is finite (one reduction per tensor, no host sync)."""
    device = tensors[0].device
    return torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all()
