"""Compile: the compiled step equals the eager one (training, validation, rank gates and truncation), without
graph breaks, and a bad module name is refused by name.

The backend is aot_eager: it traces forward and backward as inductor does (TTLinearFunction's custom backward
included) without inductor's C++ build, which takes minutes on these CPUs."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from tiny import TinyRegressor, regression_loader
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from comera_lightning.callbacks import Compile, RankAdaptation
from comera_lightning.lit import CausalLM
from comera_lightning.models import LayerConfig, SequenceClassifier
from comera_lightning.nn import tt_layers

VOCAB, SEQ = 96, 12


class _Losses(Callback):
    def __init__(self) -> None:
        self.train: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(float(outputs["loss"]))

    def on_validation_end(self, trainer, pl_module) -> None:  # after the task logged its epoch
        self.val.append(float(trainer.callback_metrics["val/loss"]))


def _trainer(tmp_path, callbacks, max_steps, **kwargs) -> Trainer:
    options = dict(
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
    )
    return Trainer(callbacks=callbacks, **{**options, **kwargs})


def _decoder() -> CausalLM:
    torch.manual_seed(0)
    layers = LayerConfig(
        rank=6, embedding_rank=6, min_features=16, low_rank_linears="lm_head", layer_ranks={"lm_head": 8}
    )
    return CausalLM(vocab_size=VOCAB, d_model=32, num_heads=2, d_ff=64, num_layers=2, max_len=SEQ, layer_config=layers)


def _token_batches(count: int, seed: int) -> DataLoader:
    ids = torch.randint(0, VOCAB, (count * 4, SEQ), generator=torch.Generator().manual_seed(seed))
    return DataLoader([{"input_ids": row} for row in ids], batch_size=4)


def _fit_decoder(tmp_path, compiled: bool) -> tuple[_Losses, CausalLM]:
    model, losses = _decoder(), _Losses()
    callbacks = [losses, RankAdaptation(gamma=0.05, truncate_every_n_steps=None)]
    if compiled:
        callbacks.append(Compile(backend="aot_eager"))
    _trainer(
        tmp_path,
        callbacks,
        max_steps=6,
        precision="64-true",
        val_check_interval=3,
        limit_val_batches=2,
        num_sanity_val_steps=0,
    ).fit(model, _token_batches(6, 0), _token_batches(2, 1))
    return losses, model


def test_compiled_decoder_trains_and_validates_as_eager_without_graph_breaks(tmp_path):
    counters.clear()
    compiled_losses, compiled = _fit_decoder(tmp_path / "compiled", compiled=True)
    # traced whole, once for training (grad) and once for validation (no grad): no graph break, no frame that fell
    # back to eager, no recompilation as the gates and masks change step by step
    assert dict(counters["graph_break"]) == {}
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 2
    assert counters["stats"]["unique_graphs"] == 2
    eager_losses, eager = _fit_decoder(tmp_path / "eager", compiled=False)
    assert len(compiled_losses.train) == 6 and len(compiled_losses.val) == 2
    torch.testing.assert_close(compiled_losses.train, eager_losses.train, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(compiled_losses.val, eager_losses.val, rtol=1e-10, atol=1e-12)
    for (key, got), want in zip(compiled.state_dict().items(), eager.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=key)
    # compiled in place: the same keys, so checkpoints of compiled and eager runs are interchangeable
    assert compiled.state_dict().keys() == eager.state_dict().keys()


def test_truncation_recompiles_and_keeps_training_as_eager(tmp_path):
    def fit(compiled: bool) -> tuple[TinyRegressor, Compile | None]:
        model = TinyRegressor()
        compile_callback = Compile(backend="aot_eager") if compiled else None
        rank = RankAdaptation(gamma=0.5, truncate_every_n_steps=8, min_dead_fraction=0.1)
        callbacks = [rank] + ([compile_callback] if compile_callback else [])
        _trainer(tmp_path, callbacks, max_steps=32, precision="64-true").fit(model, regression_loader())
        return model, compile_callback

    compiled, callback = fit(True)
    eager, _ = fit(False)
    assert callback is not None and callback.compiled == ["net"]
    assert [layer.ranks for _, layer in tt_layers(compiled)] == [layer.ranks for _, layer in tt_layers(eager)]
    assert any(layer.ranks != TinyRegressor().net[0].ranks for _, layer in tt_layers(compiled)), "no truncation"
    assert callback.resets >= 1  # each cut forgot the code specialised on the old shapes
    torch.testing.assert_close(compiled.losses, eager.losses, rtol=1e-8, atol=1e-12)


def test_named_modules_are_compiled_and_a_missing_name_is_refused(tmp_path):
    model = TinyRegressor()
    callback = Compile(modules="net.0", backend="eager")
    callback.on_fit_start(None, model)  # type: ignore[arg-type]
    assert callback.compiled == ["net.0"] and model.net[0]._compiled_call_impl is not None
    assert model.net[2]._compiled_call_impl is None
    with pytest.raises(ValueError, match=r"names 'encoder'.*its submodules are \['net'\]"):
        Compile(modules=["encoder"]).on_fit_start(None, TinyRegressor())  # type: ignore[arg-type]


@pytest.mark.parametrize("model_class", ["SequenceClassifier", "MaskedLanguageModel"])
def test_the_encoder_models_compile_whole_with_dropout_in_training_and_evaluation(model_class):
    import comera_lightning.models as models

    torch.manual_seed(0)
    kwargs = dict(d_model=32, num_heads=2, d_ff=64, num_layers=1, max_len=SEQ, dropout=0.1)
    layers = dict(rank=4, embedding_rank=4, min_features=16)
    if model_class == "SequenceClassifier":
        model = models.SequenceClassifier(vocab_size=VOCAB, num_classes=3, layer_config=layers, **kwargs)
    else:
        model = models.MaskedLanguageModel(vocab_size=VOCAB, layer_config=layers, **kwargs)
    ids = torch.randint(1, VOCAB, (2, SEQ))
    counters.clear()
    torch.compiler.reset()
    model.compile(backend="eager")
    model.train()
    model(ids).float().sum().backward()  # packed CPU dropout: its mask is one opaque operator in the graph
    model.eval()
    with torch.no_grad():
        model(ids)
    assert dict(counters["graph_break"]) == {}
    assert counters["frames"]["ok"] == counters["frames"]["total"]


def test_compiled_dropout_draws_the_eager_masks():
    # the packed mask is drawn by the same generator inside the compiled graph: same seed, same training step
    torch.manual_seed(0)
    layers = dict(rank=4, embedding_rank=4, min_features=16)
    model = SequenceClassifier(
        vocab_size=VOCAB,
        num_classes=3,
        d_model=32,
        num_heads=2,
        d_ff=64,
        num_layers=1,
        max_len=SEQ,
        dropout=0.1,
        layer_config=layers,
    ).double()
    ids = torch.randint(1, VOCAB, (2, SEQ))

    def step(forward) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        out = forward(ids)
        out.sum().backward()
        return [out.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]

    eager = step(model)
    torch.compiler.reset()
    compiled = step(torch.compile(model, backend="aot_eager", fullgraph=True))
    assert len(compiled) == len(eager) > 10
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_default_compiles_what_the_masked_lm_calls(tmp_path):
    """Was: the default compiled ``model``, whose forward MaskedLM never calls (its step runs the encoder, then
    the head on the masked positions only), so a run with the callback built no graph and stayed eager."""
    from comera_lightning.lit import MaskedLM

    torch.manual_seed(0)
    task = MaskedLM(
        vocab_size=VOCAB,
        d_model=32,
        num_heads=2,
        d_ff=64,
        num_layers=1,
        max_len=SEQ,
        layer_config=LayerConfig(rank=4, embedding_rank=4, min_features=16),
    )
    ids = torch.randint(1, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    batches = DataLoader(
        [{"input_ids": i, "labels": label} for i, label in zip(ids, labels, strict=True)], batch_size=4
    )
    callback = Compile(backend="eager")
    counters.clear()
    torch.compiler.reset()
    _trainer(tmp_path, [callback], max_steps=2).fit(task, batches)
    assert callback.compiled == ["model.encoder", "model.head"]
    assert counters["frames"]["ok"] >= 2 and dict(counters["graph_break"]) == {}


def test_a_run_that_calls_no_compiled_forward_is_told(tmp_path):
    """MaskedLM's steps call ``model.encoder`` and ``model.head``, never ``model``: compiling ``model`` leaves the run
    eager, which the callback now says after the first batch (and only then, once)."""
    from comera_lightning.lit import MaskedLM

    torch.manual_seed(0)
    task = MaskedLM(
        vocab_size=VOCAB,
        d_model=32,
        num_heads=2,
        d_ff=64,
        num_layers=1,
        max_len=SEQ,
        layer_config=LayerConfig(rank=4, embedding_rank=4, min_features=16),
    )
    ids = torch.randint(1, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    batches = DataLoader(
        [{"input_ids": i, "labels": label} for i, label in zip(ids, labels, strict=True)], batch_size=4
    )
    with pytest.warns(UserWarning, match=r"without calling the forward of any compiled module \(model\)") as caught:
        _trainer(tmp_path, [Compile(modules="model", backend="eager")], max_steps=2).fit(task, batches)
    assert sum("Compile:" in str(w.message) for w in caught) == 1
