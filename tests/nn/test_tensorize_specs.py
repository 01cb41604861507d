"""The calls tensorize() records on a model and in its state dict, tensorize_like() repeating them on a fresh dense
model, and untensorize() forgetting them once no comera layer is left."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from comera_lightning.nn import (
    TensorizeOptions,
    TTEmbedding,
    TTLinear,
    tensorize,
    tensorize_like,
    tensorize_specs,
    tt_layers,
    untensorize,
)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(100, 32, padding_idx=1), nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32))


def _ids():
    return torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(1))


class SelfTensorized(nn.Module):
    """Tensorises its body in ``__init__``, then adds a head that stays dense."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 32)
        self.body = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32))
        tensorize(self, 3, min_features=16, embeddings=False)
        self.head = nn.Linear(32, 32)

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


# --- what is recorded ---------------------------------------------------------------------------------------------
def test_specs_of_a_model_are_keyed_by_the_module_tensorize_was_called_on():
    model = nn.ModuleDict({"encoder": _mlp(), "decoder": _mlp()})
    tensorize(model["encoder"], 3, min_features=16, exclude="0")
    specs = tensorize_specs(model)
    assert list(specs) == ["encoder"]
    (spec,) = specs["encoder"]
    assert spec["rank"] == 3 and spec["exclude"] == "0"
    assert tensorize_specs(model.state_dict()) == specs


def test_a_state_dict_without_metadata_records_no_call():
    model = _mlp()
    tensorize(model, 3, min_features=16)
    assert tensorize_specs(dict(model.state_dict())) == {}


def test_every_call_is_recorded_and_rebuilt_in_order():
    model = _mlp()
    first = tensorize(model, 3, min_features=16, embeddings=False)
    second = tensorize(model, 4, min_features=16, linears=False)
    assert [r.name for r in first + second] == ["1", "3", "0"]
    assert [spec["rank"] for spec in tensorize_specs(model)[""]] == [3, 4]
    assert [spec["rank"] for spec in tensorize_specs(model.state_dict())[""]] == [3, 4]

    fresh = _mlp()
    records = tensorize_like(fresh, model.state_dict())
    assert [r.name for r in records] == ["1", "3", "0"]
    assert isinstance(fresh[0], TTEmbedding) and max(fresh[0].ranks) == 4
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh(_ids()), model(_ids()))


def test_the_saved_record_is_a_copy_of_the_models():
    model = _mlp()
    tensorize(model, 3, min_features=16, init_std=0.1)
    state = model.state_dict()
    (saved,) = state._metadata[""]["comera_tensorize"]  # type: ignore[attr-defined]
    saved["layer_kwargs"]["init_std"] = 0.5
    saved["rank"] = 7
    (recorded,) = tensorize_specs(model)[""]
    assert recorded["layer_kwargs"] == {"init_std": 0.1} and recorded["rank"] == 3
    (again,) = tensorize_specs(model.state_dict())[""]
    assert again["layer_kwargs"] == {"init_std": 0.1}


def test_layer_arguments_are_recorded_as_plain_data_or_named_as_unportable():
    # the values need not make sense to a layer: recording reads only their types
    options = TensorizeOptions(layer_kwargs={"init_std": {"order": (1, 2), "name": "x"}, "deduplicate": {1: "a"}})
    spec = options.to_spec()
    assert spec["layer_kwargs"] == {"init_std": {"order": [1, 2], "name": "x"}}
    assert spec["unportable"] == ["deduplicate={1: 'a'}"]


def test_options_from_a_recorded_call_drop_what_is_not_an_argument():
    """``unportable`` is a note, not a layer argument; ``decompose`` (earlier releases) is skipped."""
    spec = TensorizeOptions(rank=3, layer_kwargs={"init_std": 0.1, "deduplicate": torch.Generator()}).to_spec()
    assert spec["unportable"][0].startswith("deduplicate=")
    options = TensorizeOptions.from_spec(spec)
    assert options == TensorizeOptions(rank=3, layer_kwargs={"init_std": 0.1})
    assert not TensorizeOptions.from_spec({"rank": 3, "decompose": True, "layer_kwargs": {}}).decompose


# --- tensorize_like ------------------------------------------------------------------------------------------------
def test_tensorize_like_does_not_decompose_a_recorded_decompose():
    """An earlier release recorded ``decompose``: the fresh layers are built plainly, the weights then load."""
    model = _mlp()
    tensorize(model, 4, min_features=16, decompose=True)
    state = OrderedDict(model.state_dict())
    (spec,) = tensorize_specs(model)[""]
    state._metadata = OrderedDict({"": {"comera_tensorize": [dict(spec, decompose=True)]}})  # type: ignore[attr-defined]
    fresh = _mlp()
    records = tensorize_like(fresh, state)
    assert [r.name for r in records] == ["0", "1", "3"]
    assert all(r.relative_error is None for r in records)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(_ids()), model(_ids()))


def test_tensorize_like_takes_the_specs_given():
    model = _mlp()
    tensorize(model, 3, min_features=16)
    specs = tensorize_specs(model)
    state = dict(model.state_dict())  # the metadata is gone: the specs come from elsewhere
    fresh = _mlp()
    assert [r.name for r in tensorize_like(fresh, state, specs)] == ["0", "1", "3"]
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(_ids()), model(_ids()))


def test_tensorize_like_names_the_layers_a_plain_dict_lost():
    model = _mlp()
    tensorize(model, 3, min_features=16, include="[13]")
    with pytest.raises(
        ValueError,
        match=r"holds comera layers at \['1', '3'\], which this Sequential builds dense, .*copying into a plain "
        r"dict\); call tensorize\(\) with the arguments used in training, then load_state_dict",
    ):
        tensorize_like(_mlp(), dict(model.state_dict()))


def test_tensorize_like_refuses_a_state_dict_of_another_model():
    model = nn.ModuleDict({"encoder": _mlp()})
    tensorize(model["encoder"], 3, min_features=16)
    with pytest.raises(
        ValueError,
        match=r"records tensorize\(\) on submodule 'encoder', which this ModuleDict does not have: it is from a "
        r"different model",
    ):
        tensorize_like(nn.ModuleDict({"decoder": _mlp()}), model.state_dict())


def test_tensorize_like_skips_the_calls_the_model_makes_itself():
    model = SelfTensorized()
    assert type(model.head) is nn.Linear
    fresh = SelfTensorized()
    assert tensorize_like(fresh, model.state_dict()) == []
    assert type(fresh.head) is nn.Linear  # repeating the __init__ call would take the head as well
    fresh.load_state_dict(model.state_dict())

    tensorize(model, 4, min_features=16, include="embed")  # a later call, by hand
    fresh = SelfTensorized()
    assert [r.name for r in tensorize_like(fresh, model.state_dict())] == ["embed"]
    assert isinstance(fresh.embed, TTEmbedding) and type(fresh.head) is nn.Linear
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh(_ids()), model(_ids()))


def test_unportable_arguments_are_named_with_the_module_they_were_given_to():
    model = nn.ModuleDict({"encoder": _mlp()})
    tensorize(model["encoder"], 3, min_features=16, exclude="0", init_std=torch.tensor(0.1))
    with pytest.raises(ValueError, match=r"tensorize\(\) on encoder was called with init_std=tensor\(0.1000\), which"):
        tensorize_like(nn.ModuleDict({"encoder": _mlp()}), model.state_dict())

    spec = TensorizeOptions(
        rank=3, layer_kwargs={"init_std": torch.tensor(0.1), "deduplicate": torch.Generator()}
    ).to_spec()
    with pytest.raises(
        ValueError,
        match=r"tensorize\(\) on the model was called with init_std=tensor\(0.1000\), "
        r"deduplicate=<torch\._C\.Generator .*"
        r"call tensorize\(\) with these arguments in the model's __init__",
    ):
        tensorize_like(_mlp(), {}, {"": [spec]})


# --- untensorize ---------------------------------------------------------------------------------------------------
def test_untensorize_replaces_the_layers_after_a_shared_one():
    shared = TTLinear(32, 32, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared, TTLinear(32, 32, 2))
    records = untensorize(model)
    assert [r.name for r in records] == ["0", "3"]
    assert type(model[0]) is nn.Linear and model[2] is model[0]
    assert type(model[3]) is nn.Linear and model[3] is not model[0]


def test_untensorize_forgets_the_recorded_calls():
    model = _mlp()
    tensorize(model, 3, min_features=16)
    untensorize(model)
    assert tt_layers(model) == []
    assert tensorize_specs(model) == {} and tensorize_specs(model.state_dict()) == {}
    fresh = _mlp()
    assert tensorize_like(fresh, model.state_dict()) == []  # the dense checkpoint loads into the dense model
    fresh.load_state_dict(model.state_dict())
