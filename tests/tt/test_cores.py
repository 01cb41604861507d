"""Rank bounds and validation, initialisation scale, reconstruction and TT-SVD."""

from __future__ import annotations

import math
import re
import threading

import pytest
import tensorly as tl
import torch
from helpers.tt_reference import F64, einsum_dense

import comera_lightning.tt.cores as cores_module
from comera_lightning.tt import (
    init_cores,
    max_ranks,
    resolve_ranks,
    tt_from_dense,
    tt_to_dense,
    ttm_from_dense,
    ttm_to_dense,
)
from comera_lightning.tt.cores import grad_in_layout


# --- max_ranks / resolve_ranks -----------------------------------------------------------------------------
def test_max_ranks_paper_fc1():
    # bonds: min(12, 24576), min(96, 3072), min(768, 3072), min(9216, 256), min(147456, 16)
    assert max_ranks([12, 8, 8, 12, 16, 16]) == [1, 12, 96, 768, 256, 16, 1]


@pytest.mark.parametrize(
    "sizes, expected",
    [([5], [1, 1]), ([4, 3], [1, 3, 1]), ([4, 3, 2, 5], [1, 4, 10, 5, 1]), ([2, 1, 3], [1, 2, 2, 1])],
)
def test_max_ranks_small(sizes, expected):
    assert max_ranks(sizes) == expected


def test_resolve_ranks_int_is_clamped():
    assert resolve_ranks([12, 8, 8, 12, 16, 16], 30) == [1, 12, 30, 30, 30, 16, 1]
    assert resolve_ranks([4, 3, 2, 5], 3) == [1, 3, 3, 3, 1]
    assert resolve_ranks([4, 3, 2, 5], 10**6) == [1, 4, 10, 5, 1]
    assert resolve_ranks([4, 3, 2, 5], 1) == [1, 1, 1, 1, 1]


def test_resolve_ranks_takes_a_single_rank_in_whatever_type_the_modes_take():
    # a rank read from a tensor or an array (a 0-d integer, as the modes accept) is one rank for every bond
    import numpy as np

    for rank in (torch.tensor(3), np.int64(3), np.array(3), 3.0):
        assert resolve_ranks([4, 3, 2, 5], rank) == [1, 3, 3, 3, 1]
    assert resolve_ranks([4, 3, 2, 5], torch.tensor([2, 7, 5])) == [1, 2, 7, 5, 1]


def test_resolve_ranks_explicit_lists():
    assert resolve_ranks([4, 3, 2, 5], [2, 7, 5]) == [1, 2, 7, 5, 1]
    assert resolve_ranks([4, 3, 2, 5], (1, 2, 7, 5, 1)) == [1, 2, 7, 5, 1]


@pytest.mark.parametrize("rank", [0, -3])
def test_resolve_ranks_rejects_non_positive_int(rank):
    with pytest.raises(ValueError, match="rank must be >= 1"):
        resolve_ranks([4, 3, 2, 5], rank)


def test_resolve_ranks_explicit_rank_above_bound():
    # bond 3 of modes [4,3,2,5] is bounded by min(24, 5) = 5
    with pytest.raises(ValueError, match=r"bond 3.*at most 5.*single int"):
        resolve_ranks([4, 3, 2, 5], [2, 2, 6])


def test_resolve_ranks_explicit_zero():
    with pytest.raises(ValueError, match="rank of bond 2 must be >= 1, got 0"):
        resolve_ranks([4, 3, 2, 5], [2, 0, 2])


@pytest.mark.parametrize("ranks", [[2, 2], [2, 2, 2, 2], [1, 2, 2, 2, 2, 1], []])
def test_resolve_ranks_wrong_length(ranks):
    message = (
        f"expected 3 internal ranks for 4 cores (modes [4, 3, 2, 5]), got {len(ranks)}: {ranks}; pass a single int "
        "to use one rank everywhere"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        resolve_ranks([4, 3, 2, 5], ranks)


@pytest.mark.parametrize("rank", [2.5, "4", [2, "x", 2]])
def test_resolve_ranks_refuses_what_is_not_an_int_or_a_list_of_ints(rank):
    message = f"rank must be an int (one rank for every bond, clamped) or a list of ints (one per bond), got {rank!r}"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        resolve_ranks([4, 3, 2, 5], rank)


def test_resolve_ranks_boundary_not_one():
    with pytest.raises(ValueError, match=r"boundary ranks must be 1, got \[2, 2, 2, 2, 1\]"):
        resolve_ranks([4, 3, 2, 5], [2, 2, 2, 2, 1])


# --- reconstruction ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, num_in", [([3, 4], 1), ([2, 3, 4], 2), ([2, 3, 2, 2], 1), ([2, 2, 3, 2, 2], 3)])
def test_tt_to_dense_matches_explicit_contraction(sizes, num_in):
    ranks = resolve_ranks(sizes, 3)
    cores = [torch.randn(ranks[k], s, ranks[k + 1], dtype=F64) for k, s in enumerate(sizes)]
    dense = tt_to_dense(cores, num_in)
    assert dense.shape == (math.prod(sizes[:num_in]), math.prod(sizes[num_in:]))
    torch.testing.assert_close(dense, einsum_dense(cores, num_in), rtol=1e-12, atol=1e-12)
    # entry by entry for one index, straight from the definition (product of core slices)
    idx = [s - 1 for s in sizes]
    chain = torch.ones(1, 1, dtype=F64)
    for core, i in zip(cores, idx, strict=True):
        chain = chain @ core[:, i, :]
    row = 0
    for i, s in zip(idx[:num_in], sizes[:num_in], strict=True):
        row = row * s + i
    col = 0
    for i, s in zip(idx[num_in:], sizes[num_in:], strict=True):
        col = col * s + i
    torch.testing.assert_close(dense[row, col], chain[0, 0])


def test_tt_to_dense_does_not_change_tensorly_backend():
    before = tl.get_backend()
    cores = [torch.randn(1, 3, 2, dtype=F64), torch.randn(2, 4, 1, dtype=F64)]
    tt_to_dense(cores, 1)
    ttm_to_dense([torch.randn(1, 3, 2, 2, dtype=F64), torch.randn(2, 4, 3, 1, dtype=F64)])
    assert tl.get_backend() == before


def _backend_of_another_thread() -> str:
    seen = []
    thread = threading.Thread(target=lambda: seen.append(tl.get_backend()))
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.parametrize(
    ("owner", "name", "call"),
    [
        (
            tl,
            "tt_to_tensor",
            lambda: tt_to_dense([torch.randn(1, 3, 2, dtype=F64), torch.randn(2, 4, 1, dtype=F64)], 1),
        ),
        (
            tl,
            "tt_matrix_to_tensor",
            lambda: ttm_to_dense([torch.randn(1, 3, 2, 2, dtype=F64), torch.randn(2, 4, 3, 1, dtype=F64)]),
        ),
        (
            cores_module,
            "tensor_train",
            lambda: tt_from_dense(torch.randn(12, 6, dtype=F64), [3, 4], [2, 3], [1, 2, 2, 2, 1]),
        ),
        (
            cores_module,
            "tensor_train_matrix",
            lambda: ttm_from_dense(torch.randn(12, 6, dtype=F64), [3, 4], [2, 3], [1, 2, 1]),
        ),
    ],
)
def test_the_pytorch_backend_is_set_for_the_calling_thread_only(monkeypatch, owner, name, call):
    # while a conversion runs, another thread (a data loader worker, another model's conversion) keeps its backend
    elsewhere = _backend_of_another_thread()
    assert elsewhere != "pytorch", "the test needs another default backend"
    inside = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        inside.append((tl.get_backend(), _backend_of_another_thread()))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    call()
    assert inside == [("pytorch", elsewhere)]
    assert tl.get_backend() == elsewhere


@pytest.mark.parametrize("row_modes, col_modes", [([7], [3]), ([3, 4], [2, 3]), ([2, 3, 2], [2, 1, 3])])
def test_ttm_to_dense_matches_definition(row_modes, col_modes):
    sizes = [v * e for v, e in zip(row_modes, col_modes, strict=True)]
    ranks = resolve_ranks(sizes, 3)
    cores = [
        torch.randn(ranks[k], v, e, ranks[k + 1], dtype=F64)
        for k, (v, e) in enumerate(zip(row_modes, col_modes, strict=True))
    ]
    dense = ttm_to_dense(cores)
    V, D = math.prod(row_modes), math.prod(col_modes)
    assert dense.shape == (V, D)
    # row i, column j: product of slices F_k[:, v_k(i), e_k(j), :] with row-major mixed-radix digits
    for i, j in [(0, 0), (V - 1, D - 1), (V // 2, D // 3)]:
        vi, ej = [], []
        a, b = i, j
        for v, e in zip(reversed(row_modes), reversed(col_modes), strict=True):
            vi.append(a % v)
            ej.append(b % e)
            a //= v
            b //= e
        vi.reverse()
        ej.reverse()
        chain = torch.ones(1, 1, dtype=F64)
        for core, v_, e_ in zip(cores, vi, ej, strict=True):
            chain = chain @ core[:, v_, e_, :]
        torch.testing.assert_close(dense[i, j], chain[0, 0])


# --- init ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sizes, rank, std",
    [([12, 8, 8, 16, 16, 12], 30, 0.02), ([16, 16, 12, 12], 8, 1.0), ([20, 24], 16, 0.3), ([64, 48], 1, 0.5)],
)
def test_init_cores_reconstructed_std(sizes, rank, std):
    ranks = resolve_ranks(sizes, rank)
    shapes = [(ranks[k], s, ranks[k + 1]) for k, s in enumerate(sizes)]
    num_in = len(sizes) // 2
    acc, seeds = 0.0, (2 if math.prod(sizes) > 10**6 else 8)
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        cores = init_cores(shapes, std, dtype=F64, generator=gen)
        assert [tuple(c.shape) for c in cores] == shapes
        acc += tt_to_dense(cores, num_in).pow(2).mean().item()
    measured = math.sqrt(acc / seeds)
    assert abs(measured / std - 1.0) < 0.2, measured


def test_init_cores_dtype_and_generator():
    shapes = [(1, 4, 3), (3, 5, 1)]
    a = init_cores(shapes, 0.1, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    b = init_cores(shapes, 0.1, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    assert all(x.dtype == torch.float64 for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # on the device asked for (meta stands in for an accelerator)
    assert all(x.device.type == "meta" for x in init_cores(shapes, 0.1, device="meta"))
    assert all(x.device.type == "meta" for x in init_cores(shapes, stds=[0.1, 0.2], device="meta"))
    for kwargs in ({}, {"std": 0.1, "stds": [0.1, 0.1]}):
        with pytest.raises(
            ValueError,
            match=r"^init_cores takes either std \(of the reconstructed tensor\) or stds \(one per core\)$",
        ):
            init_cores(shapes, **kwargs)


def test_grad_in_layout_copies_into_the_strides_asked_for_on_the_gradients_device():
    grad = torch.arange(6.0, dtype=F64).reshape(2, 3)
    assert grad_in_layout(grad, (2, 3), (3, 1)) is grad  # already laid out: no copy
    laid = grad_in_layout(grad, (2, 3), (1, 2))
    assert laid.stride() == (1, 2) and torch.equal(laid, grad)
    meta = grad_in_layout(torch.empty(2, 3, device="meta"), (2, 3), (1, 2))
    assert meta.device.type == "meta" and meta.stride() == (1, 2)


# --- TT-SVD -------------------------------------------------------------------------------------------------
def test_tt_from_dense_full_rank_is_exact():
    in_modes, out_modes = [3, 4], [2, 5]
    matrix = torch.randn(12, 10, dtype=F64)
    ranks = resolve_ranks(in_modes + out_modes, 10**6)
    cores = tt_from_dense(matrix, in_modes, out_modes, ranks)
    assert len(cores) == 4
    assert all(c.shape[-1] <= r for c, r in zip(cores, ranks[1:], strict=True))
    torch.testing.assert_close(tt_to_dense(cores, 2), matrix, rtol=1e-9, atol=1e-9)


def test_tt_from_dense_recovers_a_low_rank_train_and_pads():
    in_modes, out_modes = [3, 4], [2, 3]
    ranks = [1, 2, 2, 2, 1]
    sizes = in_modes + out_modes
    truth = [torch.randn(ranks[k], s, ranks[k + 1], dtype=F64) for k, s in enumerate(sizes)]
    full = tt_to_dense(truth, 2)  # (12, 6)
    matrix = full[:11, :5]  # not a multiple of the modes: zero-padded inside
    cores = tt_from_dense(matrix, in_modes, out_modes, [1, 3, 3, 3, 1])
    rebuilt = tt_to_dense(cores, 2)
    assert rebuilt.shape == (12, 6)
    torch.testing.assert_close(rebuilt[:11, :5], matrix, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(rebuilt[11:], torch.zeros(1, 6, dtype=F64), rtol=0, atol=1e-8)


def test_tt_from_dense_matrix_too_big():
    with pytest.raises(
        ValueError,
        match=r"matrix of shape \(13, 6\) does not fit modes of size \(12, 6\); choose modes whose products are",
    ):
        tt_from_dense(torch.randn(13, 6), [3, 4], [2, 3], [1, 2, 2, 2, 1])


def test_ttm_from_dense_full_rank_is_exact():
    row_modes, col_modes = [3, 4], [2, 3]
    matrix = torch.randn(12, 6, dtype=F64)
    cores = ttm_from_dense(matrix, row_modes, col_modes, [1, 6, 1])
    assert [c.dim() for c in cores] == [4, 4]
    torch.testing.assert_close(ttm_to_dense(cores), matrix, rtol=1e-9, atol=1e-9)


def test_resolve_ranks_explicit_list_takes_rank_one_bonds():
    # rank 1 is the smallest valid rank (a bond cut down to one slice): taken literally, like any other
    assert resolve_ranks([4, 3, 2, 5], [1, 2, 1]) == [1, 1, 2, 1, 1]
    assert resolve_ranks([4, 3, 2, 5], (1, 1, 1, 1, 1)) == [1, 1, 1, 1, 1]


def test_init_cores_spreads_the_scale_over_the_cores_by_their_trailing_rank():
    # each core gets std**(1/K) / sqrt(r_k): the cores stay balanced, whichever bond is wide
    shapes = [(1, 512, 16), (16, 256, 2), (2, 1024, 1)]
    cores = init_cores(shapes, 0.5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    per_core = 0.5 ** (1 / 3)
    for core, shape in zip(cores, shapes, strict=True):
        assert float(core.std()) == pytest.approx(per_core / math.sqrt(shape[-1]), rel=0.1)  # mutants: >= 41 % off
