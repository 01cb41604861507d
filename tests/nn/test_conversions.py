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
    with pytest.raises(ValueError, match=r"^TTEmbedding\.from_tensorly expects a TTMatrix \(TTLinear takes TTTensor\)"):
        TTEmbedding.from_tensorly(linear.to_tensorly())
    with pytest.raises(ValueError, match=r"^TTLinear\.from_tensorly expects a TTTensor \(TTEmbedding takes TTMatrix\)"):
        TTLinear.from_tensorly(embedding.to_tensorly(), 1)
    with pytest.raises(ValueError, match=r"num_in_modes must be in \[1, 2\) for a TT with modes \[16, 16\], got 2"):
        TTLinear.from_tensorly(linear.to_tensorly(), len(linear.in_modes) + len(linear.out_modes))
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\), got \(3,\)"):
        TTLinear.from_tensorly(linear.to_tensorly(), len(linear.in_modes), bias=torch.zeros(3))


def _global_backend() -> str:
    """tensorly's backend as a fresh thread sees it."""
    seen = []
    observer = threading.Thread(target=lambda: seen.append(tl.get_backend()))
    observer.start()
    observer.join()
    return seen[0]


def _assert_other_threads_keep_their_backend(run, owner, name: str, monkeypatch) -> None:
    """While ``run`` (on a worker thread) is paused inside ``owner.name``, a fresh thread sees the global backend."""
    inside, release = threading.Event(), threading.Event()
    original = getattr(owner, name)

    def paused(*args):
        inside.set()
        assert release.wait(10)
        return original(*args)

    before = _global_backend()
    assert before != "pytorch", "a test left tensorly's global backend at pytorch"
    monkeypatch.setattr(owner, name, paused)
    worker = threading.Thread(target=run)
    worker.start()
    try:
        assert inside.wait(10)
        assert _global_backend() == before
    finally:
        release.set()
        worker.join()


def test_reconstruction_leaves_other_threads_backend_alone(monkeypatch):
    """tensorly's backend is switched for the calling thread only while a TT is reconstructed."""
    layer = TTLinear(16, 16, rank=2)
    _assert_other_threads_keep_their_backend(layer.weight_dense, cores_module.tl, "tt_to_tensor", monkeypatch)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_to_tensorly_leaves_other_threads_backend_alone(kind, monkeypatch):
    """to_tensorly() switches tensorly's backend for the calling thread only (paused where the cores are read)."""
    layer = TTLinear(16, 16, rank=2) if kind == "linear" else TTEmbedding(16, 16, rank=2)
    _assert_other_threads_keep_their_backend(layer.to_tensorly, layer, "gated_cores", monkeypatch)


def test_linear_from_tensorly_keeps_padded_sizes_and_options():
    layer = TTLinear(30, 47, rank=3, in_modes=[4, 8], out_modes=[5, 10], dtype=torch.float64)
    with torch.no_grad():
        layer.bias.normal_()
    back = TTLinear.from_tensorly(
        layer.to_tensorly(), 2, in_features=30, out_features=47, bias=layer.bias, rank_threshold=0.2
    )
    assert (back.in_features, back.out_features) == (30, 47)
    x = torch.randn(3, 30, dtype=torch.float64)
    torch.testing.assert_close(back(x), layer(x), rtol=1e-12, atol=1e-12)
    # the forwarded rank_threshold is the one refresh_masks_ applies: a gate at 0.15 is switched off
    with torch.no_grad():
        back.gates[0][0] = 0.15
    assert back.refresh_masks_()[1] == back.ranks[1] - 1


def test_from_tensorly_takes_plain_factors_on_their_device():
    factors = [
        torch.randn(1, 4, 3, dtype=torch.float64, device="meta"),
        torch.randn(3, 5, 1, dtype=torch.float64, device="meta"),
    ]
    linear = TTLinear.from_tensorly(factors, 1)
    assert {t.device.type for t in [*linear.parameters(), *linear.buffers()]} == {"meta"}
    assert linear.cores[0].dtype == torch.float64
    ttm = [torch.randn(1, 3, 2, 2, device="meta"), torch.randn(2, 4, 3, 1, device="meta")]
    embedding = TTEmbedding.from_tensorly(ttm)
    assert {t.device.type for t in [*embedding.parameters(), *embedding.buffers()]} == {"meta"}


def test_embedding_from_tensorly_defaults_to_the_full_row_product():
    layer = TTEmbedding(12, 6, rank=2, vocab_modes=[3, 4], dim_modes=[2, 3], dtype=torch.float64)
    back = TTEmbedding.from_tensorly(layer.to_tensorly())
    assert (back.num_embeddings, back.embedding_dim, back.padding_idx) == (12, 6, None)
    ids = torch.arange(12)
    torch.testing.assert_close(back(ids), layer(ids), rtol=1e-12, atol=1e-12)


def test_embedding_from_tensorly_keeps_modes_vocabulary_and_options():
    # 87 rows on padded modes [3, 30] (90), dim modes [4, 6] (not the automatic choice for either)
    layer = TTEmbedding(87, 24, rank=3, vocab_modes=[3, 30], dim_modes=[4, 6], dtype=torch.float64)
    back = TTEmbedding.from_tensorly(layer.to_tensorly(), num_embeddings=87, deduplicate=True, rank_threshold=0.2)
    assert (back.num_embeddings, back.vocab_modes, back.dim_modes) == (87, [3, 30], [4, 6])
    assert back.deduplicate
    ids = torch.tensor([[0, 86, 5], [40, 40, 1]])
    torch.testing.assert_close(back(ids), layer(ids), rtol=1e-12, atol=1e-12)
    with pytest.raises(IndexError, match=r"token id 87 is outside the vocabulary \[0, 87\)"):
        back(torch.tensor([87]))
    with torch.no_grad():
        back.gates[0][0] = 0.15
    assert back.refresh_masks_()[1] == back.ranks[1] - 1


def test_one_core_embedding_round_trip():
    layer = TTEmbedding(7, 3, rank=2, vocab_modes=[7], dim_modes=[3], dtype=torch.float64)
    back = TTEmbedding.from_tensorly(layer.to_tensorly())
    assert back.cores[0].dtype == torch.float64 and len(back.cores) == 1
    torch.testing.assert_close(back.weight_dense(), layer.weight_dense(), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_mup_round_trip_through_tensorly_keeps_the_learning_rate_scales(kind):
    # muP scales each core's rate by its fan-in, which depends on the ranks: the rebuilt layer takes the factors'
    # (rank 12, unlike the modes 16, so that a rank read from a mode would show)
    torch.manual_seed(0)
    if kind == "linear":
        layer = TTLinear(256, 256, 12, in_modes=[16, 16], out_modes=[16, 16], parameterization="mup")
        rebuilt = TTLinear.from_tensorly(layer.to_tensorly(), 2, parameterization="mup")
    else:
        layer = TTEmbedding(256, 256, 200, vocab_modes=[16, 16], dim_modes=[16, 16], parameterization="mup")
        rebuilt = TTEmbedding.from_tensorly(layer.to_tensorly(), parameterization="mup")
    assert layer.lr_scales != [1.0] * len(layer.cores)  # the case that tells the ranks apart
    assert rebuilt.lr_scales == layer.lr_scales
    assert [tuple(c.shape) for c in rebuilt.cores] == [tuple(c.shape) for c in layer.cores]
