"""TTLinear: a drop-in ``nn.Linear`` whose weight is a rank-gated CoMERA tensor train."""

from __future__ import annotations

import math
from collections.abc import Sequence

import tensorly as tl
import torch
from torch import nn

from ..tt.contract import (
    BOTTLENECK_ACTIVATIONS,
    chain_merge,
    check_plan,
    compute_dtype,
    merge_tt_linear,
    merged_tt_linear,
    tt_linear,
)
from ..tt.cores import init_cores, max_ranks, resolve_ranks, tt_from_dense, tt_to_dense
from ..tt.modes import padded_modes, validate_modes
from ..tt.parameterization import check_parameterization, core_fan_ins, mup_init_stds, mup_lr_scales
from ..tt.rank import DEFAULT_THRESHOLD
from .base import TTLayer, _torch_factors

__all__ = ["TTLinear"]


class TTLinear(TTLayer):
    """``y = x W^T + b`` with ``W`` stored as a TT over (input modes, output modes).

    The bond between the input and the output cores is a rank-``r`` bottleneck, so at training batch
    sizes ``y = (x L) R`` costs ``2 B r (M + N)`` instead of ``2 B M N``. The contraction order is chosen
    per call by :func:`comera_lightning.tt.plan_tt_linear` unless ``contraction_plan`` is set.

    In eval mode without autograd (generation, validation) the layer keeps ``L`` and ``R`` (merged, gated, in the
    compute dtype; ``r (M + N)`` elements, or the dense ``M x N`` weight when that is smaller) and reuses them,
    so a call costs its two GEMMs; the contraction plan then does not apply (it only decides how to avoid
    merging). See :class:`~comera_lightning.nn.TTLayer` for when the cache is refreshed; set
    ``inference_cache = False`` to merge on every call.

    With ``bottleneck_activation`` the layer is no longer linear: ``y = act(x L) R + b``, a non-linearity on the
    middle bond (CoLA's low-rank activation, Liu et al. 2025, applied to a tensor train). With one mode per side
    that is CoLA's ``B act(A x)``. The activation maps 0 to 0, so a gate or mask that switches a bond slice off
    removes it exactly, as in the linear case. Such a layer always runs the bottleneck order and has no dense
    weight (:meth:`weight_dense` refuses).

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        rank: one rank for every internal bond (clamped to what the modes allow) or a list of the
            internal ranks (validated strictly).
        in_modes, out_modes: explicit factorisations; None picks balanced modes (padding the feature
            size with unused zeros if it does not factor well).
        bias: learn an additive bias.
        rank_threshold: gate magnitude at or below which a rank slice is switched off.
        init_std: std of the reconstructed weight; default ``sqrt(1 / (in + out))`` as in the paper (under
            ``mup``: ``sqrt(1 / in)``, each core keeping the RMS of what it reads).
        parameterization: ``standard`` (one rate for every core, the init split evenly over the cores) or
            ``mup`` (per-core init and learning-rate multipliers from each core's fan-in, so the best rate carries
            over between widths); see :mod:`comera_lightning.tt.parameterization`.
        bottleneck_activation: None (a linear layer) or one of
            :data:`~comera_lightning.tt.contract.BOTTLENECK_ACTIVATIONS` applied to ``x L``.
        dtype, device: of the cores (gates are always fp32).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int | Sequence[int] = 30,
        in_modes: Sequence[int] | None = None,
        out_modes: Sequence[int] | None = None,
        bias: bool = True,
        rank_threshold: float = DEFAULT_THRESHOLD,
        init_std: float | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        bottleneck_activation: str | None = None,
        parameterization: str = "standard",
    ) -> None:
        super().__init__()
        if bottleneck_activation is not None and bottleneck_activation not in BOTTLENECK_ACTIVATIONS:
            raise ValueError(
                f"bottleneck_activation must be None or one of {sorted(BOTTLENECK_ACTIVATIONS)}, got "
                f"{bottleneck_activation!r}"
            )
        self.bottleneck_activation = bottleneck_activation
        if in_features < 1 or out_features < 1:
            raise ValueError(f"in_features and out_features must be >= 1, got {in_features}, {out_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.in_modes = (
            padded_modes(in_features) if in_modes is None else validate_modes(in_modes, in_features, "in_modes")
        )
        self.out_modes = (
            padded_modes(out_features) if out_modes is None else validate_modes(out_modes, out_features, "out_modes")
        )
        sizes = self.in_modes + self.out_modes
        ranks = resolve_ranks(sizes, rank)
        dtype = dtype or torch.get_default_dtype()
        shapes = [(ranks[k], s, ranks[k + 1]) for k, s in enumerate(sizes)]
        if check_parameterization(parameterization) == "mup":
            fan_ins = core_fan_ins(shapes, len(self.in_modes))
            # the chain of fan-in-scaled cores gives the weight a std of 1 / sqrt(M); init_std rescales the last core
            scale = 1.0 if init_std is None else float(init_std) * math.sqrt(math.prod(self.in_modes))
            cores = init_cores(shapes, dtype=dtype, device=device, stds=mup_init_stds(fan_ins, scale))
            lr_scales = mup_lr_scales(fan_ins)
        else:
            std = math.sqrt(1.0 / (in_features + out_features)) if init_std is None else float(init_std)
            cores, lr_scales = init_cores(shapes, std, dtype=dtype, device=device), [1.0] * len(shapes)
        self._init_train(cores, rank_threshold, max_ranks(sizes), parameterization, lr_scales)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.contraction_plan: str | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int | Sequence[int] = 30, **kwargs) -> tuple[TTLinear, float]:
        """A TTLinear initialised by TT-SVD of ``linear.weight``; returns it with the relative error."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            rank,
            bias=linear.bias is not None,
            dtype=linear.weight.dtype,
            device=linear.weight.device,
            **kwargs,
        )
        weight = linear.weight.detach().transpose(0, 1)
        layer._copy_factors_(tt_from_dense(weight, layer.in_modes, layer.out_modes, layer.ranks))
        with torch.no_grad():
            if linear.bias is not None:
                assert layer.bias is not None  # built with bias=linear.bias is not None
                layer.bias.copy_(linear.bias)
            error = (layer.weight_dense() - linear.weight).norm() / linear.weight.norm().clamp_min(1e-30)
        return layer, float(error)

    @property
    def dense_parameters(self) -> int:
        return self.in_features * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"TTLinear expected inputs with last dimension {self.in_features}, got shape {tuple(x.shape)}"
            )
        if self._serves_from_cache():
            return self._cached_forward(x)
        padded_in = math.prod(self.in_modes)
        if padded_in != self.in_features:
            x = nn.functional.pad(x, (0, padded_in - self.in_features))
        padded_out = math.prod(self.out_modes)
        bias: torch.Tensor | None = self.bias
        if bias is not None and padded_out != self.out_features:
            bias = nn.functional.pad(bias, (0, padded_out - self.out_features))
        if self.bottleneck_activation is not None:
            y = self._activated_forward(x, bias)
            return y if padded_out == self.out_features else y[..., : self.out_features]
        y = tt_linear(x, self.gated_cores(), self.in_modes, self.contraction_plan, bias)
        return y if padded_out == self.out_features else y[..., : self.out_features]

    def _activated_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``act(x L) R + b`` on padded features, differentiable (plain autograd through the side merges)."""
        assert self.bottleneck_activation is not None  # forward calls this only for a layer with one
        cores = self.gated_cores()
        num_in = len(self.in_modes)
        left = chain_merge(cores[:num_in])[-1]
        right = chain_merge(cores[num_in:])[-1].reshape(left.shape[1], -1)
        hidden = BOTTLENECK_ACTIVATIONS[self.bottleneck_activation](x @ left)
        y = hidden @ right
        return y if bias is None else y + bias.to(y.dtype)  # under autocast, as nn.Linear: the GEMMs' dtype

    def _cached_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The forward from the merged factors kept for inference (built on the first call)."""
        compute = compute_dtype(x)
        activation = self.bottleneck_activation
        # the compute dtype is the rest of the key: it folds in autocast's state and the input's dtype
        merged = self._inference_cached(
            compute,
            lambda: merge_tt_linear(
                self.gated_cores(),
                len(self.in_modes),
                compute,
                self.in_features,
                self.out_features,
                keep_factors=activation is not None,
            ),
        )
        bias = None if self.bias is None else self.bias.to(compute)
        y = merged_tt_linear(
            x.reshape(-1, self.in_features).to(compute),
            merged,
            bias,
            None if activation is None else BOTTLENECK_ACTIVATIONS[activation],
        )
        return y.reshape(*x.shape[:-1], self.out_features)

    def weight_dense(self) -> torch.Tensor:
        """The ``(out_features, in_features)`` matrix ``nn.Linear`` would hold (differentiable)."""
        if self.bottleneck_activation is not None:
            raise ValueError(
                f"this TTLinear computes act(x L) R with bottleneck_activation={self.bottleneck_activation!r}: it is "
                "not a linear map and has no dense weight; keep it as a TT layer (export it with its cores), or "
                "train it with bottleneck_activation=None if you need nn.Linear"
            )
        full = tt_to_dense(self.gated_cores(), len(self.in_modes))
        return full[: self.in_features, : self.out_features].transpose(0, 1)

    def to_tensorly(self) -> tl.tt_tensor.TTTensor:
        """The gated factors as a tensorly ``TTTensor`` over ``(in_modes..., out_modes...)``."""
        with tl.backend_context("pytorch", local_threadsafe=True):
            return tl.tt_tensor.TTTensor(self.gated_cores())

    @classmethod
    def from_tensorly(
        cls,
        tt: tl.tt_tensor.TTTensor | Sequence[torch.Tensor],
        num_in_modes: int,
        *,
        in_features: int | None = None,
        out_features: int | None = None,
        bias: torch.Tensor | None = None,
        **kwargs,
    ) -> TTLinear:
        """The inverse of :meth:`to_tensorly`: a TTLinear whose cores are ``tt``'s factors (gates 1, all active).

        Args:
            tt: a ``TTTensor`` (or its factors) over ``(in_modes..., out_modes...)``, factors ``(r, s, r')``.
            num_in_modes: how many leading modes are input modes (``len(layer.in_modes)``); a TT does not say.
            in_features, out_features: the unpadded sizes; default the products of the modes.
            bias: copied into the layer's bias; None builds the layer without one.
            kwargs: forwarded to the constructor (e.g. ``rank_threshold``).
        """
        factors = _torch_factors(tt, 3, "TTLinear.from_tensorly", "a TTTensor (TTEmbedding takes TTMatrix)")
        modes = [int(f.shape[1]) for f in factors]
        if not 1 <= num_in_modes < len(modes):
            raise ValueError(
                f"num_in_modes must be in [1, {len(modes)}) for a TT with modes {modes}, got {num_in_modes}"
            )
        in_modes, out_modes = modes[:num_in_modes], modes[num_in_modes:]
        in_features = math.prod(in_modes) if in_features is None else in_features
        out_features = math.prod(out_modes) if out_features is None else out_features
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
        # built at the factors' ranks (muP's rates follow the ranks); copying them checks that they chain
        ranks = [int(f.shape[-1]) for f in factors[:-1]]
        layer = cls(
            in_features,
            out_features,
            ranks,
            in_modes,
            out_modes,
            bias=bias is not None,
            dtype=factors[0].dtype,
            device=factors[0].device,
            **kwargs,
        )
        layer._copy_factors_(factors)
        if bias is not None:
            assert layer.bias is not None  # built with bias=bias is not None
            with torch.no_grad():
                layer.bias.copy_(bias)
        return layer

    def set_contraction_plan(self, plan: str | None) -> None:
        """Force one of :data:`comera_lightning.tt.PLANS`, or None to let the planner choose per call."""
        check_plan(plan)
        if self.bottleneck_activation is not None and plan not in (None, "half_merge"):
            raise ValueError(
                f"a TTLinear with bottleneck_activation={self.bottleneck_activation!r} always runs the "
                f"bottleneck order act(x L) R (half_merge); plan {plan!r} would skip the activation"
            )
        self.contraction_plan = plan

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, in_modes={self.in_modes}, "
            f"out_modes={self.out_modes}, bias={self.bias is not None}, "
            + ("" if self.bottleneck_activation is None else f"bottleneck_activation={self.bottleneck_activation}, ")
            + super().extra_repr()
        )
