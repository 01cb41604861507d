"""tensorize() on Hugging Face models built from tiny configs (no download): LlamaForCausalLM, BertForMaskedLM and
GPT2LMHeadModel (whose Conv1D stores its weight transposed). Each is tensorised, trained a few steps inside a plain
LightningModule with RankAdaptation, ContractionPlanner and RankMonitor, truncated, saved, reloaded into a fresh
full-rank tensorised model, and must reproduce the logits; decompose=True reports per-layer errors."""

from __future__ import annotations

import pytest
import torch
from helpers.dropin_models import VOCAB, hf_model
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from comera_lightning.callbacks import ContractionPlanner, RankAdaptation, RankMonitor
from comera_lightning.nn import TTEmbedding, TTLinear, tensorize, tt_layers
from comera_lightning.optim import comera_parameter_groups

transformers = pytest.importorskip("transformers")

RANK, MIN_FEATURES = 8, 32
MODELS = ["llama", "bert", "gpt2"]


def build(kind: str, seed: int = 0) -> nn.Module:
    """A tiny randomly initialised two-block model of the kind (no download)."""
    torch.manual_seed(seed)
    return hf_model(kind, num_layers=2)


def dense_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear-like module and (rows, dim) of every embedding with both sides >= MIN_FEATURES."""
    shapes = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            shape = (module.in_features, module.out_features)
        elif type(module).__name__ == "Conv1D":
            shape = tuple(module.weight.shape)  # (in, out)
        elif type(module) is nn.Embedding:
            shape = (module.num_embeddings, module.embedding_dim)
        else:
            continue
        if min(shape) >= MIN_FEATURES:
            shapes[name] = shape
    return shapes


class HFWrapper(LightningModule):
    """The plain LightningModule a user writes around a Hugging Face model: loss from the model's labels."""

    def __init__(self, model: nn.Module, masked: bool) -> None:
        super().__init__()
        self.model, self.masked = model, masked

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        labels = ids.clone()
        if self.masked:  # BERT: predict every fourth token from a [MASK]-ed input
            chosen = torch.zeros_like(ids, dtype=torch.bool)
            chosen[:, ::4] = True
            labels[~chosen] = -100
            ids = ids.masked_fill(chosen, 3)
        return self.model(input_ids=ids, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(comera_parameter_groups(self, lr_cores=1e-2, lr_gates=0.2, lr_other=1e-2))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_tensorize_train_truncate_save_reload_reproduces_logits(kind, tmp_path):
    model = build(kind)
    expected = dense_shapes(model)
    records = tensorize(model, rank=RANK, min_features=MIN_FEATURES)
    assert {r.name: r.shape for r in records} == expected  # every qualifying layer, Conv1D included
    assert all(
        isinstance(model.get_submodule(r.name), TTLinear if r.kind == "linear" else TTEmbedding) for r in records
    )
    initial = {name: layer.ranks for name, layer in tt_layers(model)}

    ids = torch.randint(4, VOCAB, (64, 12), generator=torch.Generator().manual_seed(0))
    adaptation = RankAdaptation(
        gamma=1.0, late_start_step=4, target_compression=4.0, truncate_every_n_steps=4, min_dead_fraction=0.1
    )
    trainer = Trainer(
        max_steps=12,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,  # RankMonitor's picture goes there
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[adaptation, ContractionPlanner(verbose=False), RankMonitor(log_every_n_steps=2)],
    )
    wrapper = HFWrapper(model, masked=kind == "bert")
    trainer.fit(wrapper, DataLoader(TensorDataset(ids), batch_size=8))
    assert adaptation.truncations >= 1
    trained = {name: layer.ranks for name, layer in tt_layers(wrapper)}
    assert any(trained[f"model.{name}"] != ranks for name, ranks in initial.items()), "no rank shrank"
    path = tmp_path / f"{kind}.ckpt"
    trainer.save_checkpoint(path)

    fresh_model = build(kind, seed=1)  # other random weights, full rank again
    tensorize(fresh_model, rank=RANK, min_features=MIN_FEATURES)
    fresh = HFWrapper(fresh_model, masked=kind == "bert")
    fresh.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    assert {name: layer.ranks for name, layer in tt_layers(fresh)} == trained
    probe = ids[:3]
    torch.testing.assert_close(logits(fresh.model, probe), logits(wrapper.model, probe), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", MODELS)
def test_decompose_reports_per_layer_error_and_full_rank_is_exact(kind):
    reference = build(kind).double()
    ids = torch.randint(4, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    expected = logits(reference, ids)
    dense_weights = {
        name: (m.weight.detach().t() if type(m).__name__ == "Conv1D" else m.weight.detach()).clone()
        for name, m in reference.named_modules()
        if name in dense_shapes(reference)
    }

    low = build(kind).double()
    records = tensorize(low, rank=3, min_features=MIN_FEATURES, decompose=True)
    assert {r.name for r in records} == set(dense_weights)
    for record in records:
        layer = low.get_submodule(record.name)
        assert record.relative_error is not None and 0.0 < record.relative_error < 1.0
        # the reported error is the one of the map the layer computes (Conv1D: of weight.T, as nn.Linear holds it)
        measured = (layer.weight_dense() - dense_weights[record.name]).norm() / dense_weights[record.name].norm()
        assert record.relative_error == pytest.approx(float(measured), rel=1e-6)

    full = build(kind).double()
    records = tensorize(full, rank=10_000, min_features=MIN_FEATURES, decompose=True)
    assert max(r.relative_error for r in records) < 1e-10
    torch.testing.assert_close(logits(full, ids), expected, rtol=1e-9, atol=1e-9)


def test_conv1d_from_scratch_keeps_shape_bias_and_dtype():
    conv = transformers.pytorch_utils.Conv1D(96, 48)  # nf (out) = 96, nx (in) = 48
    model = nn.Sequential(conv)
    (record,) = tensorize(model, rank=4, min_features=32)
    layer = model[0]
    assert isinstance(layer, TTLinear) and (layer.in_features, layer.out_features) == (48, 96)
    assert record.shape == (48, 96) and layer.bias is not None
    assert model(torch.randn(5, 48)).shape == (5, 96)


def _conv1d(nx: int = 24, nf: int = 40) -> nn.Module:
    """A float64 Conv1D with a random (not zero) bias."""
    conv = transformers.pytorch_utils.Conv1D(nf, nx).double()
    with torch.no_grad():
        conv.weight.normal_()
        conv.bias.normal_()
    return conv


def test_conv1d_decomposed_at_full_rank_computes_the_same_map_with_its_bias():
    torch.manual_seed(0)
    conv = _conv1d()
    x = torch.randn(5, 24, dtype=torch.float64)
    expected = conv(x)
    model = nn.Sequential(conv)
    (record,) = tensorize(model, rank=10_000, min_features=16, decompose=True)
    layer = model[0]
    assert isinstance(layer, TTLinear) and record.relative_error < 1e-10
    torch.testing.assert_close(layer.bias, conv.bias.detach(), rtol=0, atol=0)
    torch.testing.assert_close(model(x), expected, rtol=1e-10, atol=1e-10)
    assert layer.bias.requires_grad and all(core.requires_grad for core in layer.cores)  # a layer to train


def test_conv1d_without_bias_becomes_a_linear_without_bias():
    torch.manual_seed(0)
    conv = _conv1d()
    conv.bias = None
    weight = conv.weight.detach().clone()
    model = nn.Sequential(conv)
    (record,) = tensorize(model, rank=10_000, min_features=16, decompose=True)
    assert model[0].bias is None and record.relative_error < 1e-10
    torch.testing.assert_close(model[0].weight_dense(), weight.t(), rtol=1e-10, atol=1e-10)


def test_decomposing_a_conv1d_draws_what_decomposing_the_same_linear_draws():
    """Seeded runs go on alike: reading a Conv1D as a linear draws no random numbers of its own."""
    torch.manual_seed(0)
    conv = _conv1d()
    linear = nn.Linear(24, 40).double()
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    streams = []
    for dense in (conv, linear):
        model = nn.Sequential(dense)
        torch.manual_seed(1)
        tensorize(model, rank=4, min_features=16, decompose=True)
        streams.append((model[0].weight_dense().detach(), torch.rand(8)))
    torch.testing.assert_close(streams[0], streams[1], rtol=1e-12, atol=1e-12)
