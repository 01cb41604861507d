"""The inference cache of TT layers: in eval mode without autograd a layer reuses its merged, gated factors.

Float64 throughout. The cached output equals the uncached one and the dense reference (tensorly); after every
kind of weight change the next eval forward reflects the new weights (each test checks the output moved, so a
stale cache fails it); autograd-enabled and training forwards neither use nor fill the cache; the cache stays
out of state_dict, deepcopy, pickling and torch.compile graphs.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
import torch._dynamo as dynamo
from helpers.nn_reference import F64, FULL_RANK, randomize_gates_, reference_embedding_table, reference_linear_weight
from torch import nn

from comera_lightning.nn import TTEmbedding, TTLinear, reusing_inference_factors
from comera_lightning.nn import base as base_module
from comera_lightning.nn.base import TTLayer

LINEARS = {
    "padded": lambda: TTLinear(37, 20, rank=3, in_modes=[5, 8], out_modes=[3, 7]),
    "three_in_cores": lambda: TTLinear(24, 30, rank=4, in_modes=[2, 3, 4], out_modes=[5, 6]),
    "low_rank": lambda: TTLinear(24, 30, rank=5, in_modes=[24], out_modes=[30], bias=False),
    "dense_weight": lambda: TTLinear(6, 4, rank=FULL_RANK, in_modes=[2, 3], out_modes=[2, 2]),  # M N <= r (M + N)
}


def _prepared(layer: TTLayer) -> TTLayer:
    """Float64 (beyond float32's digits), gates away from 1, one dead slice where a bond allows it, a nonzero
    bias: every part shows in the output."""
    layer = randomize_gates_(layer).to(F64)
    bond = next((k for k, r in enumerate(layer.ranks[1:-1]) if r > 1), None)
    if bond is not None:
        layer.remove_slices_(bond, [0])
    with torch.no_grad():
        for core in layer.cores:  # float64 digits, so a float32 round trip changes them
            core.mul_(1 + 1e-3 * torch.randn_like(core))
        if getattr(layer, "bias", None) is not None:
            layer.bias.normal_()
    return layer


def _linear(name: str = "padded") -> TTLinear:
    return _prepared(LINEARS[name]())


def _embedding(**kwargs) -> TTEmbedding:
    return _prepared(TTEmbedding(100, 12, rank=4, **{"padding_idx": 0, "deduplicate": True, **kwargs}))


def _input(layer: TTLayer, rows: int = 3) -> torch.Tensor:
    if isinstance(layer, TTLinear):
        return torch.randn(2, rows, layer.in_features, dtype=F64)
    return torch.tensor([[3, 0, 99][:rows] + [7] * max(0, rows - 3), [3, 7, 3][:rows] + [1] * max(0, rows - 3)])


def _reference(layer: TTLayer, x: torch.Tensor) -> torch.Tensor:
    """The layer's function from its current weights, rebuilt with tensorly (no layer code)."""
    with torch.no_grad():
        if isinstance(layer, TTLinear):
            y = x.to(F64) @ reference_linear_weight(layer).to(F64).transpose(0, 1)
            return y if layer.bias is None else y + layer.bias.to(F64)
        rows = reference_embedding_table(layer).to(F64)[x]
        return rows * (x != layer.padding_idx).unsqueeze(-1).to(F64) if layer.padding_idx is not None else rows


def _eval_forward(layer: TTLayer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer(x)


def _count_merges(monkeypatch, layer: TTLayer) -> list[int]:
    calls: list[int] = []
    gated_cores = layer.gated_cores

    def counting():
        calls.append(1)
        return gated_cores()

    monkeypatch.setattr(layer, "gated_cores", counting)
    return calls


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)


def _layer(kind: str) -> TTLayer:
    return _linear() if kind == "linear" else _embedding()


# --- values --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("name", list(LINEARS))
def test_cached_linear_equals_uncached_and_dense_reference(monkeypatch, name, rows):
    layer = _linear(name).eval()
    x = _input(layer, rows)
    merges = _count_merges(monkeypatch, layer)
    first, second = _eval_forward(layer, x), _eval_forward(layer, x[:, :1])
    assert len(merges) == 1 and layer._inference_entry is not None  # merged once, then served
    layer.inference_cache = False
    uncached = _eval_forward(layer, x)
    _close(first, uncached)
    _close(first, _reference(layer, x))
    _close(second, first[:, :1])
    assert first.dtype == F64 and first.shape == (2, rows, layer.out_features)
    assert _eval_forward(layer, x[0, 0]).shape == (layer.out_features,)  # 1-d input


@pytest.mark.parametrize("deduplicate", [False, True])
def test_cached_embedding_equals_uncached_and_dense_reference(monkeypatch, deduplicate):
    layer = _embedding(deduplicate=deduplicate).eval()
    ids = _input(layer)
    merges = _count_merges(monkeypatch, layer)
    first, single = _eval_forward(layer, ids), _eval_forward(layer, ids[:1, -1:])
    assert len(merges) == 1 and layer._inference_entry is not None
    layer.inference_cache = False
    _close(first, _eval_forward(layer, ids))
    _close(first, _reference(layer, ids))
    _close(single, first[:1, -1:])
    assert torch.all(first[ids == 0] == 0)  # padding row


def test_inference_mode_is_served_like_no_grad(monkeypatch):
    layer = _linear().eval()
    x = _input(layer)
    merges = _count_merges(monkeypatch, layer)
    with torch.inference_mode():
        first = layer(x)
    with torch.no_grad():  # the factors kept under inference_mode also serve plain no_grad calls
        second = layer(x)
    assert len(merges) == 1
    _close(first, second)


@pytest.mark.parametrize("kind", ["linear", "embedding", "low_rank", "one_core_right_half"])
def test_kept_factors_own_their_memory(kind):
    # a kept view of a core would read freed memory once a sharded wrapper (FSDP) releases the parameter
    layer = {
        "linear": _linear,
        "embedding": _embedding,
        "low_rank": lambda: _linear("low_rank"),
        "one_core_right_half": lambda: _prepared(TTEmbedding(100, 12, rank=4, vocab_modes=[10, 10], dim_modes=[3, 4])),
    }[kind]().eval()
    _eval_forward(layer, _input(layer))
    kept = [t for t in layer._inference_entry.value if isinstance(t, torch.Tensor)]
    core_storages = {c.untyped_storage().data_ptr() for c in layer.cores}
    assert kept and not any(t.untyped_storage().data_ptr() in core_storages for t in kept)


# --- invalidation: every weight change shows in the next eval forward ------------------------------------------
def _other(layer: TTLayer) -> TTLayer:
    torch.manual_seed(99)
    return _linear() if isinstance(layer, TTLinear) else _embedding()


def _optimizer_step(optimizer: Callable) -> Callable[[TTLayer], None]:
    """A step on given gradients: no forward with autograd in between (that alone would drop the cache), as when
    a training loop evaluates something without grad between its backward and its step."""

    def step(layer: TTLayer) -> None:
        opt = optimizer(layer.parameters())
        for param in layer.parameters():
            param.grad = torch.randn_like(param)
        opt.step()

    return step


def _set_mask(layer: TTLayer) -> None:
    mask = layer.rank_mask_0.clone()
    mask[int(mask.nonzero()[0])] = False
    layer.rank_mask_0 = mask  # a new buffer object


def _core_replaced_by_alias(layer: TTLayer) -> None:
    # a new Parameter over the old one's storage, transposed: same address, shape and version counter, new values
    k, i, j = next(
        (k, i, j)
        for k, c in enumerate(layer.cores)
        for i in range(c.dim())
        for j in range(i + 1, c.dim())
        if c.shape[i] == c.shape[j] > 1
    )
    layer.cores[k] = nn.Parameter(layer.cores[k].detach().transpose(i, j))


MUTATIONS: dict[str, Callable[[TTLayer], None]] = {
    "core_inplace": lambda layer: layer.cores[0].mul_(1.5),
    "last_core_inplace": lambda layer: layer.cores[-1].add_(0.1),
    "gate_inplace": lambda layer: layer.gates[0].mul_(0.5),
    "mask_inplace": lambda layer: layer.rank_mask_0.copy_(
        torch.arange(layer.rank_mask_0.numel()) % 2 == 1 if layer.rank_mask_0.numel() > 1 else layer.rank_mask_0
    ),
    "mask_replaced": _set_mask,
    "remove_slices": lambda layer: layer.remove_slices_(0, [int(layer.rank_mask_0.nonzero()[-1])]),
    "refresh_masks": lambda layer: (
        layer.gates[0].copy_(torch.linspace(0.0, 1.0, layer.gates[0].numel())),
        layer.refresh_masks_(),
    ),
    "sgd_step": _optimizer_step(lambda p: torch.optim.SGD(p, lr=0.05)),
    "adam_foreach_step": _optimizer_step(lambda p: torch.optim.Adam(p, lr=0.05, foreach=True)),
    "adamw_fused_step": _optimizer_step(lambda p: torch.optim.AdamW(p, lr=0.05, fused=True)),
    "load_state_dict": lambda layer: layer.load_state_dict(_other(layer).state_dict()),
    "load_truncated_state_dict": lambda layer: layer.load_state_dict(
        (lambda o: (o.truncate_to_share_(0.5), o.state_dict())[1])(_other(layer))
    ),
    "load_state_dict_assign": lambda layer: layer.load_state_dict(_other(layer).state_dict(), assign=True),
    "truncate_to_share": lambda layer: layer.truncate_to_share_(0.5),
    "data_swapped": lambda layer: setattr(layer.cores[0], "data", layer.cores[0].data * 2),
    "core_replaced_by_alias": _core_replaced_by_alias,
    "dtype_round_trip": lambda layer: layer.float().double(),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_every_weight_change_shows_in_the_next_eval_forward(kind, mutation):
    layer = _layer(kind).eval()
    if mutation in ("mask_inplace", "refresh_masks", "remove_slices") and layer.rank_mask_0.numel() < 3:
        pytest.skip("needs a bond with several slices")
    x = _input(layer)
    before = _eval_forward(layer, x)
    assert layer._inference_entry is not None
    with torch.no_grad():
        MUTATIONS[mutation](layer)
    assert not layer.training
    after = _eval_forward(layer, x)
    _close(after, _reference(layer, x))
    assert (after - before).abs().max() > 1e-9, "the mutation did not change the function: the test proves nothing"


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_storage_swapped_away_and_back_is_not_taken_for_the_stamped_one(kind):
    # ``param.data = ...`` keeps the version counter: were the stamped storage freed, the second swap could land on
    # its address, and the stamp (same tensor, version, address, shape) would serve the factors of the old values
    layer = _layer(kind).eval()
    x = _input(layer)
    core = layer.cores[0]
    for _ in range(8):
        before = _eval_forward(layer, x)
        core.data = core.data * 2.0
        core.data = core.data * 0.75
        after = _eval_forward(layer, x)
        _close(after, _reference(layer, x))
        assert (after - before).abs().max() > 1e-9


def test_a_failed_merge_leaves_no_entry_behind_and_the_next_call_merges(monkeypatch):
    layer = _linear().eval()
    x = _input(layer)
    with monkeypatch.context() as patch:
        patch.setattr(layer, "gated_cores", lambda: (_ for _ in ()).throw(RuntimeError("out of memory")))
        with pytest.raises(RuntimeError, match="out of memory"):
            _eval_forward(layer, x)
    assert layer._inference_entry is None
    _close(_eval_forward(layer, x), _reference(layer, x))
    assert layer._inference_entry is not None


def test_train_switch_drops_the_cache_even_for_untracked_changes():
    layer = _linear().eval()
    x = _input(layer)
    before = _eval_forward(layer, x)
    layer.train()
    assert layer._inference_entry is None
    layer.cores[0].data.mul_(2.0)  # through .data: the version counter does not see it
    after = _eval_forward(layer.eval(), x)
    _close(after, _reference(layer, x))
    assert (after - before).abs().max() > 1e-9


def test_untracked_data_changes_need_clear_inference_cache():
    # the one documented blind spot: ``param.data.<op>_()`` bypasses the version counter
    layer = _linear().eval()
    x = _input(layer)
    before = _eval_forward(layer, x)
    layer.cores[0].data.mul_(2.0)
    _close(_eval_forward(layer, x), before)
    layer.clear_inference_cache()
    _close(_eval_forward(layer, x), _reference(layer, x))


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_to_dtype_clears_and_serves_the_new_dtype(kind):
    layer = _layer(kind).eval()
    x = _input(layer)
    _eval_forward(layer, x)
    layer.float()
    assert layer._inference_entry is None
    got = _eval_forward(layer, x.float() if kind == "linear" else x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_autocast_state_is_part_of_the_key(kind):
    layer = _layer(kind).float().eval()
    x = _input(layer).float() if kind == "linear" else _input(layer)
    plain = _eval_forward(layer, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cached = _eval_forward(layer, x)
        layer.inference_cache = False
        uncached = _eval_forward(layer, x)
        layer.inference_cache = True
    assert cached.dtype == uncached.dtype and (kind == "embedding" or cached.dtype == torch.bfloat16)
    torch.testing.assert_close(cached.float(), uncached.float(), rtol=2e-2, atol=2e-2)
    if kind == "embedding":  # the same ops as the uncached lookup: the same bits
        assert torch.equal(cached, uncached)
    again = _eval_forward(layer, x)  # autocast off again: float32 factors, not the bf16 ones
    assert again.dtype == torch.float32 and torch.equal(again, plain)


# --- autograd and training are untouched ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_grad_enabled_forward_neither_uses_nor_fills_the_cache(monkeypatch, kind):
    layer = _layer(kind).eval()
    x = _input(layer)
    merges = _count_merges(monkeypatch, layer)
    y = layer(x)  # eval mode, grad enabled
    assert y.requires_grad and layer._inference_entry is None and len(merges) == 1
    cached = _eval_forward(layer, x)
    assert layer._inference_entry is not None and len(merges) == 2
    y = layer(x)  # a full cache does not serve autograd either, and is dropped: weights are being trained
    assert y.requires_grad and len(merges) == 3 and layer._inference_entry is None
    y.sum().backward()
    assert all(c.grad is not None for c in layer.cores)
    _close(y.detach(), cached)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_a_recorded_forward_with_autograd_leaves_the_cache_alone(monkeypatch, kind):
    # a graph being compiled or captured writes no layer state: the eager forwards around it manage the cache
    layer = _layer(kind).eval()
    x = _input(layer)
    cached = _eval_forward(layer, x)
    entry = layer._inference_entry
    with monkeypatch.context() as patch:
        patch.setattr(base_module, "capturing_graph", lambda: True)
        y = layer(x)
    assert y.requires_grad and layer._inference_entry is entry
    _close(y.detach(), cached)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_training_mode_without_grad_does_not_fill_the_cache(kind):
    layer = _layer(kind).train()
    _eval_forward(layer, _input(layer))
    assert layer._inference_entry is None


def test_switched_off_never_fills(monkeypatch):
    layer = _linear().eval()
    layer.inference_cache = False
    merges = _count_merges(monkeypatch, layer)
    x = _input(layer)
    _eval_forward(layer, x)
    _eval_forward(layer, x)
    assert layer._inference_entry is None and len(merges) == 2


def test_gradcheck_in_eval_mode_after_the_cache_was_filled():
    layer = TTLinear(6, 4, rank=2, in_modes=[2, 3], out_modes=[2, 2]).to(F64).eval()
    x = torch.randn(2, 6, dtype=F64, requires_grad=True)
    _eval_forward(layer, x)
    assert torch.autograd.gradcheck(lambda x, *p: layer(x), (x, *layer.parameters()))


def test_layer_built_under_inference_mode_runs_uncached():
    # inference tensors have no version counter, so nothing can tell whether they changed: no cache
    with torch.inference_mode():
        layer = _linear().eval()
        x = _input(layer)
        y = layer(x)
    assert layer._inference_entry is None
    _close(y, _reference(layer, x))


# --- state_dict, copies, pickling, torch.compile ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_cache_is_not_in_the_state_dict(kind):
    layer = _layer(kind).eval()
    keys = set(layer.state_dict())
    _eval_forward(layer, _input(layer))
    assert set(layer.state_dict()) == keys and not any("inference" in k for k in keys)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_deepcopy_merges_afresh_and_copies_stay_independent(kind):
    layer = _layer(kind).eval()
    x = _input(layer)
    original = _eval_forward(layer, x)
    twin = copy.deepcopy(layer)
    assert twin._inference_entry is None and layer._inference_entry is not None
    _close(_eval_forward(twin, x), original)
    with torch.no_grad():
        twin.cores[0].mul_(3.0)
    _close(_eval_forward(twin, x), _reference(twin, x))
    _close(_eval_forward(layer, x), original)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_pickling_drops_the_cache(kind):
    layer = _layer(kind).eval()
    x = _input(layer)
    original = _eval_forward(layer, x)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._inference_entry is None and not loaded.training
    _close(_eval_forward(loaded, x), original)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_torch_compile_in_eval_without_grad_traces_the_uncached_path(kind):
    layer = _layer(kind).eval()
    x = _input(layer)
    dynamo.reset()
    with torch.no_grad():
        assert dynamo.explain(layer)(x).graph_break_count == 0
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        got = compiled(x)
    assert layer._inference_entry is None  # the graph neither reads nor fills the cache
    eager = _eval_forward(layer, x)
    _close(got, eager)
    with torch.no_grad():
        layer.cores[0].mul_(2.0)
        _close(compiled(x), _reference(layer, x))


# --- reusing_inference_factors: one check per layer per loop ------------------------------------------------
@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_reusing_factors_checks_once_per_block_and_checks_again_after_it(monkeypatch, kind):
    layer = _layer(kind).eval()
    x = _input(layer)
    stamps: list[int] = []
    original = layer._inference_cached

    def stamped(key, build):
        if layer._trusted_entry is None or layer._trusted_entry[0] != key:
            stamps.append(1)  # the stamped path: the trusted value is only served when it exists for this key
        return original(key, build)

    monkeypatch.setattr(layer, "_inference_cached", stamped)
    before = _eval_forward(layer, x)
    with reusing_inference_factors(layer):
        outputs = [_eval_forward(layer, x) for _ in range(4)]
        assert len(stamps) == 2  # one before the block, one on the block's first call
        with torch.no_grad():  # inside the block a weight change goes unseen: the documented contract
            layer.cores[0].mul_(2.0)
        _close(_eval_forward(layer, x), before)
    for out in outputs:
        _close(out, before)
    after = _eval_forward(layer, x)  # outside, the stamp sees the change again
    _close(after, _reference(layer, x))
    assert not torch.allclose(after, before)
    assert layer._trusted_entry is None and not layer._reusing_factors


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_a_copy_made_inside_reusing_factors_merges_its_own_weights(kind):
    layer = _layer(kind).eval()
    x = _input(layer)
    with reusing_inference_factors(layer):
        original = _eval_forward(layer, x)  # the layer now serves these factors unchecked
        twin = copy.deepcopy(layer)
        with torch.no_grad():
            twin.cores[0].mul_(3.0)
        changed = _eval_forward(twin, x)
        _close(changed, _reference(twin, x))
        _close(_eval_forward(layer, x), original)
    assert (changed - original).abs().max() > 1e-9


def test_reusing_factors_keys_on_the_compute_dtype():
    layer = _linear().eval()
    x = _input(layer)
    with reusing_inference_factors(layer):
        wide = _eval_forward(layer, x)
        narrow = _eval_forward(layer.float(), x.float())  # .float() clears; a float32 call is served float32
    assert wide.dtype == F64 and narrow.dtype == torch.float32
    torch.testing.assert_close(narrow, wide.float(), rtol=1e-5, atol=1e-5)
