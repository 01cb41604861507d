"""TT-matrix lookups: half-merge vs the per-row chain vs the dense table (tensorly), with gradients."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tt_reference import F64, FULL_RANK

from comera_lightning.tt import merge_ttm, resolve_ranks, ttm_lookup, ttm_lookup_chain, ttm_to_dense
from comera_lightning.tt.ttm import split_point

TTM_CONFIGS = [([7], [3]), ([3, 4], [2, 3]), ([2, 3, 2], [2, 1, 3]), ([2, 3, 2, 2], [2, 2, 1, 2])]
TTM_IDS = ["1core", "2cores", "3cores", "4cores"]


def random_ttm(row_modes, col_modes, rank):
    sizes = [v * e for v, e in zip(row_modes, col_modes, strict=True)]
    ranks = resolve_ranks(sizes, rank)
    return [
        (torch.randn(ranks[k], v, e, ranks[k + 1], dtype=F64) / math.sqrt(ranks[k])).requires_grad_()
        for k, (v, e) in enumerate(zip(row_modes, col_modes, strict=True))
    ]


def test_split_point():
    assert [split_point(k) for k in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]


@pytest.mark.parametrize("rank", [1, FULL_RANK], ids=["rank1", "full"])
@pytest.mark.parametrize("row_modes, col_modes", TTM_CONFIGS, ids=TTM_IDS)
def test_merge_ttm_is_the_dense_table(row_modes, col_modes, rank):
    cores = random_ttm(row_modes, col_modes, rank)
    merged = merge_ttm(cores)
    V, D = math.prod(row_modes), math.prod(col_modes)
    assert merged.shape == (1, V, D, 1)
    torch.testing.assert_close(merged[0, :, :, 0], ttm_to_dense(cores))


@pytest.mark.parametrize("deduplicate", [False, True], ids=["dedup_off", "dedup_on"])
@pytest.mark.parametrize("rank", [1, FULL_RANK], ids=["rank1", "full"])
@pytest.mark.parametrize("row_modes, col_modes", TTM_CONFIGS, ids=TTM_IDS)
def test_lookup_matches_chain_and_dense(row_modes, col_modes, rank, deduplicate):
    cores = random_ttm(row_modes, col_modes, rank)
    V, D = math.prod(row_modes), math.prod(col_modes)
    ids = torch.cat([torch.tensor([0, V - 1, V - 1, 0]), torch.randint(0, V, (11,))])
    upstream = torch.randn(ids.numel(), D, dtype=F64)

    rows = ttm_lookup(cores, ids, deduplicate=deduplicate)
    chain = ttm_lookup_chain(cores, ids, row_modes)
    dense = ttm_to_dense(cores)[ids]
    assert rows.shape == chain.shape == dense.shape == (ids.numel(), D)
    torch.testing.assert_close(rows, dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chain, dense, rtol=1e-12, atol=1e-12)

    g_rows = torch.autograd.grad((rows * upstream).sum(), cores)
    g_chain = torch.autograd.grad((chain * upstream).sum(), cores)
    g_dense = torch.autograd.grad((dense * upstream).sum(), cores)
    for a, b, c in zip(g_rows, g_chain, g_dense, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(b, c, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("row_modes, col_modes", TTM_CONFIGS[1:], ids=TTM_IDS[1:])
def test_lookup_gradcheck(row_modes, col_modes):
    cores = random_ttm(row_modes, col_modes, 2)
    V = math.prod(row_modes)
    ids = torch.tensor([0, V - 1, 3 % V, 3 % V])
    for dedup in (False, True):
        assert torch.autograd.gradcheck(lambda *c, dedup=dedup: ttm_lookup(list(c), ids, dedup), tuple(cores))


def test_dedup_equal_including_gradients_with_heavy_repetition():
    cores = random_ttm([3, 4], [2, 3], 3)
    ids = torch.tensor([5, 5, 5, 1, 5, 11, 1, 0, 5])
    upstream = torch.randn(ids.numel(), 6, dtype=F64)
    a = ttm_lookup(cores, ids, deduplicate=False)
    b = ttm_lookup(cores, ids, deduplicate=True)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    ga = torch.autograd.grad((a * upstream).sum(), cores)
    gb = torch.autograd.grad((b * upstream).sum(), cores)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_lookup_empty_ids():
    cores = random_ttm([3, 4], [2, 3], 2)
    out = ttm_lookup(cores, torch.empty(0, dtype=torch.long))
    assert out.shape == (0, 6)
