"""tensorize() on small models and size_report() against hand counts."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.nn_reference import FULL_RANK
from torch import nn

from comera_lightning.nn import (
    TTEmbedding,
    TTLinear,
    size_report,
    tensorize,
    tt_layers,
)


class Block(nn.Module):
    """A transformer-ish block: attention (whose out_proj is read as a raw weight) plus a feed-forward."""

    def __init__(self, d=32, hidden=64):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        a, _ = self.attn(x, x, x, need_weights=False)
        return self.fc2(torch.relu(self.fc1(x + a)))


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32, padding_idx=0)
        self.encoder = nn.ModuleDict({"fc1": nn.Linear(32, 48), "fc2": nn.Linear(48, 32)})
        self.decoder = nn.ModuleDict({"fc1": nn.Linear(32, 48), "fc2": nn.Linear(48, 32)})
        self.head = nn.Linear(32, 5)


def _replaced(model):
    return sorted(name for name, _ in tt_layers(model))


# --- tensorize --------------------------------------------------------------------------------------------------
def test_tensorize_small_sequential():
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    records = tensorize(model, rank=3, min_features=16)
    assert isinstance(model[0], TTEmbedding) and isinstance(model[1], TTLinear)
    assert type(model[3]) is nn.Linear  # 4 < min_features
    assert [r.name for r in records] == ["0", "1"]
    emb, lin = records
    assert emb.kind == "embedding" and emb.shape == (64, 16)
    assert lin.kind == "linear" and lin.shape == (16, 32)
    assert emb.ranks == model[0].ranks and lin.ranks == model[1].ranks
    assert emb.dense_parameters == 64 * 16 and lin.dense_parameters == 16 * 32
    assert lin.tt_parameters == model[1].allocated_parameters()
    assert emb.relative_error is None and lin.relative_error is None
    assert lin.compression == pytest.approx(512 / lin.tt_parameters)
    assert model[1].bias is not None
    out = model(torch.randint(0, 64, (2, 7)))
    assert out.shape == (2, 7, 4)
    out.sum().backward()
    assert all(p.grad is not None for p in model[1].cores)


def test_tensorize_keeps_multihead_attention_out_proj():
    block = Block()
    x = torch.randn(2, 5, 32)
    records = tensorize(block, rank=4, min_features=16)
    assert [r.name for r in records] == ["fc1", "fc2"]
    assert isinstance(block.fc1, TTLinear) and isinstance(block.fc2, TTLinear)
    out_proj = block.attn.out_proj
    assert not isinstance(out_proj, TTLinear) and isinstance(out_proj, nn.Linear)
    assert isinstance(out_proj.weight, nn.Parameter)
    assert block(x).shape == (2, 5, 32)  # MultiheadAttention still reads out_proj.weight


def test_tensorize_nested_names_and_min_features():
    model = EncoderDecoder()
    records = tensorize(model, rank=2, min_features=32)
    assert [r.name for r in records] == ["embed", "encoder.fc1", "encoder.fc2", "decoder.fc1", "decoder.fc2"]
    assert type(model.head) is nn.Linear
    assert model.embed.padding_idx == 0


@pytest.mark.parametrize(
    "include, exclude, expected",
    [
        (r"^encoder\.", None, ["encoder.fc1", "encoder.fc2"]),
        (None, r"fc2$", ["decoder.fc1", "embed", "encoder.fc1", "head"]),
        (r"coder", r"^decoder\.fc1$", ["decoder.fc2", "encoder.fc1", "encoder.fc2"]),
        (r"nothing-matches", None, []),
    ],
)
def test_tensorize_include_exclude(include, exclude, expected):
    model = EncoderDecoder()
    records = tensorize(model, rank=2, min_features=4, include=include, exclude=exclude)
    assert sorted(r.name for r in records) == expected
    assert _replaced(model) == expected
    assert type(model.head) is nn.Linear or "head" in expected


def test_tensorize_linears_or_embeddings_only_and_embedding_rank():
    model = EncoderDecoder()
    tensorize(model, rank=2, min_features=4, linears=False, embedding_rank=5)
    assert _replaced(model) == ["embed"]
    assert max(model.embed.ranks) == 5
    model = EncoderDecoder()
    tensorize(model, rank=2, min_features=4, embeddings=False)
    assert "embed" not in _replaced(model) and "head" in _replaced(model)


def test_tensorize_forwards_layer_kwargs_and_dtype():
    model = nn.Sequential(nn.Linear(16, 32), nn.Embedding(20, 16)).double()
    tensorize(model, rank=2, min_features=16, rank_threshold=0.05)
    assert [m.rank_threshold for m in model] == [0.05, 0.05]
    assert all(c.dtype == torch.float64 for m in model for c in m.cores)


def test_tensorize_shared_module_stays_shared():
    """A module used at two places (ALBERT-style sharing) must be replaced by one shared TT layer."""
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    tensorize(model, rank=2, min_features=16)
    assert isinstance(model[0], TTLinear)
    assert model[2] is model[0]


def test_tensorize_root_module_is_not_silently_mangled():
    """The root module cannot be swapped in place: either refuse (ValueError) or leave it untouched."""
    model = nn.Linear(32, 32)
    try:
        records = tensorize(model, rank=2, min_features=16)
    except ValueError:
        return
    assert records == []
    assert list(model.named_children()) == []
    assert set(model.state_dict()) == {"weight", "bias"}


def test_tensorize_min_features_must_be_positive():
    with pytest.raises(ValueError, match="min_features must be >= 1, got 0"):
        tensorize(nn.Linear(4, 4), min_features=0)


def test_tensorize_decompose_full_rank_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(36, 16), nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 16)).double()
    ids = torch.randint(0, 36, (3, 4))
    expected = model(ids)
    records = tensorize(model, rank=FULL_RANK, min_features=16, decompose=True)
    assert [r.kind for r in records] == ["embedding", "linear", "linear"]
    for record in records:
        assert record.relative_error is not None and 0.0 <= record.relative_error < 1e-10
        assert record.tt_parameters == dict(tt_layers(model))[record.name].allocated_parameters()
    torch.testing.assert_close(model(ids), expected, rtol=1e-9, atol=1e-9)


def test_tensorize_decompose_low_rank_reports_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    dense_weight = model[0].weight.detach().clone()
    (record,) = tensorize(model, rank=2, min_features=16, decompose=True)
    assert 0.0 < record.relative_error < 1.0
    measured = (model[0].weight_dense() - dense_weight).norm() / dense_weight.norm()
    assert record.relative_error == pytest.approx(measured.item(), rel=1e-4)


# --- size accounting by hand --------------------------------------------------------------------------------
def test_size_report_hand_count_small_linear():
    layer = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5])
    # cores (1,4,3), (3,3,3), (3,2,3), (3,5,1): 12 + 27 + 18 + 15 = 72
    assert [tuple(c.shape) for c in layer.cores] == [(1, 4, 3), (3, 3, 3), (3, 2, 3), (3, 5, 1)]
    assert layer.active_parameters() == 72 == layer.allocated_parameters()
    assert layer.dense_parameters == 120
    model = nn.Sequential(layer, nn.Linear(10, 2))
    report = size_report(model)
    # other = TT bias 10 + head 10*2 + 2 = 32 (gates and masks are bookkeeping, not counted)
    assert report.other_parameters == 32
    assert report.active_parameters == 104
    assert report.allocated_parameters == 104
    assert report.dense_equivalent_parameters == 152
    assert report.compression_ratio == pytest.approx(152 / 104)
    assert [(layer.name, layer.active_parameters, layer.dense_parameters) for layer in report.layers] == [
        ("0", 72, 120)
    ]

    # one slice of bond 2 dies: active ranks [1,3,2,3,1] -> 12 + 18 + 12 + 15 = 57
    with torch.no_grad():
        layer.gates[1][0] = 0.0
    layer.refresh_masks_()
    report = size_report(model)
    assert report.layers[0].active_ranks == [1, 3, 2, 3, 1]
    assert report.active_parameters == 57 + 32
    assert report.allocated_parameters == 72 + 32
    assert report.compression_ratio == pytest.approx(152 / 89)
    layer.truncate_()
    assert size_report(model).allocated_parameters == 89 == size_report(model).active_parameters


def test_size_report_hand_count_small_embedding():
    layer = TTEmbedding(24, 8, 4, vocab_modes=[2, 3, 4], dim_modes=[2, 2, 2])
    # cores (1,2,2,4), (4,3,2,4), (4,4,2,1): 16 + 96 + 32 = 144; dense 24 * 8 = 192
    assert layer.ranks == [1, 4, 4, 1]
    assert layer.active_parameters() == 144
    report = size_report(nn.Sequential(layer))
    assert report.other_parameters == 0
    assert report.active_parameters == 144 and report.dense_equivalent_parameters == 192
    assert report.compression_ratio == pytest.approx(192 / 144)


def test_paper_configuration_compression():
    fc1 = TTLinear(768, 3072, 30, in_modes=[12, 8, 8], out_modes=[12, 16, 16], bias=False)
    assert fc1.ranks == [1, 12, 30, 30, 30, 16, 1]
    # 1*12*12 + 12*8*30 + 30*8*30 + 30*12*30 + 30*16*16 + 16*16*1
    tt = 144 + 2880 + 7200 + 10800 + 7680 + 256
    dense = 768 * 3072
    assert tt == 28960 and dense == 2359296
    assert fc1.active_parameters() == tt
    report = size_report(nn.Sequential(fc1))
    assert report.active_parameters == tt
    assert report.dense_equivalent_parameters == dense
    assert report.compression_ratio == pytest.approx(dense / tt)
    assert report.compression_ratio == pytest.approx(81.467, abs=1e-3)


def test_paper_attention_and_embedding_counts():
    attn = TTLinear(768, 768, 30, in_modes=[12, 8, 8], out_modes=[8, 8, 12], bias=False)
    assert attn.ranks == [1, 12, 30, 30, 30, 12, 1]
    # 12*12 + 12*8*30 + 30*8*30 + 30*8*30 + 30*8*12 + 12*12
    assert attn.active_parameters() == 144 + 2880 + 7200 + 7200 + 2880 + 144 == 20448
    emb = TTEmbedding(30522, 768, 32, vocab_modes=[16, 20, 10, 10], dim_modes=[4, 4, 8, 6])
    # core sizes v*e = 64, 80, 80, 60 with ranks [1, 32, 32, 32, 1]
    assert emb.active_parameters() == 64 * 32 + 32 * 80 * 32 + 32 * 80 * 32 + 32 * 60 == 167808
    report = size_report(nn.ModuleDict({"emb": emb, "attn": attn}))
    assert report.dense_equivalent_parameters == 30522 * 768 + 768 * 768
    assert report.active_parameters == 167808 + 20448
    assert report.compression_ratio == pytest.approx((30522 * 768 + 768 * 768) / (167808 + 20448))


def test_size_report_markdown_and_dict():
    model = nn.Sequential(TTLinear(768, 3072, 30, in_modes=[12, 8, 8], out_modes=[12, 16, 16]))
    report = size_report(model)
    text = report.to_markdown()
    assert "| 0 |" in text and "28,960" in text and "2,359,296" in text and "**total**" in text
    assert "| other (dense) | - | 3,072 |" in text  # the bias
    data = report.as_dict()
    assert data["active_parameters"] == 28960 + 3072
    assert data["dense_equivalent_parameters"] == 2359296 + 3072
    assert data["layers"][0]["compression"] == pytest.approx(2359296 / 28960)


def test_size_report_of_a_model_without_tt_layers():
    report = size_report(nn.Linear(4, 3))
    assert report.layers == [] and report.other_parameters == 15
    assert report.compression_ratio == 1.0


def test_cola_and_fixed_rank_kinds_through_tensorize_and_back():
    from comera_lightning.nn.tensorize import tensorize_like

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8)).double()

    model = mlp()
    records = tensorize(model, 3, min_features=8, low_rank=True, bottleneck_activation="silu", learn_gates=False)
    first = model[0]
    assert [r.ranks for r in records] == [[1, 3, 1], [1, 3, 1]] and first.bottleneck_activation == "silu"
    assert not any(g.requires_grad for g in first.gates)
    x = torch.randn(5, 16, dtype=torch.float64)
    a, b = first.cores[0][0], first.cores[1][..., 0]  # (16, 3), (3, 24): CoLA's B silu(A x)
    torch.testing.assert_close(first(x), torch.nn.functional.silu(x @ a) @ b + first.bias)
    # the recorded arguments rebuild the same kinds on a fresh dense model, which then loads the weights
    fresh = mlp()
    tensorize_like(fresh, model.state_dict())
    fresh.load_state_dict(model.state_dict())
    assert fresh[2].bottleneck_activation == "silu" and not fresh[2].gates[0].requires_grad
    torch.testing.assert_close(fresh(x), model(x))
    with pytest.raises(
        ValueError,
        match=r"decompose=True initialises each layer .*train it from scratch \(decompose=False\) or drop the",
    ):
        tensorize(mlp(), 3, min_features=8, decompose=True, bottleneck_activation="silu")


# --- the options object and the recorded calls -------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(100, 32, padding_idx=1), nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32))


def test_the_recorded_call_keeps_its_format():
    """Checkpoints carry this dict: its keys and their places must not change (tensorize_like reads old ones)."""
    from comera_lightning.nn import tensorize_specs

    model = _mlp()
    tensorize(model, (3,), min_features=16, exclude="0", low_rank=True, parameterization="mup", init_std=0.1)
    (spec,) = tensorize_specs(model.state_dict())[""]
    assert list(spec) == [
        "rank",
        "min_features",
        "include",
        "exclude",
        "linears",
        "embeddings",
        "embedding_rank",
        "low_rank",
        "bottleneck_activation",
        "learn_gates",
        "layer_kwargs",
    ]
    assert spec == {
        "rank": [3],
        "min_features": 16,
        "include": None,
        "exclude": "0",
        "linears": True,
        "embeddings": True,
        "embedding_rank": None,
        "low_rank": True,
        "bottleneck_activation": None,
        "learn_gates": True,
        "layer_kwargs": {"parameterization": "mup", "init_std": 0.1},
    }


def test_a_call_recorded_by_an_earlier_release_rebuilds_the_layers():
    """A spec as an earlier release wrote it (``decompose`` recorded, no low-rank or gate keys) still loads."""
    from collections import OrderedDict

    from comera_lightning.nn import tensorize_like

    model = _mlp()
    tensorize(model, 4, min_features=16, rank_threshold=0.05)
    state = OrderedDict(model.state_dict())
    old = {
        "rank": 4,
        "min_features": 16,
        "include": None,
        "exclude": None,
        "linears": True,
        "embeddings": True,
        "embedding_rank": None,
        "decompose": False,
        "layer_kwargs": {"rank_threshold": 0.05},
    }
    state._metadata = OrderedDict({"": {"version": 1, "comera_tensorize": [old]}})  # type: ignore[attr-defined]
    fresh = _mlp()
    records = tensorize_like(fresh, state)
    assert [r.name for r in records] == ["0", "1", "3"] and fresh[1].rank_threshold == 0.05
    fresh.load_state_dict(state)
    ids = torch.randint(0, 100, (2, 5))
    torch.testing.assert_close(fresh(ids), model(ids))


def test_options_object_is_the_same_call():
    from comera_lightning.nn import TensorizeOptions, tensorize_options, tensorize_specs

    by_keywords, by_options = _mlp(), _mlp()
    torch.manual_seed(1)
    tensorize(by_keywords, 3, min_features=16, rank_threshold=0.05, init_std=0.2)
    torch.manual_seed(1)
    options = TensorizeOptions(rank=3, min_features=16, layer_kwargs={"rank_threshold": 0.05, "init_std": 0.2})
    assert options.rank_threshold == 0.05 and options.layer_kwargs == {"init_std": 0.2}  # a field moves out
    options.apply(by_options)
    assert tensorize_specs(by_options) == tensorize_specs(by_keywords)
    for a, b in zip(by_keywords.state_dict().values(), by_options.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert tensorize_options(rank=3, init_std=0.2, layer_kwargs={"deduplicate": True}) == TensorizeOptions(
        rank=3, layer_kwargs={"init_std": 0.2, "deduplicate": True}
    )
    assert TensorizeOptions.from_spec(options.to_spec()) == options
    with pytest.raises(ValueError, match=r"rank_threshold is given twice, as 0.1 and as layer_kwargs"):
        TensorizeOptions(rank_threshold=0.1, layer_kwargs={"rank_threshold": 0.2})


def test_a_layer_argument_a_checkpoint_cannot_carry_is_named():
    from comera_lightning.nn import tensorize_like

    model = _mlp()
    tensorize(model, 3, min_features=16, exclude="0", init_std=torch.tensor(0.1))
    with pytest.raises(ValueError, match=r"was called with init_std=tensor\(0.1000\), which a checkpoint cannot"):
        tensorize_like(_mlp(), model.state_dict())


# --- which modules qualify, and how the new layers are built -------------------------------------------------------
def test_tensorize_defaults_are_rank_30_and_min_features_128():
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 127))
    records = tensorize(model)
    assert [r.name for r in records] == ["0"]  # 127 < 128
    assert max(model[0].ranks) == 30  # the 128 x 128 layer allows bonds up to 128: 30 is the default, not a clamp
    assert type(model[1]) is nn.Linear


def test_tensorize_min_features_one_takes_every_layer():
    model = nn.Sequential(nn.Linear(1, 3), nn.Embedding(2, 1))
    records = tensorize(model, rank=2, min_features=1)
    assert [r.name for r in records] == ["0", "1"]
    assert isinstance(model[0], TTLinear) and isinstance(model[1], TTEmbedding)


def test_tensorize_layers_after_a_shared_module_are_replaced_too():
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(32, 32))
    records = tensorize(model, rank=2, min_features=16)
    assert [r.name for r in records] == ["0", "3"]
    assert model[2] is model[0] and isinstance(model[3], TTLinear) and model[3] is not model[0]


def test_tensorize_refuses_the_root_module_and_says_how():
    model = nn.Linear(32, 32)
    with pytest.raises(
        ValueError,
        match=r"the model itself is an Linear; build TTLinear/TTEmbedding directly, or wrap the layer in a container "
        r"such as nn.Sequential",
    ):
        tensorize(model, rank=2, min_features=16)
    assert type(model) is nn.Linear and set(model.state_dict()) == {"weight", "bias"}


def test_tensorize_forwards_constructor_arguments_to_every_new_layer():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)).double()
    tensorize(model, rank=4, min_features=16, init_std=1e-4)
    # the weight's std; the default is 1/sqrt(64) = 0.125
    assert all(layer.weight_dense().std() < 1e-3 for layer in model)
    model = nn.Sequential(nn.Embedding(64, 32)).double()
    tensorize(model, rank=4, min_features=16, deduplicate=True)
    assert model[0].deduplicate

    model = nn.Sequential(nn.Embedding(64, 32)).double()
    (record,) = tensorize(model, rank=FULL_RANK, min_features=16, decompose=True, deduplicate=True)
    assert model[0].deduplicate and record.relative_error < 1e-10


def test_tensorize_keeps_the_device_of_each_module():
    """On the meta device (as on a GPU) the new layers are built where the dense modules were."""
    model = nn.Sequential(nn.Linear(32, 32, device="meta"), nn.Embedding(40, 32, device="meta"))
    tensorize(model, rank=4, min_features=16)
    assert {p.device.type for p in model.parameters()} == {"meta"}


class Projection(nn.Module):
    """A user's own module with Hugging Face Conv1D's attributes (``nf``, a ``(in, nf)`` weight) but not its name."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))

    def forward(self, x):
        return x @ self.weight


def test_only_hugging_face_conv1d_counts_as_a_transposed_linear():
    model = nn.Sequential(Projection(32, 48), nn.Linear(48, 32))
    records = tensorize(model, rank=2, min_features=16)
    assert [r.name for r in records] == ["1"]
    assert type(model[0]) is Projection


def test_size_report_keeps_allocated_and_active_ranks_apart():
    layer = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5])
    with torch.no_grad():
        layer.gates[1][0] = 0.0
    layer.refresh_masks_()
    (size,) = size_report(nn.Sequential(layer)).layers
    assert size.ranks == [1, 3, 3, 3, 1] and size.active_ranks == [1, 3, 2, 3, 1]
    assert (size.allocated_parameters, size.active_parameters) == (72, 57)


def test_size_report_dict_and_markdown_exactly():
    layer = TTLinear(12, 10, 3, in_modes=[4, 3], out_modes=[2, 5])
    report = size_report(nn.Sequential(layer, nn.Linear(10, 2)))
    assert report.as_dict() == {
        "layers": [
            {
                "name": "0",
                "ranks": [1, 3, 3, 3, 1],
                "active_ranks": [1, 3, 3, 3, 1],
                "active_parameters": 72,
                "allocated_parameters": 72,
                "dense_parameters": 120,
                "compression": pytest.approx(120 / 72),
            }
        ],
        "other_parameters": 32,
        "active_parameters": 104,
        "allocated_parameters": 104,
        "dense_equivalent_parameters": 152,
        "compression_ratio": pytest.approx(152 / 104),
    }
    assert report.to_markdown() == "\n".join(
        [
            "| layer | ranks | active params | dense params | compression |",
            "|---|---|---|---|---|",
            "| 0 | [1, 3, 3, 3, 1] | 72 | 120 | 1.7x |",
            "| other (dense) | - | 32 | 32 | 1.0x |",
            "| **total** | - | 104 | 152 | 1.5x |",
        ]
    )


def test_a_layer_argument_reaches_only_the_layers_that_take_it():
    model = nn.Sequential(nn.Linear(16, 32), nn.Embedding(20, 16))
    tensorize(model, rank=2, min_features=16, deduplicate=False)  # an embedding's argument; the linear has none
    assert isinstance(model[0], TTLinear) and model[1].deduplicate is False


def test_a_layer_argument_no_layer_takes_is_refused_before_anything_changes():
    model = nn.Sequential(nn.Linear(16, 32), nn.Embedding(20, 16))
    message = (
        "layer argument dedup, in_features: neither TTLinear nor TTEmbedding takes it; besides tensorize's own "
        "options they take deduplicate (TTEmbedding), init_std"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        tensorize(model, rank=2, min_features=16, dedup=True, in_features=3)
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], nn.Embedding)
