"""Merged once, reused: ``merge_tt_linear`` / ``merged_tt_linear`` and ``ttm_halves`` / ``ttm_lookup_halves``
(what the layers keep for inference) against float64 dense references (tensorly) and the per-row chain."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tt_reference import (
    F64,
    FULL_RANK,
    MODE_CONFIGS,
    MODE_IDS,
    dense_reference,
    gate_by_hand,
    random_gates,
    random_train,
)

from comera_lightning.tt import (
    apply_gates,
    merge_tt_linear,
    merged_tt_linear,
    resolve_ranks,
    ttm_halves,
    ttm_lookup,
    ttm_lookup_chain,
    ttm_lookup_halves,
)
from comera_lightning.tt.contract import bottleneck_padding


def _gated_train(in_modes, out_modes, rank, dtype=F64):
    cores, ranks = random_train(in_modes, out_modes, rank, dtype=dtype, requires_grad=False)
    gates, masks = random_gates(ranks, requires_grad=False)
    return apply_gates(cores, gates, masks), gate_by_hand(cores, gates, masks)


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("rank", [1, 3, FULL_RANK], ids=["rank1", "rank3", "full"])
@pytest.mark.parametrize("in_modes, out_modes", MODE_CONFIGS, ids=MODE_IDS)
def test_merged_linear_matches_dense_reference(in_modes, out_modes, rank, rows):
    gated, by_hand = _gated_train(in_modes, out_modes, rank)
    p, M, N = len(in_modes), math.prod(in_modes), math.prod(out_modes)
    weight = dense_reference(by_hand, p)
    x, bias = torch.randn(rows, M, dtype=F64), torch.randn(N, dtype=F64)
    merged = merge_tt_linear(gated, p, F64)
    bottleneck = gated[p - 1].shape[-1]
    # the dense weight exactly when it is no larger than the two halves
    assert (merged.weight is not None) == (bottleneck * (M + N) >= M * N) and merged.rank == bottleneck
    torch.testing.assert_close(merged_tt_linear(x, merged, bias), x @ weight + bias, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_tt_linear(x, merged), x @ weight, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [1, 16, 17, 100])
def test_padded_bottleneck_on_cpu_is_used_only_for_many_rows_and_gives_the_same_values(rows):
    gated, by_hand = _gated_train([4, 6], [5, 6], 3)
    merged = merge_tt_linear(gated, 2, F64)
    padded = 3 + bottleneck_padding(3, "cpu")
    assert padded == 16 and merged.left.shape == (24, padded) and merged.right.shape == (padded, 30)
    assert not merged.left[:, 3:].any() and not merged.right[3:].any()  # zero slices: the same product
    # the unpadded halves, kept contiguous for calls of few rows (no strided slice per call)
    narrow_left, narrow_right = merged.narrow
    assert narrow_left.shape == (24, 3) and narrow_right.shape == (3, 30)
    assert narrow_left.is_contiguous() and narrow_right.is_contiguous()
    assert torch.equal(narrow_left, merged.left[:, :3]) and torch.equal(narrow_right, merged.right[:3])
    x = torch.randn(rows, 24, dtype=F64)
    torch.testing.assert_close(merged_tt_linear(x, merged), x @ dense_reference(by_hand, 2), rtol=1e-12, atol=1e-12)


def test_rows_and_cols_keep_the_unpadded_features_only():
    gated, by_hand = _gated_train([5, 8], [3, 7], 3)
    weight = dense_reference(by_hand, 2)[:37, :20]
    merged = merge_tt_linear(gated, 2, F64, rows=37, cols=20)
    assert merged.left.shape[0] == 37 and merged.right.shape[1] == 20
    assert merged.left.is_contiguous() and merged.right.is_contiguous()
    x = torch.randn(3, 37, dtype=F64)
    torch.testing.assert_close(merged_tt_linear(x, merged), x @ weight, rtol=1e-12, atol=1e-12)


def test_merges_in_the_cores_dtype_and_casts_once_even_under_autocast():
    gated, by_hand = _gated_train([4, 4], [4, 4], 2, dtype=torch.float32)
    plain = merge_tt_linear(gated, 2, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = merge_tt_linear(gated, 2, torch.bfloat16)
    assert plain.left.dtype == plain.right.dtype == torch.bfloat16
    # autocast does not reach the merge (float32 merge, one cast): the same bits as without autocast
    assert torch.equal(plain.left, under_autocast.left) and torch.equal(plain.right, under_autocast.right)
    x = torch.randn(2, 16)
    got = merged_tt_linear(x.bfloat16(), under_autocast).double()
    torch.testing.assert_close(got, x.double() @ dense_reference(by_hand, 2).double(), rtol=3e-2, atol=3e-2)


def test_a_merged_weight_is_cast_to_the_dtype_of_the_calls_that_reuse_it():
    gated, by_hand = _gated_train([2, 2], [2, 2], 4, dtype=torch.float32)  # rank 4 on 4 x 4: the weight is merged
    merged = merge_tt_linear(gated, 2, F64)
    assert merged.left is None and merged.weight is not None and merged.weight.dtype == F64
    x = torch.randn(3, 4, dtype=F64)
    torch.testing.assert_close(merged_tt_linear(x, merged), x @ dense_reference(by_hand, 2).double())


def test_halves_that_need_no_padding_keep_no_second_copy():
    rank = 17  # cheaper unpadded on a CPU (bottleneck_padding)
    assert bottleneck_padding(rank, "cpu") == 0
    gated, by_hand = _gated_train([6, 6], [6, 6], rank)
    merged = merge_tt_linear(gated, 2, F64)
    assert merged.left.shape == (36, rank) and merged.narrow is None
    x = torch.randn(2, 36, dtype=F64)
    torch.testing.assert_close(merged_tt_linear(x, merged), x @ dense_reference(by_hand, 2), rtol=1e-12, atol=1e-12)


def test_a_merged_linear_without_its_factors_says_how_to_merge_it():
    gated, _ = _gated_train([2, 2], [2, 2], 4)
    weight_only = merge_tt_linear(gated, 2, F64)
    x = torch.randn(1, 4, dtype=F64)
    with pytest.raises(
        ValueError, match=r"^a bottleneck activation needs the factors L and R: merge with keep_factors=True$"
    ):
        merged_tt_linear(x, weight_only, activation=torch.relu)
    kept = merge_tt_linear(gated, 2, F64, keep_factors=True)
    for broken in (kept._replace(right=None), kept._replace(left=None), kept._replace(left=None, right=None)):
        with pytest.raises(
            ValueError, match=r"^a MergedTTLinear holds its weight or both factors L and R; this one has neither$"
        ):
            merged_tt_linear(x, broken)


# --- TT-matrix halves ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("deduplicate", [False, True])
@pytest.mark.parametrize(
    "row_modes, col_modes", [([7], [3]), ([3, 4], [2, 3]), ([2, 3, 2], [2, 1, 3])], ids=["1core", "2cores", "3cores"]
)
def test_lookup_from_kept_halves_matches_the_chain(row_modes, col_modes, deduplicate):
    sizes = [v * e for v, e in zip(row_modes, col_modes, strict=True)]
    ranks = resolve_ranks(sizes, FULL_RANK)
    cores = [
        torch.randn(ranks[k], v, e, ranks[k + 1], dtype=F64) / math.sqrt(ranks[k])
        for k, (v, e) in enumerate(zip(row_modes, col_modes, strict=True))
    ]
    V = math.prod(row_modes)
    left, right = ttm_halves(cores)
    for ids in (torch.tensor([V - 1]), torch.tensor([0, 5 % V, 0, V - 1, 5 % V]), torch.tensor([], dtype=torch.long)):
        got = ttm_lookup_halves(left, right, ids, deduplicate)
        torch.testing.assert_close(got, ttm_lookup_chain(cores, ids, row_modes), rtol=1e-12, atol=1e-12)
        assert torch.equal(got, ttm_lookup(cores, ids, deduplicate))
