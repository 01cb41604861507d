"""Conversions out of the TT layers: untensorize() to dense modules, from_tensorly() as to_tensorly()'s inverse."""

from __future__ import annotations

import copy
import threading

import pytest
import tensorly as tl
import torch
from torch import nn

from comera_lightning.nn import TTEmbedding, TTLinear, tensorize, tt_layers, untensorize
from comera_lightning.tt import cores as cores_module


class Tiny(nn.Module):
    """Embedding with padding, an odd-sized linear (padded modes), a bias-free one and a shared one."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(90, 24, padding_idx=3)
        self.fc1 = nn.Linear(24, 37)
        self.fc2 = nn.Linear(37, 24, bias=False)
        self.shared = nn.Linear(24, 24)
        self.again = self.shared

    def forward(self, ids):
        h = self.embed(ids)
        h = self.fc2(torch.tanh(self.fc1(h)))
        return self.again(torch.tanh(self.shared(h)))


def _scramble_gates(model: nn.Module) -> None:
    """Gates away from 1 and some slices switched off, so that a conversion ignoring them would show."""
    with torch.no_grad():
        for _, layer in tt_layers(model):
            for gate in layer.gates:
                gate.uniform_(0.5, 1.5)
            layer.remove_slices_(0, [0])


def _tt_model() -> Tiny:
    model = Tiny().double()
    tensorize(model, rank=4, min_features=8)
    _scramble_gates(model)
    return model


@pytest.mark.parametrize("truncate", [False, True])
def test_untensorize_keeps_the_outputs(truncate):
    model = _tt_model()
    if truncate:  # masked slices physically removed in some layers, still allocated in the others
        model.fc1.truncate_()
        model.embed.truncate_()
    ids = torch.randint(0, 90, (3, 7))
    ids[0, 0] = 3
    expected = model(ids)
    dense = copy.deepcopy(model)
    records = untensorize(dense)
    assert [r.name for r in records] == ["embed", "fc1", "fc2", "shared"]
    assert [r.kind for r in records] == ["embedding", "linear", "linear", "linear"]
    assert records[1].shape == (24, 37) and records[1].ranks == model.fc1.active_ranks
    assert records[1].tt_parameters == model.fc1.active_parameters()
    assert not tt_layers(dense)
    assert type(dense.embed) is nn.Embedding and dense.embed.padding_idx == 3
    assert type(dense.fc1) is nn.Linear and dense.fc2.bias is None
    assert dense.shared is dense.again
    assert all(p.dtype == torch.float64 for p in dense.parameters())
    torch.testing.assert_close(dense.fc1.bias, model.fc1.bias, rtol=0, atol=0)
    torch.testing.assert_close(dense(ids), expected, rtol=1e-10, atol=1e-10)


def test_untensorize_keeps_mode_and_refuses_a_bare_layer():
    model = _tt_model().eval()
    untensorize(model)
    assert not any(m.training for m in model.modules())
    with pytest.raises(
        ValueError,
        match=r"the model itself is a TTLinear; call its weight_dense\(\) directly, or wrap the layer in a container",
    ):
        untensorize(TTLinear(16, 16, rank=2))


def test_linear_round_trip_through_tensorly():
    layer = TTLinear(30, 50, rank=[3, 5, 4], in_modes=[4, 8], out_modes=[5, 10], dtype=torch.float64)
    with torch.no_grad():
        layer.bias.normal_()
    _scramble_gates(nn.Sequential(layer))
    tt = layer.to_tensorly()
    assert isinstance(tt, tl.tt_tensor.TTTensor)
    back = TTLinear.from_tensorly(tt, len(layer.in_modes), in_features=30, out_features=50, bias=layer.bias)
    assert (back.in_modes, back.out_modes, back.ranks) == (layer.in_modes, layer.out_modes, layer.ranks)
    assert back.cores[0].dtype == torch.float64
    x = torch.randn(6, 30, dtype=torch.float64)
    torch.testing.assert_close(back(x), layer(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(back.weight_dense(), layer.weight_dense(), rtol=1e-12, atol=1e-12)
    # defaults: features are the products of the modes, no bias
    bare = TTLinear.from_tensorly(tt, 2)
    assert (bare.in_features, bare.out_features, bare.bias) == (32, 50, None)


def test_embedding_round_trip_through_tensorly():
    layer = TTEmbedding(90, 24, rank=4, padding_idx=3, dtype=torch.float64)
    _scramble_gates(nn.Sequential(layer))
    ttm = layer.to_tensorly()
    assert isinstance(ttm, tl.tt_matrix.TTMatrix)
    back = TTEmbedding.from_tensorly(ttm, num_embeddings=90, padding_idx=3)
    assert (back.vocab_modes, back.dim_modes, back.ranks) == (layer.vocab_modes, layer.dim_modes, layer.ranks)
    ids = torch.tensor([[0, 3, 89, 17], [5, 5, 3, 60]])
    torch.testing.assert_close(back(ids), layer(ids), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(back.weight_dense(), layer.weight_dense(), rtol=1e-12, atol=1e-12)


def test_from_tensorly_refuses_the_other_format():
    linear = TTLinear(16, 16, rank=2)
    embedding = TTEmbedding(16, 16, rank=2)
    with pytest.raises(ValueError, match=r"expects a TTMatrix \(TTLinear takes TTTensor\)"):
        TTEmbedding.from_tensorly(linear.to_tensorly())
    with pytest.raises(ValueError, match=r"expects a TTTensor \(TTEmbedding takes TTMatrix\)"):
        TTLinear.from_tensorly(embedding.to_tensorly(), 1)
    with pytest.raises(ValueError, match=r"num_in_modes must be in \[1, 2\) for a TT with modes \[16, 16\], got 2"):
        TTLinear.from_tensorly(linear.to_tensorly(), len(linear.in_modes) + len(linear.out_modes))
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\), got \(3,\)"):
        TTLinear.from_tensorly(linear.to_tensorly(), len(linear.in_modes), bias=torch.zeros(3))


def test_reconstruction_leaves_other_threads_backend_alone(monkeypatch):
    """tensorly's backend is switched for the calling thread only while a TT is reconstructed."""
    inside, release = threading.Event(), threading.Event()
    original = tl.tt_to_tensor

    def paused(factors):
        inside.set()
        assert release.wait(10)
        return original(factors)

    def global_backend() -> str:  # as a fresh thread sees it
        seen = []
        observer = threading.Thread(target=lambda: seen.append(tl.get_backend()))
        observer.start()
        observer.join()
        return seen[0]

    before = global_backend()
    assert before != "pytorch", "a test left tensorly's global backend at pytorch"
    monkeypatch.setattr(cores_module.tl, "tt_to_tensor", paused)
    layer = TTLinear(16, 16, rank=2)
    worker = threading.Thread(target=layer.weight_dense)
    worker.start()
    try:
        assert inside.wait(10)
        assert global_backend() == before
    finally:
        release.set()
        worker.join()
