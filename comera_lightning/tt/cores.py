"""Tensor-train cores: rank validation, initialisation, reconstruction and TT-SVD from dense weights.

Two formats, both trains of cores ``G_k`` indexed ``(r_{k-1}, ..., r_k)`` with ``r_0 = r_K = 1``:

* TT (linears, CoMERA's format): a train over the input modes then the output modes of ``W (M x N)``,
  cores ``(r_{k-1}, s_k, r_k)``. The bond between the last input core and the first output core is a
  low-rank bottleneck, which is what makes ``y = (x L) R`` cheap.
* TTM (embeddings): cores ``(r_{k-1}, v_k, e_k, r_k)`` with row modes ``v`` and column modes ``e``.

Reconstruction and decomposition go through tensorly inside ``tl.backend_context("pytorch",
local_threadsafe=True)``: the backend changes for the calling thread only, for the call only, so neither the
caller's global tensorly backend nor another thread's is changed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import tensorly as tl
import torch
from tensorly.decomposition import tensor_train, tensor_train_matrix

from .modes import _as_int, _int_list

__all__ = [
    "grad_in_layout",
    "init_cores",
    "keep_grad_layout",
    "max_ranks",
    "resolve_ranks",
    "tt_from_dense",
    "tt_to_dense",
    "ttm_from_dense",
    "ttm_to_dense",
]


def grad_in_layout(grad: torch.Tensor, shape: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """``grad`` laid out with ``strides`` (a copy only when it is not already).

    DDP's reducer expects every gradient in its parameter's layout and otherwise copies it into the bucket at
    every step (warning "Grad strides do not match bucket view strides"). Contractions produce gradients in
    whatever layout their last product left, including odd strides on size-1 rank dimensions.
    """
    if tuple(grad.stride()) == tuple(strides):
        return grad
    return torch.empty_strided(tuple(shape), tuple(strides), dtype=grad.dtype, device=grad.device).copy_(grad)


class _KeepGradLayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        ctx.layout = (tensor.shape, tensor.stride())
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad_in_layout(grad, *ctx.layout)


def keep_grad_layout(core: torch.Tensor) -> torch.Tensor:
    """``core`` itself, whose gradient arrives in ``core``'s layout (see :func:`grad_in_layout`)."""
    return _KeepGradLayout.apply(core)


def max_ranks(mode_sizes: Sequence[int]) -> list[int]:
    """Largest useful rank of every bond (boundary ones included): min of the two unfoldings."""
    sizes = list(mode_sizes)
    bounds = [1]
    for k in range(1, len(sizes)):
        bounds.append(min(math.prod(sizes[:k]), math.prod(sizes[k:])))
    bounds.append(1)
    return bounds


def resolve_ranks(mode_sizes: Sequence[int], rank: int | Sequence[int]) -> list[int]:
    """Turn a rank request into the full rank list ``[1, r_1, ..., r_{K-1}, 1]``.

    A single int (or a whole float, or a 0-d integer tensor or array) is the paper's convention: every internal
    bond gets ``rank``, clamped to what the unfoldings allow (``r_1 <= s_1`` and so on). An explicit list of the
    ``K - 1`` internal ranks (or all ``K + 1`` with the boundary ones) is taken literally and must fit.

    Raises:
        TypeError: ``rank`` is neither an int nor a list of ints (e.g. 2.5 or a string).
        ValueError: a rank is < 1, the list has the wrong length, or an explicit rank exceeds its bound.
    """
    bounds = max_ranks(mode_sizes)
    num_bonds = len(bounds) - 2
    single = _as_int(rank)  # also a 0-d tensor or array, as the modes take it
    if single is not None:
        rank = single
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        return [1] + [min(rank, b) for b in bounds[1:-1]] + [1]
    ranks = _int_list(rank)
    if ranks is None:
        raise TypeError(
            f"rank must be an int (one rank for every bond, clamped) or a list of ints (one per bond), got {rank!r}"
        )
    if len(ranks) == num_bonds + 2:
        if ranks[0] != 1 or ranks[-1] != 1:
            raise ValueError(f"boundary ranks must be 1, got {ranks}")
        ranks = ranks[1:-1]
    if len(ranks) != num_bonds:
        raise ValueError(
            f"expected {num_bonds} internal ranks for {len(bounds) - 1} cores (modes {list(mode_sizes)}), "
            f"got {len(ranks)}: {ranks}; pass a single int to use one rank everywhere"
        )
    for k, (r, bound) in enumerate(zip(ranks, bounds[1:-1], strict=True), start=1):
        if r < 1:
            raise ValueError(f"rank of bond {k} must be >= 1, got {r}")
        if r > bound:
            raise ValueError(
                f"rank of bond {k} is {r} but modes {list(mode_sizes)} allow at most {bound} there "
                f"(the smaller unfolding); lower it or pass a single int rank to clamp automatically"
            )
    return [1, *ranks, 1]


def init_cores(
    core_shapes: Sequence[Sequence[int]],
    std: float | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
    stds: Sequence[float] | None = None,
) -> list[torch.Tensor]:
    """Random Gaussian cores: the reconstructed entries with standard deviation ``std``, or core ``k`` drawn with
    std ``stds[k]`` (a per-core parameterisation, :mod:`.parameterization`); give exactly one of the two.

    With ``std``: an entry of the full tensor is a sum over ``prod(r_k)`` rank paths, each a product of ``K``
    independent core entries, so core ``k`` gets ``N(0, 1) * std**(1/K) / sqrt(r_k)`` (``r_K = 1``).
    """
    if (std is None) == (stds is None):
        raise ValueError("init_cores takes either std (of the reconstructed tensor) or stds (one per core)")
    if stds is None:
        assert std is not None
        per_core = std ** (1.0 / len(core_shapes))
        stds = [per_core / math.sqrt(shape[-1]) for shape in core_shapes]
    elif len(stds) != len(core_shapes):
        raise ValueError(f"stds gives {len(stds)} stds for {len(core_shapes)} cores")
    return [
        torch.randn(tuple(shape), dtype=dtype, device=device, generator=generator) * scale
        for shape, scale in zip(core_shapes, stds, strict=True)
    ]


def tt_to_dense(cores: Sequence[torch.Tensor], num_rows_modes: int) -> torch.Tensor:
    """Reconstruct the ``(M, N)`` matrix of a TT whose first ``num_rows_modes`` cores span ``M``."""
    with tl.backend_context("pytorch", local_threadsafe=True):
        full = tl.tt_to_tensor(list(cores))
    rows = math.prod(full.shape[:num_rows_modes])
    return full.reshape(rows, -1)


def ttm_to_dense(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Reconstruct the ``(V, D)`` matrix of a TT-matrix (rows ``v_1..v_k``, columns ``e_1..e_k``)."""
    with tl.backend_context("pytorch", local_threadsafe=True):
        full = tl.tt_matrix_to_tensor(list(cores))
    num = len(cores)
    return full.reshape(math.prod(full.shape[:num]), -1)


def tt_from_dense(
    matrix: torch.Tensor, in_modes: Sequence[int], out_modes: Sequence[int], ranks: Sequence[int]
) -> list[torch.Tensor]:
    """TT-SVD of ``matrix (M x N)`` (zero-padded to the modes) with at most ``ranks``.

    Returned ranks can be smaller than asked where the matrix has lower rank; callers adopt them.
    """
    rows, cols = math.prod(in_modes), math.prod(out_modes)
    padded = _zero_pad(matrix.detach(), rows, cols)
    with tl.backend_context("pytorch", local_threadsafe=True):
        factors = tensor_train(padded.reshape(*in_modes, *out_modes), rank=list(ranks)).factors
    return [f.contiguous() for f in factors]


def ttm_from_dense(
    matrix: torch.Tensor, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int]
) -> list[torch.Tensor]:
    """TT-matrix SVD of ``matrix (V x D)`` (zero-padded to the modes) with at most ``ranks``."""
    rows, cols = math.prod(row_modes), math.prod(col_modes)
    padded = _zero_pad(matrix.detach(), rows, cols)
    with tl.backend_context("pytorch", local_threadsafe=True):
        factors = tensor_train_matrix(padded.reshape(*row_modes, *col_modes), rank=list(ranks)).factors
    return [f.contiguous() for f in factors]


def _zero_pad(matrix: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if matrix.shape[0] > rows or matrix.shape[1] > cols:
        raise ValueError(
            f"matrix of shape {tuple(matrix.shape)} does not fit modes of size ({rows}, {cols}); choose modes whose "
            f"products are at least its shape"
        )
    return torch.nn.functional.pad(matrix, (0, cols - matrix.shape[1], 0, rows - matrix.shape[0]))
