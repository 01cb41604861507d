"""Rank gates, masks, parameter counting and truncation selections (pure tensor functions)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tt_reference import F64, random_train

from comera_lightning.tt import (
    DEFAULT_THRESHOLD,
    CoreSelection,
    apply_gates,
    bond_weights,
    leading_share,
    minimum_train_size,
    refresh_mask,
    select_rank_slices,
    train_parameter_count,
    truncate_train,
    tt_linear,
    tt_to_dense,
)


def test_default_threshold_is_the_papers_tau():
    assert DEFAULT_THRESHOLD == 1e-2


def test_refresh_mask_switches_off_small_gates():
    gate = torch.tensor([1.0, -0.5, 0.01, -0.009, 0.2])
    mask = torch.ones(5, dtype=torch.bool)
    new = refresh_mask(gate, mask, 1e-2)
    # |d| <= tau is inactive (0.01 exactly is off), sign does not matter
    assert new.tolist() == [True, True, False, False, True]
    assert new.dtype == torch.bool
    assert mask.all()  # input untouched


def test_refresh_mask_dead_slices_stay_dead():
    gate = torch.tensor([1.0, 1.0, 1.0])
    mask = torch.tensor([True, False, True])
    assert refresh_mask(gate, mask, 1e-2).tolist() == [True, False, True]


def test_refresh_mask_keeps_exactly_one_slice_when_all_die():
    gate = torch.tensor([0.001, -0.008, 0.005, 0.5])
    mask = torch.tensor([True, True, True, False])  # 0.5 is already dead: may not be revived
    new = refresh_mask(gate, mask, 1e-2)
    assert int(new.sum()) == 1
    assert new.tolist() == [False, True, False, False]  # largest |gate| among the previously active


def test_leading_share_rounds_to_the_nearest_slice_and_keeps_one():
    # 0.7 of 4 slices is 2.8: three are kept, not the two a floor would leave; 0.6 of 4 is 2.4: two
    assert [leading_share(4, keep) for keep in (0.6, 0.7, 1.0)] == [2, 3, 4]
    assert leading_share(10, 0.26) == 3 and leading_share(10, 0.24) == 2
    # a share too small to keep a whole slice still keeps one, so the bond is never empty
    assert leading_share(8, 0.0) == 1 and leading_share(8, 0.05) == 1 and leading_share(1, 0.3) == 1
    with pytest.raises(ValueError, match=r"keep must be a share in \[0, 1\], got 1.2"):
        leading_share(4, 1.2)
    with pytest.raises(ValueError, match=r"keep must be a share in \[0, 1\], got -0.1"):
        leading_share(4, -0.1)


def test_apply_gates_scales_trailing_index_and_masks():
    cores = [torch.randn(1, 3, 2, dtype=F64), torch.randn(2, 4, 2, dtype=F64), torch.randn(2, 5, 1, dtype=F64)]
    gates = [torch.tensor([2.0, 3.0]), torch.tensor([0.5, 7.0])]
    masks = [torch.tensor([True, True]), torch.tensor([True, False])]
    gated = apply_gates(cores, gates, masks)
    assert all(g.dtype == F64 for g in gated)  # fp32 gates are cast to the cores' dtype
    torch.testing.assert_close(gated[0][..., 0], 2 * cores[0][..., 0])
    torch.testing.assert_close(gated[0][..., 1], 3 * cores[0][..., 1])
    torch.testing.assert_close(gated[1][..., 0], 0.5 * cores[1][..., 0])
    assert torch.all(gated[1][..., 1] == 0)
    assert gated[2] is cores[2]  # the last core has no gate


def test_apply_gates_ttm_cores():
    cores = [torch.randn(1, 3, 2, 2, dtype=F64), torch.randn(2, 4, 2, 1, dtype=F64)]
    gated = apply_gates(cores, [torch.tensor([2.0, -1.0])], [torch.ones(2, dtype=torch.bool)])
    torch.testing.assert_close(gated[0], cores[0] * torch.tensor([2.0, -1.0], dtype=F64))


def test_train_parameter_count_by_hand():
    # modes [4,3,2,5], ranks [1,3,3,3,1]: 1*4*3 + 3*3*3 + 3*2*3 + 3*5*1 = 12 + 27 + 18 + 15
    assert train_parameter_count([4, 3, 2, 5], [1, 3, 3, 3, 1]) == 72
    # TTM core sizes are v*e: (16*4, 20*4, 10*8, 10*6) with ranks [1,32,32,32,1]
    assert train_parameter_count([64, 80, 80, 60], [1, 32, 32, 32, 1]) == 64 * 32 + 32 * 80 * 32 * 2 + 32 * 60


def test_bond_weights_are_what_one_slice_holds_and_the_floor_is_rank_one():
    modes, ranks = [4, 3, 2, 5], [1, 3, 2, 4, 1]
    # bond 0: r0*s0 + s1*r2 = 1*4 + 3*2; bond 1: 3*3 + 2*4; bond 2: 2*2 + 5*1
    assert bond_weights(modes, ranks) == [10.0, 17.0, 9.0]
    for k, weight in enumerate(bond_weights(modes, ranks)):
        smaller = list(ranks)
        smaller[k + 1] -= 1
        assert train_parameter_count(modes, ranks) - train_parameter_count(modes, smaller) == weight
    assert minimum_train_size(modes) == train_parameter_count(modes, [1] * 5) == 14
    assert bond_weights([7], [1, 1]) == []


def test_truncate_train_selections():
    masks = [torch.tensor([True, False, True]), torch.tensor([False, True])]
    core_sel, gate_sel = truncate_train(masks, 3)
    assert len(core_sel) == 3 and len(gate_sel) == 2
    assert core_sel[0].keep_first is None and core_sel[0].keep_last.tolist() == [0, 2]
    assert core_sel[1].keep_first.tolist() == [0, 2] and core_sel[1].keep_last.tolist() == [1]
    assert core_sel[2].keep_first.tolist() == [1] and core_sel[2].keep_last is None
    assert [g.keep_last.tolist() for g in gate_sel] == [[0, 2], [1]]


def test_select_rank_slices_core_and_gate():
    core = torch.arange(3 * 4 * 5, dtype=F64).reshape(3, 4, 5)
    sel = CoreSelection(torch.tensor([0, 2]), torch.tensor([1, 4]))
    out = select_rank_slices(core, sel)
    assert out.shape == (2, 4, 2) and out.is_contiguous()
    torch.testing.assert_close(out, core[[0, 2]][:, :, [1, 4]])
    gate = torch.arange(5.0)
    assert select_rank_slices(gate, sel).tolist() == [1.0, 4.0]
    assert select_rank_slices(gate, CoreSelection(None, None)) is gate
    torch.testing.assert_close(select_rank_slices(core, CoreSelection(None, None)), core)


@pytest.mark.parametrize("in_modes, out_modes", [([2, 3], [3, 2]), ([2, 2, 2], [3, 2]), ([4], [2, 3])])
def test_truncation_preserves_the_function(in_modes, out_modes):
    cores, ranks = random_train(in_modes, out_modes, 10**6, requires_grad=False)
    gates = [torch.rand(r, dtype=F64) + 0.5 for r in ranks[1:-1]]
    masks = [torch.rand(r) > 0.4 for r in ranks[1:-1]]
    for m in masks:
        m[0] = True  # at least one survivor per bond
    before = tt_to_dense(apply_gates(cores, gates, masks), len(in_modes))
    core_sel, gate_sel = truncate_train(masks, len(cores))
    small_cores = [select_rank_slices(c, s) for c, s in zip(cores, core_sel, strict=True)]
    small_gates = [select_rank_slices(g, s) for g, s in zip(gates, gate_sel, strict=True)]
    small_masks = [torch.ones(int(m.sum()), dtype=torch.bool) for m in masks]
    for k, m in enumerate(masks):
        assert small_cores[k].shape[-1] == int(m.sum()) == small_gates[k].numel()
        assert small_cores[k + 1].shape[0] == int(m.sum())
    after = tt_to_dense(apply_gates(small_cores, small_gates, small_masks), len(in_modes))
    torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)
    x = torch.randn(3, math.prod(in_modes), dtype=F64)
    torch.testing.assert_close(
        tt_linear(x, apply_gates(small_cores, small_gates, small_masks), in_modes, "half_merge"), x @ before
    )
