"""TTEmbedding: lookups vs the tensorly table, padding, dedup, padded vocabularies, init, errors."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import tensorly as tl
import torch
from helpers.nn_reference import F64, FULL_RANK, gate_by_hand, randomize_gates_, reference_embedding_table
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from comera_lightning.nn import TTEmbedding, reusing_inference_factors
from comera_lightning.tt import ttm_lookup_chain

# (num_embeddings, embedding_dim, vocab_modes, dim_modes): 1..4 cores, exact and padded vocabularies
CONFIGS = [
    (7, 3, [7], [3]),
    (12, 6, [3, 4], [2, 3]),
    (11, 6, [3, 4], [2, 3]),  # padded: 12 rows, 11 used
    (12, 6, [2, 3, 2], [2, 1, 3]),
    (24, 8, [2, 3, 2, 2], [2, 2, 1, 2]),
    (22, 8, [2, 3, 2, 2], [2, 2, 1, 2]),  # padded
]
IDS = ["1core", "2cores", "2cores_pad", "3cores", "4cores", "4cores_pad"]


def make(V, D, vocab_modes, dim_modes, rank, **kw):
    layer = TTEmbedding(V, D, rank, vocab_modes=vocab_modes, dim_modes=dim_modes, dtype=F64, **kw)
    return randomize_gates_(layer)


@pytest.mark.parametrize("deduplicate", [False, True], ids=["dedup_off", "dedup_on"])
@pytest.mark.parametrize("rank", [1, FULL_RANK], ids=["rank1", "full"])
@pytest.mark.parametrize("V, D, vocab_modes, dim_modes", CONFIGS, ids=IDS)
def test_lookup_matches_chain_and_dense(V, D, vocab_modes, dim_modes, rank, deduplicate):
    layer = make(V, D, vocab_modes, dim_modes, rank, deduplicate=deduplicate)
    ids = torch.cat([torch.tensor([0, V - 1, V - 1]), torch.randint(0, V, (9,))]).reshape(2, 2, 3)
    upstream = torch.randn(2, 2, 3, D, dtype=F64)
    params = [*layer.cores, *layer.gates]

    out = layer(ids)
    assert out.shape == (2, 2, 3, D) and out.dtype == F64
    grads = torch.autograd.grad((out * upstream).sum(), params)

    table = reference_embedding_table(layer)
    assert table.shape == (V, D)
    ref = table[ids]
    grads_ref = torch.autograd.grad((ref * upstream).sum(), params)

    gated = gate_by_hand(list(layer.cores), list(layer.gates), layer.rank_masks)
    chain = ttm_lookup_chain(gated, ids.reshape(-1), layer.vocab_modes).reshape(2, 2, 3, D)

    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chain, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.weight_dense(), table, rtol=1e-12, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "V, D, vocab_modes, dim_modes", [CONFIGS[1], CONFIGS[3], CONFIGS[5]], ids=["2c", "3c", "4c_pad"]
)
def test_module_gradcheck(V, D, vocab_modes, dim_modes):
    layer = make(V, D, vocab_modes, dim_modes, 2, padding_idx=1)
    names = [n for n, _ in layer.named_parameters()]
    tensors = [p.detach().clone().double().requires_grad_() for _, p in layer.named_parameters()]
    ids = torch.tensor([[0, 1, V - 1], [2, 2, 1]])

    def fn(*values):
        return torch.func.functional_call(layer, dict(zip(names, values, strict=True)), (ids,))

    assert torch.autograd.gradcheck(fn, tuple(tensors))


def test_dedup_equal_including_gradients():
    a = make(24, 8, [2, 3, 2, 2], [2, 2, 1, 2], 3, deduplicate=False)
    b = make(24, 8, [2, 3, 2, 2], [2, 2, 1, 2], 3, deduplicate=True)
    b.load_state_dict(a.state_dict())
    ids = torch.tensor([[5, 5, 5, 23, 0], [5, 0, 7, 7, 23]])
    upstream = torch.randn(2, 5, 8, dtype=F64)
    (a(ids) * upstream).sum().backward()
    (b(ids) * upstream).sum().backward()
    torch.testing.assert_close(a(ids), b(ids), rtol=0, atol=1e-14)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("deduplicate", [False, True])
@pytest.mark.parametrize("padding_idx", [3, -2])
def test_padding_idx(padding_idx, deduplicate):
    layer = make(12, 6, [3, 4], [2, 3], 3, padding_idx=padding_idx, deduplicate=deduplicate)
    pad = padding_idx % 12
    assert layer.padding_idx == pad
    ids = torch.tensor([[pad, 1, pad, 4], [0, pad, 11, 1]])
    out = layer(ids)
    assert torch.all(out[ids == pad] == 0)
    assert torch.all(layer.weight_dense()[pad] == 0)
    torch.testing.assert_close(out[ids != pad], reference_embedding_table(layer)[ids[ids != pad]])
    # the padding tokens contribute nothing to the gradient: same grads as without them
    upstream = torch.randn(2, 4, 6, dtype=F64)
    grads = torch.autograd.grad((out * upstream).sum(), list(layer.parameters()))
    keep = ids != pad
    without = layer(ids[keep])
    grads_without = torch.autograd.grad((without * upstream[keep]).sum(), list(layer.parameters()))
    for g, h in zip(grads, grads_without, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)
    # only padding tokens: exactly zero gradient
    only = layer(torch.full((3,), pad))
    grads_only = torch.autograd.grad(only.sum(), list(layer.parameters()))
    assert all(torch.all(g == 0) for g in grads_only)


def test_vocab_30522_is_padded_and_never_exposes_padded_rows():
    layer = TTEmbedding(30522, 16, 4)
    assert len(layer.vocab_modes) == 4 and len(layer.dim_modes) == 4
    assert math.prod(layer.vocab_modes) >= 30522 and math.prod(layer.dim_modes) == 16
    table = layer.weight_dense()
    assert table.shape == (30522, 16)
    ids = torch.tensor([0, 1, 12345, 30520, 30521, 30521])
    torch.testing.assert_close(layer(ids), table[ids])
    torch.testing.assert_close(layer(ids), reference_embedding_table(layer)[ids])
    with pytest.raises(
        IndexError,
        match=r"token id 30522 is outside .*check the tokenizer's vocabulary size against num_embeddings=30522",
    ):
        layer(torch.tensor([30522]))  # exists in the padded table but not in the vocabulary


def test_paper_embedding_shapes():
    layer = TTEmbedding(30522, 768, 32, vocab_modes=[16, 20, 10, 10], dim_modes=[4, 4, 8, 6])
    assert layer.ranks == [1, 32, 32, 32, 1]
    assert [tuple(c.shape) for c in layer.cores] == [(1, 16, 4, 32), (32, 20, 4, 32), (32, 10, 8, 32), (32, 10, 6, 1)]
    assert layer.mode_sizes == [64, 80, 80, 60]


@pytest.mark.parametrize("bad", [[-1], [0, 12], [[3, 12, 1]]])
def test_out_of_range_ids(bad):
    layer = TTEmbedding(12, 6, 2, vocab_modes=[3, 4], dim_modes=[2, 3])
    with pytest.raises(
        IndexError,
        match=r"outside the vocabulary \[0, 12\); check the tokenizer's vocabulary size against num_embeddings",
    ):
        layer(torch.tensor(bad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_float_ids(dtype):
    layer = TTEmbedding(12, 6, 2, vocab_modes=[3, 4], dim_modes=[2, 3])
    with pytest.raises(TypeError, match=f"TTEmbedding expects integer token ids, got dtype {dtype}"):
        layer(torch.tensor([1, 2], dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
def test_integer_id_dtypes(dtype):
    layer = TTEmbedding(12, 6, 2, vocab_modes=[3, 4], dim_modes=[2, 3])
    ids = torch.tensor([[1, 11], [0, 5]], dtype=dtype)
    torch.testing.assert_close(layer(ids), layer.weight_dense()[ids.long()])


def test_empty_ids():
    layer = TTEmbedding(12, 6, 2, vocab_modes=[3, 4], dim_modes=[2, 3])
    assert layer(torch.empty(0, dtype=torch.long)).shape == (0, 6)
    assert layer(torch.empty(3, 0, dtype=torch.long)).shape == (3, 0, 6)


def test_to_tensorly():
    layer = make(12, 6, [3, 4], [2, 3], 3)
    ttm = layer.to_tensorly()
    assert isinstance(ttm, tl.tt_matrix.TTMatrix)
    with tl.backend_context("pytorch"):
        full = tl.tt_matrix_to_tensor(ttm)
    assert tuple(full.shape) == (3, 4, 2, 3)
    torch.testing.assert_close(layer.weight_dense(), full.reshape(12, 6))


def test_default_modes():
    layer = TTEmbedding(1000, 64, 8)
    assert len(layer.vocab_modes) == len(layer.dim_modes) == 3
    assert math.prod(layer.vocab_modes) >= 1000 and math.prod(layer.dim_modes) == 64
    # the dim modes set the number of cores when only they are given
    layer = TTEmbedding(1000, 64, 8, dim_modes=[8, 8])
    assert len(layer.vocab_modes) == 2 and math.prod(layer.vocab_modes) >= 1000


# --- init -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "V, D, rank, kw, seeds",
    [
        (1000, 64, 1, {}, 8),
        (1000, 64, 8, {}, 4),
        (30522, 16, 8, {}, 2),
        (512, 32, 4, {"vocab_modes": [8, 8, 8], "dim_modes": [4, 4, 2]}, 8),
        (256, 32, FULL_RANK, {"vocab_modes": [16, 16], "dim_modes": [4, 8]}, 4),
    ],
)
def test_init_std_is_one(V, D, rank, kw, seeds):
    acc = 0.0
    for seed in range(seeds):
        torch.manual_seed(seed)
        with torch.no_grad():
            acc += TTEmbedding(V, D, rank, **kw).weight_dense().double().pow(2).mean().item()
    measured = math.sqrt(acc / seeds)
    assert abs(measured - 1.0) < 0.2, measured


def test_init_std_explicit():
    acc = 0.0
    for seed in range(4):
        torch.manual_seed(seed)
        with torch.no_grad():
            acc += TTEmbedding(1000, 64, 8, init_std=0.02).weight_dense().double().pow(2).mean().item()
    assert abs(math.sqrt(acc / 4) / 0.02 - 1) < 0.2


# --- from_embedding -------------------------------------------------------------------------------------------
def test_from_embedding_full_rank_is_exact():
    emb = nn.Embedding(12, 6, padding_idx=2).double()
    layer, error = TTEmbedding.from_embedding(emb, FULL_RANK, vocab_modes=[3, 4], dim_modes=[2, 3])
    assert error < 1e-10
    assert layer.padding_idx == 2
    ids = torch.tensor([[0, 2, 11], [5, 5, 7]])
    torch.testing.assert_close(layer(ids), emb(ids))


def test_from_embedding_low_rank_error():
    emb = nn.Embedding(24, 8).double()
    layer, error = TTEmbedding.from_embedding(emb, 1, vocab_modes=[2, 3, 2, 2], dim_modes=[2, 2, 1, 2])
    assert layer.ranks == [1, 1, 1, 1, 1]
    assert 0.0 < error <= 1.0
    assert abs((layer.weight_dense() - emb.weight).norm().item() / emb.weight.norm().item() - error) < 1e-9


# --- errors ---------------------------------------------------------------------------------------------------
def test_rank_zero():
    with pytest.raises(ValueError, match="rank must be >= 1"):
        TTEmbedding(12, 6, 0, vocab_modes=[3, 4], dim_modes=[2, 3])


def test_explicit_rank_above_bound():
    # core sizes 6 and 6: the only bond allows at most 6
    with pytest.raises(
        ValueError, match=r"allow at most 6 there .*lower it or pass a single int rank to clamp automatically"
    ):
        TTEmbedding(12, 6, [7], vocab_modes=[3, 4], dim_modes=[2, 3])


def test_wrong_rank_list_length():
    with pytest.raises(ValueError, match=r"expected 1 internal ranks .*; pass a single int to use one rank everywhere"):
        TTEmbedding(12, 6, [2, 2], vocab_modes=[3, 4], dim_modes=[2, 3])


def test_modes_count_mismatch():
    with pytest.raises(ValueError, match=r"must have the same number of modes \(one TT-matrix core per pair\)"):
        TTEmbedding(12, 6, 2, vocab_modes=[3, 4], dim_modes=[6])


def test_vocab_modes_too_small():
    with pytest.raises(
        ValueError, match=r"vocab_modes: .*pass modes whose product is 13 \(e.g. \[13, 1\]\) or leave them as None"
    ):
        TTEmbedding(13, 6, 2, vocab_modes=[3, 4], dim_modes=[2, 3])


def test_dim_modes_must_be_exact():
    with pytest.raises(
        ValueError,
        match=r"dim_modes: .*must equal 5; pass modes whose product is 5 \(e.g. \[5, 1\]\) or leave them as None",
    ):
        TTEmbedding(12, 5, 2, vocab_modes=[3, 4], dim_modes=[2, 3])


@pytest.mark.parametrize("padding_idx", [12, -13])
def test_padding_idx_out_of_range(padding_idx):
    with pytest.raises(ValueError, match=rf"padding_idx must be within \[-12, 12\), got {padding_idx}"):
        TTEmbedding(12, 6, 2, vocab_modes=[3, 4], dim_modes=[2, 3], padding_idx=padding_idx)


@pytest.mark.parametrize("threshold", [-1e-3, 1.0])
def test_threshold_outside_unit_interval(threshold):
    with pytest.raises(ValueError, match=rf"rank_threshold must be in \[0, 1\) \(gates start at 1\), got {threshold}"):
        TTEmbedding(12, 6, 2, rank_threshold=threshold)


@pytest.mark.parametrize("V, D", [(0, 6), (12, 0)])
def test_non_positive_sizes(V, D):
    with pytest.raises(ValueError, match=f"num_embeddings and embedding_dim must be >= 1, got {V}, {D}"):
        TTEmbedding(V, D, 2)


@pytest.mark.parametrize("kind", ["embedding", "linear"])
def test_core_gradients_arrive_in_the_cores_layout(kind):
    # DDP copies a gradient laid out otherwise into its bucket at every step; the einsum of the half-merge
    # lookup and the sweep plans used to leave odd strides, on size-1 rank dimensions too
    from comera_lightning.nn import TTLinear

    torch.manual_seed(0)
    if kind == "embedding":
        layer = TTEmbedding(1000, 64, rank=4)
        out = layer(torch.randint(0, 1000, (3, 7)))
    else:
        layer = TTLinear(64, 48, rank=4)
        layer.set_contraction_plan("sweep")
        out = layer(torch.randn(5, 64))
    (out * torch.randn_like(out)).sum().backward()
    assert [core.grad.stride() for core in layer.cores] == [core.stride() for core in layer.cores]


# --- edge sizes, devices, dtypes, parameterization -----------------------------------------------------------------
@pytest.mark.parametrize("V, D", [(1, 4), (6, 1), (1, 1)])
def test_single_row_or_column_tables_build(V, D):
    layer = make(V, D, None, None, 2)
    ids = torch.tensor([0, V - 1, 0])
    assert layer.weight_dense().shape == (V, D)
    torch.testing.assert_close(layer(ids), reference_embedding_table(layer)[ids], rtol=1e-12, atol=1e-12)


def test_most_negative_padding_idx_is_the_first_row():
    layer = make(12, 6, [3, 4], [2, 3], 3, padding_idx=-12)
    assert layer.padding_idx == 0
    out = layer(torch.tensor([0, 5, 0]))
    assert torch.all(out[[0, 2]] == 0) and torch.all(layer.weight_dense()[0] == 0)
    torch.testing.assert_close(out[1], reference_embedding_table(layer)[5], rtol=1e-12, atol=1e-12)


def test_vocab_modes_set_the_number_of_dim_modes():
    # 1000 rows would get 3 modes by default; explicit vocab modes make it 2 cores, and the dim modes follow
    layer = TTEmbedding(1000, 64, 4, vocab_modes=[10, 100])
    assert layer.vocab_modes == [10, 100] and len(layer.dim_modes) == 2 and math.prod(layer.dim_modes) == 64


@pytest.mark.parametrize("parameterization", ["standard", "mup"])
def test_dtype_and_device_reach_every_tensor(parameterization):
    layer = TTEmbedding(12, 6, 2, vocab_modes=[3, 4], dim_modes=[2, 3], dtype=F64, parameterization=parameterization)
    assert {c.dtype for c in layer.cores} == {F64}
    meta = TTEmbedding(
        12, 6, 2, vocab_modes=[3, 4], dim_modes=[2, 3], device="meta", dtype=F64, parameterization=parameterization
    )
    assert {t.device.type for t in [*meta.parameters(), *meta.buffers()]} == {"meta"}
    assert {c.dtype for c in meta.cores} == {F64}


def test_mup_core_stds_and_rates_follow_the_fan_ins():
    # TT-matrix cores read only their incoming rank: fan-ins 1 and 256, so stds 1 and 1/16 and rates 1 and 128/256
    mup = TTEmbedding(256, 256, 256, vocab_modes=[16, 16], dim_modes=[16, 16], parameterization="mup")
    assert mup.ranks == [1, 256, 1]
    assert mup.lr_scales == [1.0, 0.5]
    stds = [c.std().item() for c in mup.cores]
    assert abs(stds[0] - 1.0) < 0.05 and abs(stds[1] - 1 / 16) < 0.005, stds
    standard = TTEmbedding(256, 256, 256, vocab_modes=[16, 16], dim_modes=[16, 16])
    assert standard.lr_scales == [1.0, 1.0]
    for layer in (mup, standard):  # entries of variance 1 either way, as nn.Embedding's
        with torch.no_grad():
            assert abs(layer.weight_dense().std().item() - 1.0) < 0.1


# --- lookups: the reported id, deduplication, the inference cache ---------------------------------------------------
@pytest.mark.parametrize("bad, reported", [([-3, 5], -3), ([2, 15], 15), ([0, 12], 12), ([12, 0], 12)])
def test_out_of_range_error_names_the_offending_id(bad, reported):
    layer = TTEmbedding(12, 6, 2, vocab_modes=[3, 4], dim_modes=[2, 3])
    with pytest.raises(IndexError, match=rf"^token id {reported} is outside the vocabulary \[0, 12\); check the"):
        layer(torch.tensor(bad))


@pytest.mark.parametrize("cached", [False, True], ids=["training", "inference_cache"])
def test_deduplicate_computes_each_distinct_id_once(cached):
    # two cores: the halves are the cores themselves, so the only products are the per-id ones
    def flops(layer, ids):
        with torch.no_grad() if cached else contextlib.nullcontext(), FlopCounterMode(display=False) as counter:
            out = layer(ids)
        return counter.get_total_flops(), out

    repeated, single = torch.full((50,), 7), torch.tensor([7])
    for deduplicate in (False, True):
        layer = make(64, 16, [8, 8], [4, 4], 4, deduplicate=deduplicate).train(not cached)
        one, _ = flops(layer, single)
        many, out = flops(layer, repeated)
        assert one > 0 and many == (one if deduplicate else 50 * one), (deduplicate, one, many)
        torch.testing.assert_close(out, reference_embedding_table(layer)[repeated], rtol=1e-12, atol=1e-12)


def test_one_core_table_is_served_from_the_cache_and_owns_its_memory():
    # one core: the merged half would be a view of the parameter, whose storage a sharded wrapper may free
    layer = make(7, 3, [7], [3], 2).eval()
    ids = torch.tensor([0, 3, 6, 3])
    expected = reference_embedding_table(layer)[ids].detach()
    with torch.no_grad(), reusing_inference_factors(layer):
        torch.testing.assert_close(layer(ids), expected, rtol=1e-12, atol=1e-12)
        # as when FSDP frees an unsharded parameter after its forward and the allocator hands the memory out again
        layer.cores[0].data.fill_(float("nan"))
        torch.testing.assert_close(layer(ids), expected, rtol=1e-12, atol=1e-12)


def test_cache_follows_autocast():
    # four cores: each half is a merge, which runs under the caller's autocast; the cache keys on it
    layer = TTEmbedding(24, 8, 3, vocab_modes=[2, 3, 2, 2], dim_modes=[2, 2, 1, 2]).eval()
    reference = copy.deepcopy(layer)
    reference.inference_cache = False
    ids = torch.tensor([0, 5, 23, 7])
    with torch.no_grad():
        for autocast in (True, False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                expected, out = reference(ids), layer(ids)
            assert out.dtype == expected.dtype == (torch.bfloat16 if autocast else torch.float32)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_weight_dense_with_padding_on_the_layers_device():
    # a layer built on the meta device (deferred initialisation) gives its table there, padding row included
    layer = TTEmbedding(12, 6, 2, vocab_modes=[3, 4], dim_modes=[2, 3], padding_idx=1, device="meta")
    table = layer.weight_dense()
    assert table.shape == (12, 6) and table.device.type == "meta"
