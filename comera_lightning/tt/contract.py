"""Contraction plans for ``y = x W`` with ``W`` a CoMERA tensor train, and their custom autograd.

The train runs over the input modes ``m_1..m_p`` then the output modes ``n_1..n_q``; bond ``p`` is the
bottleneck of rank ``r``. Each side (input cores, output cores) can be evaluated two ways:

* ``merge``: multiply the side's cores into one matrix first (``L: M x r``, ``R: r x N``, batch-free,
  cheap), then one GEMM with the batch;
* ``sweep``: contract the batch with one core at a time (no merge; wins when there are few rows).

Plans combine the two sides (``half_merge`` = merge/merge is CoMERA's ``(x L) R``), plus ``dense``,
which rebuilds ``W = L R`` and does one ``M x N`` GEMM (wins for tiny layers or huge ranks).
:func:`plan_tt_linear` costs every plan by FLOPs, bytes moved, kernel count and the memory it keeps
for backward, and caches the choice per (shapes, ranks, rows, device). :class:`TTLinearFunction`
executes a plan; its backward reuses the saved merge prefixes and batch intermediates rather than
contracting again. Batch GEMMs run in the activation dtype (bf16 under autocast); merges and core
gradients stay in the cores' dtype (fp32) for accuracy.

Without autograd and with unchanged cores (inference) the merges need not be repeated:
:func:`merge_tt_linear` merges both sides once into a :class:`MergedTTLinear` and :func:`merged_tt_linear`
applies it to each batch with one or two GEMMs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

from .cores import grad_in_layout

__all__ = [
    "BOTTLENECK_ACTIVATIONS",
    "PLANS",
    "MergedTTLinear",
    "PlanCost",
    "TTLinearFunction",
    "bottleneck_padding",
    "chain_merge",
    "check_plan",
    "compute_dtype",
    "merge_tt_linear",
    "merged_tt_linear",
    "plan_costs",
    "plan_tt_linear",
    "tt_linear",
]

PLANS = ("half_merge", "sweep", "merge_in_sweep_out", "sweep_in_merge_out", "dense")
# non-linearities a TT linear may apply on its middle bond (CoLA's low-rank activation); each maps 0 to 0, so a
# switched-off bond slice stays exactly removed
BOTTLENECK_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "relu": torch.relu,
    "tanh": torch.tanh,
}


# ---------------------------------------------------------------------------------------------------------
# cost model
@dataclass(frozen=True)
class DeviceModel:
    """Rough throughput of a device class, enough to rank plans that differ by large factors."""

    flops_per_s: float
    bytes_per_s: float
    seconds_per_kernel: float


_DEVICE_MODELS = {
    "cpu": DeviceModel(flops_per_s=5e10, bytes_per_s=1e10, seconds_per_kernel=4e-6),
    "cuda": DeviceModel(flops_per_s=2e14, bytes_per_s=2e12, seconds_per_kernel=6e-6),
}


@dataclass(frozen=True)
class PlanCost:
    """Estimated cost of one plan for forward plus backward."""

    plan: str
    flops: int
    bytes_moved: int
    kernels: int
    seconds: float


class _MergeCost(NamedTuple):
    flops: int
    kernels: int


def _side_merge_cost(modes: Sequence[int], ranks: Sequence[int]) -> _MergeCost:
    """Merging a side's cores into one matrix (forward only)."""
    flops, rows = 0, ranks[0] * modes[0]
    for k in range(1, len(modes)):
        flops += 2 * rows * ranks[k] * modes[k] * ranks[k + 1]
        rows *= modes[k]
    return _MergeCost(flops, max(len(modes) - 1, 0))


class _SideCost(NamedTuple):
    """Forward cost of one side of a plan over a batch (elements, not bytes), and of merging its cores first."""

    flops: int
    moved: int  # elements read and written
    kernels: int
    merge_flops: int = 0  # batch-free: merging the side's cores into one matrix (merged plans only)
    merge_kernels: int = 0


def plan_costs(
    in_modes: Sequence[int],
    out_modes: Sequence[int],
    ranks: Sequence[int],
    rows: int,
    device_type: str = "cpu",
    element_bytes: int = 4,
) -> list[PlanCost]:
    """Cost of every plan (forward + backward, weights and input both needing gradients)."""
    p = len(in_modes)
    in_ranks, out_ranks, model = ranks[: p + 1], ranks[p:], _DEVICE_MODELS.get(device_type, _DEVICE_MODELS["cpu"])
    M, N, r, B = math.prod(in_modes), math.prod(out_modes), ranks[p], rows
    merge_in, merge_out = _side_merge_cost(in_modes, in_ranks), _side_merge_cost(out_modes, out_ranks)
    merged_in = _SideCost(2 * B * M * r, B * M + B * r, 1, *merge_in)
    merged_out = _SideCost(2 * B * r * N, B * r + B * N, 1, *merge_out)
    swept_in, swept_out = _sweep_in_cost(in_modes, in_ranks, B), _sweep_out_cost(out_modes, out_ranks, B)
    costs = [
        _plan_cost(plan, in_side, out_side, element_bytes, model)
        for plan, in_side, out_side in (
            ("half_merge", merged_in, merged_out),
            ("sweep", swept_in, swept_out),
            ("merge_in_sweep_out", merged_in, swept_out),
            ("sweep_in_merge_out", swept_in, merged_out),
        )
    ]
    dense_setup = merge_in.flops + merge_out.flops + 2 * M * r * N
    dense_flops = 3 * (2 * B * M * N + dense_setup)
    dense_moved = 3 * (B * M + M * N + B * N)
    dense_kernels = 3 * (1 + 1 + merge_in.kernels + merge_out.kernels)
    costs.append(_finish("dense", dense_flops, dense_moved, dense_kernels, element_bytes, model))
    return costs


def _sweep_in_cost(modes: Sequence[int], ranks: Sequence[int], rows: int) -> _SideCost:
    """Contracting the input with one input core at a time."""
    flops = moved = 0
    rest = math.prod(modes)
    for k, mode in enumerate(modes):
        rest //= mode
        size_in = rows * rest * mode * ranks[k]
        flops += 2 * size_in * ranks[k + 1]
        moved += 2 * size_in + rows * rest * ranks[k + 1]  # permute copy + GEMM read + write
    return _SideCost(flops, moved, 2 * len(modes))


def _sweep_out_cost(modes: Sequence[int], ranks: Sequence[int], rows: int) -> _SideCost:
    """Expanding the bottleneck through one output core at a time."""
    flops = moved = 0
    done = 1
    for k, mode in enumerate(modes):
        size_in = rows * done * ranks[k]
        done *= mode
        size_out = rows * done * ranks[k + 1]
        flops += 2 * size_in * mode * ranks[k + 1]
        moved += size_in + size_out
    return _SideCost(flops, moved, len(modes))


def _plan_cost(plan: str, in_side: _SideCost, out_side: _SideCost, element_bytes: int, model: DeviceModel) -> PlanCost:
    # backward of a batch GEMM costs two more GEMMs of the same size; of a merge, two more too
    flops = 3 * (in_side.flops + out_side.flops) + 3 * (in_side.merge_flops + out_side.merge_flops)
    kernels = 3 * (in_side.kernels + out_side.kernels) + 3 * (in_side.merge_kernels + out_side.merge_kernels)
    moved = 3 * (in_side.moved + out_side.moved)
    return _finish(plan, flops, moved, kernels, element_bytes, model)


def _finish(plan: str, flops: int, moved: int, kernels: int, element_bytes: int, model: DeviceModel) -> PlanCost:
    seconds = flops / model.flops_per_s + moved * element_bytes / model.bytes_per_s + kernels * model.seconds_per_kernel
    return PlanCost(plan, int(flops), int(moved * element_bytes), int(kernels), seconds)


@lru_cache(maxsize=4096)
def _cached_plan(in_modes, out_modes, ranks, rows, device_type, element_bytes) -> str:
    costs = plan_costs(in_modes, out_modes, ranks, rows, device_type, element_bytes)
    return min(costs, key=lambda c: c.seconds).plan


@torch.compiler.assume_constant_result
def plan_tt_linear(
    in_modes: Sequence[int],
    out_modes: Sequence[int],
    ranks: Sequence[int],
    rows: int,
    device_type: str = "cpu",
    element_bytes: int = 4,
) -> str:
    """The plan with the lowest modelled time; cached per (shapes, ranks, rows, device, dtype size).

    Under ``torch.compile`` it runs in Python at trace time and the graph holds only the chosen name.
    """
    return _cached_plan(tuple(in_modes), tuple(out_modes), tuple(ranks), int(rows), device_type, element_bytes)


def check_plan(plan: str | None) -> None:
    """Raise a ValueError unless ``plan`` is one of :data:`PLANS` or None (planned per call)."""
    if plan is not None and plan not in PLANS:
        raise ValueError(f"unknown contraction plan {plan!r}; choose one of {PLANS} or None")


# ---------------------------------------------------------------------------------------------------------
# execution
def chain_merge(cores: Sequence[torch.Tensor], start: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Prefix products of a chain of cores ``(r_{k-1}, s_k, r_k)``.

    Prefix ``k`` has shape ``(rows_k, r_k)`` with rows ``(r_0 or start rows, s_1, ..., s_k)`` row-major.
    With ``start`` (shape ``(rows, r_0)``) every core is multiplied onto it, which is the sweep of a
    batch through the output cores.
    """
    prefix = start if start is not None else cores[0].reshape(-1, cores[0].shape[-1])
    prefixes = [prefix]
    for core in cores if start is not None else cores[1:]:
        r_prev, size, r_next = core.shape
        prefix = (prefix @ core.reshape(r_prev, size * r_next)).reshape(prefix.shape[0] * size, r_next)
        prefixes.append(prefix)
    return prefixes


def _chain_merge_backward(
    cores: Sequence[torch.Tensor], prefixes: Sequence[torch.Tensor], grad: torch.Tensor, has_start: bool
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Gradients of the cores (and of ``start``) from the gradient of the last prefix."""
    grads: list[torch.Tensor] = [None] * len(cores)  # type: ignore[list-item]
    offset = 1 if has_start else 0
    for k in range(len(cores) - 1, -1 if has_start else 0, -1):
        core = cores[k]
        r_prev, size, r_next = core.shape
        previous = prefixes[k - 1 + offset]
        grad = grad.reshape(previous.shape[0], size * r_next)
        grads[k] = (previous.transpose(0, 1) @ grad).reshape(core.shape)
        grad = grad @ core.reshape(r_prev, size * r_next).transpose(0, 1)
    if has_start:
        return grads, grad
    grads[0] = grad.reshape(cores[0].shape)
    return grads, None


def _sweep_in(x: torch.Tensor, cores: Sequence[torch.Tensor], modes: Sequence[int]) -> tuple[torch.Tensor, list]:
    """Contract ``x (B, M)`` with the input cores one at a time; returns ``(B, r_p)`` and saved operands."""
    batch, rest = x.shape[0], math.prod(modes)
    state = x
    saved = []
    for core, mode in zip(cores, modes, strict=True):
        r_prev, _, r_next = core.shape
        rest //= mode
        operand = state.reshape(batch, mode, rest, r_prev).transpose(1, 2).reshape(batch * rest, mode * r_prev)
        weight = core.transpose(0, 1).reshape(mode * r_prev, r_next)
        state = operand @ weight
        saved.append(operand)
    return state.reshape(batch, cores[-1].shape[-1]), saved


def _sweep_in_backward(grad: torch.Tensor, cores, modes, saved, need_input: bool):
    batch = grad.shape[0]
    grads = [None] * len(cores)
    rest = 1
    for k in range(len(cores) - 1, -1, -1):
        core, mode, operand = cores[k], modes[k], saved[k]
        r_prev, _, r_next = core.shape
        grad = grad.reshape(batch * rest, r_next)
        weight = core.transpose(0, 1).reshape(mode * r_prev, r_next)
        grads[k] = (operand.transpose(0, 1) @ grad).reshape(mode, r_prev, r_next).transpose(0, 1)
        if k == 0 and not need_input:
            return grads, None
        grad = (grad @ weight.transpose(0, 1)).reshape(batch, rest, mode, r_prev).transpose(1, 2)
        rest *= mode
    return grads, grad.reshape(batch, rest)


def _tt_linear_forward(
    x: torch.Tensor, bias: torch.Tensor | None, plan: str, in_modes: tuple, cores: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], bool, tuple[int, int]]:
    """``y = x W + bias`` by ``plan``; returns ``y`` and what the backward needs: the tensors to save, whether the
    bias rides in a padding slot of the bottleneck, and the counts of saved input- and output-side tensors."""
    p = len(in_modes)
    in_cores, out_cores = cores[:p], cores[p:]
    compute = x.dtype
    if plan == "dense":
        in_prefixes, out_prefixes = chain_merge(in_cores), chain_merge(out_cores)
        left, right = in_prefixes[-1], out_prefixes[-1].reshape(in_prefixes[-1].shape[1], -1)
        weight = (left @ right).to(compute)
        return (
            _matmul_bias(x, weight, bias),
            (x, weight, *in_cores, *out_cores, *in_prefixes, *out_prefixes),
            False,
            (0, 0),
        )

    merge_in = plan in ("half_merge", "merge_in_sweep_out")
    merge_out = plan in ("half_merge", "sweep_in_merge_out")
    saved_in: list[torch.Tensor]
    bias_slot = False
    if plan == "half_merge":
        saved_in, saved_out = chain_merge(in_cores), chain_merge(out_cores)
        rank = saved_in[-1].shape[1]
        pad = bottleneck_padding(rank, x.device.type)
        left, right = saved_in[-1].to(compute), saved_out[-1].reshape(rank, -1).to(compute)
        if pad:
            # zero columns of L and rows of R: the same product, in GEMMs the BLAS runs faster
            left = torch.nn.functional.pad(left, (0, pad))
            right = torch.nn.functional.pad(right, (0, 0, 0, pad))
        hidden = x @ left
        bias_slot = bias is not None and pad > 0
        if bias is not None and bias_slot:
            # the first zero slice carries the bias: a column of ones in the hidden state and the bias as
            # that row of R. The GEMM adds it without addmm's broadcast copy of the bias into the (B, N)
            # output, and the backward GEMM for R sums grad_y into that row: the bias gradient for free.
            hidden[:, rank] = 1
            right[rank] = bias
            y = hidden @ right
        else:
            y = _matmul_bias(hidden, right, bias)
        saved_in, saved_out = [*saved_in, left], [*saved_out, right]
    else:
        if merge_in:
            saved_in = chain_merge(in_cores)
            left = saved_in[-1].to(compute)
            hidden = x @ left
            saved_in = [*saved_in, left]
        else:
            hidden, saved_in = _sweep_in(x, [c.to(compute) for c in in_cores], in_modes)
        if merge_out:
            saved_out = chain_merge(out_cores)
            right = saved_out[-1].reshape(hidden.shape[1], -1).to(compute)
            y = _matmul_bias(hidden, right, bias)
            saved_out = [*saved_out, right]
        else:
            saved_out = chain_merge([c.to(compute) for c in out_cores], start=hidden)
            y = saved_out[-1].reshape(x.shape[0], math.prod([c.shape[1] for c in out_cores]))
            if bias is not None:
                y = y + bias
    saved = (x, hidden, *in_cores, *out_cores, *saved_in, *saved_out)
    return y, saved, bias_slot, (len(saved_in), len(saved_out))


class TTLinearFunction(torch.autograd.Function):
    """``y = x W`` for a CoMERA train, evaluated by a plan from :data:`PLANS`.

    ``x`` is 2-d ``(B, M)`` in the compute dtype; the cores may be in a wider dtype (fp32 masters under
    bf16), in which case merges run in the cores' dtype and batch GEMMs in ``x.dtype``.
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, bias: torch.Tensor | None, plan: str, in_modes: tuple, *cores: torch.Tensor
    ) -> torch.Tensor:
        y, saved, ctx.bias_slot, ctx.counts = _tt_linear_forward(x, bias, plan, in_modes, cores)
        ctx.plan, ctx.in_modes, ctx.num_in = plan, in_modes, len(in_modes)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        p, plan, in_modes = ctx.num_in, ctx.plan, ctx.in_modes
        need_x = ctx.needs_input_grad[0]
        bias_slot = ctx.bias_slot
        grad_bias = grad_y.sum(0) if ctx.needs_input_grad[1] and not bias_slot else None
        saved = ctx.saved_tensors
        x = saved[0]
        if plan == "dense":
            weight = saved[1]
            num_cores = len(saved) - 2
            cores = saved[2 : 2 + num_cores // 2]
            in_cores, out_cores = cores[:p], cores[p:]
            prefixes = saved[2 + num_cores // 2 :]
            in_prefixes, out_prefixes = prefixes[:p], prefixes[p:]
            grad_x = grad_y @ weight.transpose(0, 1) if need_x else None
            grad_w = (x.transpose(0, 1) @ grad_y).to(in_prefixes[-1].dtype)
            left, right = in_prefixes[-1], out_prefixes[-1].reshape(in_prefixes[-1].shape[1], -1)
            grad_left = grad_w @ right.transpose(0, 1)
            grad_right = left.transpose(0, 1) @ grad_w
            g_in, _ = _chain_merge_backward(in_cores, in_prefixes, grad_left, False)
            g_out, _ = _chain_merge_backward(out_cores, out_prefixes, grad_right, False)
            return (grad_x, grad_bias, None, None, *_in_layout(g_in, in_cores), *_in_layout(g_out, out_cores))

        hidden = saved[1]
        n_in_saved, n_out_saved = ctx.counts
        num_cores = len(saved) - 2 - n_in_saved - n_out_saved
        cores = saved[2 : 2 + num_cores]
        in_cores, out_cores = cores[:p], cores[p:]
        saved_in = saved[2 + num_cores : 2 + num_cores + n_in_saved]
        saved_out = saved[2 + num_cores + n_in_saved :]
        compute = x.dtype

        rank = in_cores[-1].shape[-1]  # the bottleneck; ``hidden`` may carry zero padding beyond it
        if plan in ("half_merge", "sweep_in_merge_out"):
            right = saved_out[-1]
            grad_hidden = grad_y @ right.transpose(0, 1)
            # (grad_y^T hidden)^T, not hidden^T grad_y: the same product, but MKL runs (N, B) @ (B, r) about 1.4x faster
            # than (r, B) @ (B, N) at 4096 x 768, rank 32 (a transposed view out; its consumers copy or slice it)
            grad_right_padded = (grad_y.transpose(0, 1) @ hidden).transpose(0, 1)
            if bias_slot and ctx.needs_input_grad[1]:
                grad_bias = grad_right_padded[rank]
            grad_right = grad_right_padded[:rank].to(out_cores[0].dtype)
            g_out, _ = _chain_merge_backward(out_cores, saved_out[:-1], grad_right, False)
        else:
            out_compute = [c.to(compute) for c in out_cores]
            g_out, grad_hidden = _chain_merge_backward(out_compute, saved_out, grad_y.reshape(-1, 1), True)
            g_out = [g.to(c.dtype) for g, c in zip(g_out, out_cores, strict=True)]

        if plan in ("half_merge", "merge_in_sweep_out"):
            left = saved_in[-1]
            grad_x = grad_hidden @ left.transpose(0, 1) if need_x else None
            grad_left = (x.transpose(0, 1) @ grad_hidden)[:, :rank].to(in_cores[0].dtype)
            g_in, _ = _chain_merge_backward(in_cores, saved_in[:-1], grad_left, False)
        else:
            in_compute = [c.to(compute) for c in in_cores]
            g_in, grad_x = _sweep_in_backward(grad_hidden, in_compute, in_modes, saved_in, need_x)
            g_in = [g.to(c.dtype) for g, c in zip(g_in, in_cores, strict=True)]
        return (grad_x, grad_bias, None, None, *_in_layout(g_in, in_cores), *_in_layout(g_out, out_cores))


def _in_layout(grads: Sequence[torch.Tensor], cores: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each core's gradient in the core's layout (:func:`~comera_lightning.tt.cores.grad_in_layout`)."""
    return [grad_in_layout(g, c.shape, c.stride()) for g, c in zip(grads, cores, strict=True)]


def bottleneck_padding(rank: int, device_type: str) -> int:
    """Zero slices to add to the bottleneck rank of ``half_merge`` on a CPU, up to the next multiple of 16.

    MKL's skinny GEMMs are far from monotonic in the rank. The six GEMMs of a step at 4096 x 768 rows take
    18-49 ms at ranks 2-11 and 7-11 ms at rank 16. They take 12.8-16.7 ms at ranks 26-31 and 11.3 ms at 32,
    and the same pattern repeats below 48 and 64. Ranks 17-24 are cheaper unpadded (9-10 ms), and rank 1 runs
    as a matrix-vector product (3 ms). So: pad ranks 2-15 to 16, and larger ranks when they are at most 6 below
    a multiple of 16 (docs/results.md, rank padding). Truncated layers land on exactly
    these small ranks."""
    if device_type != "cpu" or rank <= 1:
        return 0
    if rank < 16 or rank % 16 >= 10:
        return -rank % 16
    return 0


def _matmul_bias(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # addmm fuses the bias into the GEMM: a separate add is a full extra pass over the (B, N) output
    return a @ b if bias is None else torch.addmm(bias, a, b)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype :func:`tt_linear` runs the batch GEMMs of ``x`` in: autocast's where active, else ``x.dtype``."""
    if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _records_grad(x: torch.Tensor, bias: torch.Tensor | None, cores: Sequence[torch.Tensor]) -> bool:
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or (bias is not None and bias.requires_grad) or any(c.requires_grad for c in cores)


def tt_linear(
    x: torch.Tensor,
    cores: Sequence[torch.Tensor],
    in_modes: Sequence[int],
    plan: str | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x (..., M) @ W + bias`` for the TT ``cores`` whose first ``len(in_modes)`` cores span ``M``.

    Under autocast the batch GEMMs run in the autocast dtype and merges in the cores' dtype. ``plan``
    forces one of :data:`PLANS`; None asks :func:`plan_tt_linear`.
    """
    in_modes = tuple(int(m) for m in in_modes)
    M = math.prod(in_modes)
    if x.shape[-1] != M:
        raise ValueError(f"expected input with last dimension {M}, got shape {tuple(x.shape)}")
    device_type = x.device.type
    compute = compute_dtype(x)
    leading = x.shape[:-1]
    x2d = x.reshape(-1, M).to(compute)
    check_plan(plan)
    if plan is None:
        ranks = [1] + [c.shape[-1] for c in cores]
        out_modes = [c.shape[1] for c in cores[len(in_modes) :]]
        # int(): a symbolic row count (torch.compile, dynamic shapes) is specialised, so each traced graph
        # holds the plan for its rows; set a plan (ContractionPlanner) to keep rows dynamic
        plan = plan_tt_linear(in_modes, out_modes, ranks, int(x2d.shape[0]), device_type, x2d.element_size())
    if bias is not None:
        bias = bias.to(compute)
    with torch.autocast(device_type, enabled=False):
        if _records_grad(x2d, bias, cores):
            y = TTLinearFunction.apply(x2d, bias, plan, in_modes, *cores)
        else:
            # nothing to differentiate: the same contraction without the Function (which keeps nothing for a
            # backward, and which torch.compile fails to trace without grad for a two-core train)
            y = _tt_linear_forward(x2d, bias, plan, in_modes, cores)[0]
    return y.reshape(*leading, y.shape[-1])


# ---------------------------------------------------------------------------------------------------------
# merged once, reused: no-grad inference
class MergedTTLinear(NamedTuple):
    """A TT linear's weight merged once, for repeated calls without autograd (:func:`merge_tt_linear`).

    Either ``weight (M, N)``, when it is no larger than the halves (``M N <= r (M + N)``: tiny layers, huge
    ranks), or the merged input half ``left (M, r')`` and output half ``right (r', N)``, whose bottleneck is
    zero-padded to ``r' = rank + bottleneck_padding(rank)`` (the same padding as the ``half_merge`` plan).
    When padded, ``narrow`` holds contiguous unpadded copies ``(M, r)``, ``(r, N)`` for calls of few rows.
    """

    left: torch.Tensor | None
    right: torch.Tensor | None
    weight: torch.Tensor | None
    rank: int
    narrow: tuple[torch.Tensor, torch.Tensor] | None = None


def merge_tt_linear(
    cores: Sequence[torch.Tensor],
    num_in: int,
    dtype: torch.dtype,
    rows: int | None = None,
    cols: int | None = None,
    keep_factors: bool = False,
) -> MergedTTLinear:
    """The batch-free part of ``y = x W`` for the TT ``cores`` whose first ``num_in`` cores are the input side.

    Merges each side with :func:`chain_merge` in the cores' dtype, as :class:`TTLinearFunction` does, then casts
    to ``dtype`` (the compute dtype of the calls that will reuse it). ``rows`` / ``cols`` keep only the first
    ``rows`` input and ``cols`` output features (a layer's unpadded sizes), so callers neither pad ``x`` nor
    slice ``y``. ``keep_factors`` never merges ``L R`` into one matrix (a bottleneck activation sits between
    them). Run it without autograd: the result is meant to be kept, not differentiated.
    """
    with torch.autocast(cores[0].device.type, enabled=False):
        left = chain_merge(cores[:num_in])[-1]
        rank = left.shape[1]
        right = chain_merge(cores[num_in:])[-1].reshape(rank, -1)
        left, right = left[:rows], right[:, :cols]
        M, N = left.shape[0], right.shape[1]
        if not keep_factors and rank * (M + N) >= M * N:
            return MergedTTLinear(None, None, (left @ right).to(dtype).contiguous(), rank)
        pad = bottleneck_padding(rank, left.device.type)
        left, right = left.to(dtype).contiguous(), right.to(dtype).contiguous()
        if pad == 0:
            return MergedTTLinear(left, right, None, rank)
        padded = (torch.nn.functional.pad(left, (0, pad)), torch.nn.functional.pad(right, (0, 0, 0, pad)))
    return MergedTTLinear(*padded, None, rank, (left, right))


def merged_tt_linear(
    x: torch.Tensor,
    merged: MergedTTLinear,
    bias: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x (B, M) @ W + bias`` from a :class:`MergedTTLinear` in ``x``'s dtype: one GEMM, or two through the
    rank-``r`` bottleneck (``(x L) R``, or ``activation(x L) R``)."""
    if activation is not None and merged.weight is not None:
        raise ValueError("a bottleneck activation needs the factors L and R: merge with keep_factors=True")
    if merged.weight is not None:
        return _matmul_bias(x, merged.weight, bias)
    left, right = merged.left, merged.right
    if left is None or right is None:
        raise ValueError("a MergedTTLinear holds its weight or both factors L and R; this one has neither")
    if activation is not None:  # zero padding slices stay zero through the activation (it maps 0 to 0)
        return _matmul_bias(activation(x @ left), right, bias)
    if merged.narrow is not None and x.shape[0] <= left.shape[1]:
        # fewer rows than bottleneck columns (a decode step): the GEMMs mostly read L and R, which the CPU
        # padding only enlarges; it pays for skinny GEMMs of many rows (bottleneck_padding)
        left, right = merged.narrow
    return _matmul_bias(x @ left, right, bias)
