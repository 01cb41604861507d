"""TransformerEncoder, SequenceClassifier and MaskedLanguageModel on tiny shapes."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch
from helpers.models_reference import TINY, tiny_with
from torch import nn

from comera_lightning.models import LayerConfig, MaskedLanguageModel, SequenceClassifier, TransformerEncoder
from comera_lightning.nn import TTEmbedding, TTLinear
from comera_lightning.nn.base import TTLayer

MODELS = [TransformerEncoder, SequenceClassifier, MaskedLanguageModel]


def _kinds(model: nn.Module) -> dict[str, str]:
    """name -> tt/dense of every linear and embedding, read from the module tree itself."""
    return {
        name: "tt" if isinstance(m, TTLayer) else "dense"
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding, TTLayer))
    }


def _batch(batch=3, seq=10, vocab=TINY["vocab_size"]):
    ids = torch.randint(1, vocab, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, 6:] = 0
    mask[1, 8:] = 0
    ids[mask == 0] = 0
    types = torch.zeros(batch, seq, dtype=torch.long)
    types[:, seq // 2 :] = 1
    return ids, mask, types


# --- shapes ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tt", [True, False])
def test_output_shapes(tt):
    ids, mask, types = _batch()
    kw = tiny_with(tt_linears=tt, tt_embeddings=tt)
    assert TransformerEncoder(**kw)(ids, mask, types).shape == (3, 10, 32)
    assert SequenceClassifier(**kw, num_classes=5)(ids, mask, types).shape == (3, 5)
    assert MaskedLanguageModel(**kw)(ids, mask).shape == (3, 10, TINY["vocab_size"])
    assert TransformerEncoder(**kw)(ids).shape == (3, 10, 32)  # mask and token types optional


def test_bad_inputs_are_explained():
    enc = TransformerEncoder(**TINY)
    with pytest.raises(
        ValueError, match="exceeds max_len=16; truncate the inputs or build the model with a larger max_len"
    ):
        enc(torch.ones(1, TINY["max_len"] + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask shape \(2, 5\) must equal input_ids shape \(2, 4\)"):
        enc(torch.ones(2, 4, dtype=torch.long), torch.ones(2, 5))
    with pytest.raises(ValueError, match="d_model=32 must be divisible by num_heads=5"):
        TransformerEncoder(**dict(TINY, num_heads=5))


# --- dense / TT switch and names ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", MODELS)
def test_recorded_names_are_the_qualified_names(cls):
    model = cls(**TINY)
    assert model.layer_kinds == _kinds(model)
    for name in model.layer_kinds:
        model.get_submodule(name)  # raises if the recorded name is not a real path


def test_tiny_model_layout():
    kinds = SequenceClassifier(**TINY).layer_kinds
    assert {n for n, k in kinds.items() if k == "dense"} == {"encoder.embeddings.token_type_embeddings", "classifier"}
    assert len(kinds) == 3 + 2 * 6 + 2


@pytest.mark.parametrize("cls", MODELS)
def test_dense_layers_regex_hits_exactly_the_intended_modules(cls):
    pattern = r"layers\.1\.attention\.(query|value)$|layers\.0\.fc2$|word_embeddings|head\.decoder"
    tt_model, model = cls(**TINY), cls(**tiny_with(dense_layers=pattern))
    intended = {n for n, k in tt_model.layer_kinds.items() if k == "tt" and re.search(pattern, n)}
    assert intended  # the pattern must hit something in every model
    assert {n for n, k in _kinds(model).items() if k == "dense"} == (
        {n for n, k in tt_model.layer_kinds.items() if k == "dense"} | intended
    )
    expected = {
        "encoder.layers.1.attention.query",
        "encoder.layers.1.attention.value",
        "encoder.layers.0.fc2",
        "encoder.embeddings.word_embeddings",
    }
    if cls is TransformerEncoder:
        expected = {n.removeprefix("encoder.") for n in expected}
    if cls is MaskedLanguageModel:
        expected.add("head.decoder")
    assert intended == expected
    ids, mask, _ = _batch()
    model(ids, mask)


def test_dense_twin_has_no_tt_layer_and_the_same_layer_names():
    tt, dense = SequenceClassifier(**TINY), SequenceClassifier(**tiny_with(tt_linears=False, tt_embeddings=False))
    assert set(dense.layer_kinds) == set(tt.layer_kinds)
    assert set(dense.layer_kinds.values()) == {"dense"}
    assert not any(isinstance(m, TTLayer) for m in dense.modules())
    # same non-TT structure: LayerNorms and dense layers have the same parameter names
    assert {n for n, _ in dense.named_parameters() if "norm" in n} == {
        n for n, _ in tt.named_parameters() if "norm" in n
    }


def test_only_linears_or_only_embeddings():
    lin_only = _kinds(TransformerEncoder(**tiny_with(tt_embeddings=False)))
    emb_only = _kinds(TransformerEncoder(**tiny_with(tt_linears=False)))
    assert {n for n, k in lin_only.items() if k == "tt"} == {n for n in lin_only if "embeddings" not in n}
    assert {n for n, k in emb_only.items() if k == "tt"} == {
        "embeddings.word_embeddings",
        "embeddings.position_embeddings",
    }


# --- padding mask ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tt", [True, False])
def test_padding_mask_hides_padded_tokens(tt):
    model = SequenceClassifier(**tiny_with(tt_linears=tt, tt_embeddings=tt)).eval()
    encoder = model.encoder
    ids, mask, types = _batch()
    changed = ids.clone()
    changed[0, 7] = 42  # a padded position of sequence 0 (mask[0, 6:] == 0)
    with torch.no_grad():
        base, other = encoder(ids, mask, types), encoder(changed, mask, types)
        real = mask[0].bool()
        torch.testing.assert_close(base[0, real], other[0, real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(base[1:], other[1:])
        torch.testing.assert_close(model(ids, mask, types), model(changed, mask, types), rtol=1e-5, atol=1e-5)
        # without the mask the same change does reach the real tokens (so the check above can fail)
        unmasked = (encoder(ids, None, types) - encoder(changed, None, types))[0, real].abs().max()
        assert unmasked > 1e-3
        # and a padded position still gets an output (finite), as BERT does
        assert torch.isfinite(base).all()


def test_fully_padded_sequence_stays_finite():
    model = TransformerEncoder(**TINY).eval()
    ids, mask, _ = _batch()
    mask[2] = 0
    with torch.no_grad():
        assert torch.isfinite(model(ids, mask)).all()


# --- training: forward/backward, autocast, every parameter used ------------------------------------------------
def _loss_and_grads(model, autocast: bool):
    ids, mask, types = _batch()
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, mask, types)
        loss = out.float().square().mean()
    loss.backward()
    return out, loss


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("cls", [SequenceClassifier, MaskedLanguageModel])
def test_every_parameter_gets_a_finite_gradient(cls, autocast):
    model = cls(**tiny_with(dense_layers=r"layers\.0\.attention\.key$"))  # a dense projection among TT ones
    out, loss = _loss_and_grads(model, autocast)
    if autocast:
        assert out.dtype == torch.bfloat16
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} is unused (DDP would need find_unused_parameters)"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} got an all-zero gradient"


def test_dense_twin_trains_too():
    model = SequenceClassifier(**tiny_with(tt_linears=False, tt_embeddings=False))
    _loss_and_grads(model, autocast=True)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_few_steps_reduce_the_loss():
    model = SequenceClassifier(**dict(TINY, dropout=0.0))
    ids, mask, types = _batch()
    labels = torch.tensor([0, 1, 2])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(ids, mask, types), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# --- checkpoints and CLI-friendliness -----------------------------------------------------------------------------
def test_state_dict_round_trip_after_truncation():
    model = SequenceClassifier(**TINY).eval()
    fc1 = model.encoder.layers[0].fc1
    with torch.no_grad():
        fc1.gates[0][1:] = 0.0
    fc1.refresh_masks_()
    fc1.truncate_()
    restored = SequenceClassifier(**TINY).eval()
    restored.load_state_dict(model.state_dict())
    assert restored.encoder.layers[0].fc1.ranks == fc1.ranks != SequenceClassifier(**TINY).encoder.layers[0].fc1.ranks
    ids, mask, types = _batch()
    with torch.no_grad():
        torch.testing.assert_close(restored(ids, mask, types), model(ids, mask, types))


@pytest.mark.parametrize("cls", MODELS)
def test_constructors_take_primitives_and_the_plain_layer_config_only(cls):
    for name, param in inspect.signature(cls).parameters.items():
        if param.kind is param.VAR_KEYWORD:
            continue  # the encoder's arguments, forwarded to TransformerEncoder (checked itself)
        assert (
            param.default is inspect.Parameter.empty
            or param.default is None
            or isinstance(param.default, (bool, int, float, str))
        ), f"{cls.__name__}.{name}"
        assert re.fullmatch(r"(int|float|bool|str|LayerConfig)( \| None)?", str(param.annotation)), (
            f"{cls.__name__}.{name}: {param.annotation}"
        )
    # the config itself holds only what YAML writes
    for field in dataclasses.fields(LayerConfig):
        plain = r"(int|float|bool|str|dict\[str, int( \| list\[int\])?\])( \| None)?"
        assert re.fullmatch(plain, str(field.type)), field


# --- the paper's configuration (constructed, never run) ------------------------------------------------------------
def test_paper_modes_and_ranks():
    model = SequenceClassifier(vocab_size=30522)
    layer = model.encoder.layers[5]
    expected = {
        "query": ([12, 8, 8], [8, 8, 12], [1, 12, 30, 30, 30, 12, 1]),
        "output": ([12, 8, 8], [8, 8, 12], [1, 12, 30, 30, 30, 12, 1]),
    }
    for name, (i, o, r) in expected.items():
        proj = getattr(layer.attention, name)
        assert (proj.in_modes, proj.out_modes, proj.ranks) == (i, o, r)
    assert (layer.fc1.in_modes, layer.fc1.out_modes, layer.fc1.ranks) == (
        [12, 8, 8],
        [12, 16, 16],
        [1, 12, 30, 30, 30, 16, 1],
    )
    # docs/method.md, "Formats": fc2 is [16,16,12] x [8,8,12] with ranks [1,16,r,r,r,12,1]
    assert (layer.fc2.in_modes, layer.fc2.out_modes, layer.fc2.ranks) == (
        [16, 16, 12],
        [8, 8, 12],
        [1, 16, 30, 30, 30, 12, 1],
    )
    emb = model.encoder.embeddings.word_embeddings
    assert isinstance(emb, TTEmbedding)
    assert (emb.vocab_modes, emb.dim_modes, emb.ranks) == ([16, 20, 10, 10], [4, 4, 8, 6], [1, 32, 32, 32, 1])
    assert isinstance(model.pooler, TTLinear) and type(model.classifier) is nn.Linear
    # other sizes fall back to automatic modes
    small = TransformerEncoder(vocab_size=1000, d_model=256, num_heads=4, d_ff=1024, num_layers=1)
    assert small.layers[0].fc1.in_modes != [12, 8, 8]


@pytest.mark.parametrize("packed_dropout", [False, True])
@pytest.mark.parametrize("cls", [SequenceClassifier, MaskedLanguageModel])
def test_activation_checkpointing_gives_the_same_loss_and_gradients_in_float64(cls, packed_dropout):
    torch.manual_seed(0)
    plain = (
        cls(**TINY, packed_dropout=packed_dropout).double().train()
    )  # dropout 0.1: the recomputed masks must be the same
    checkpointed = cls(**TINY, activation_checkpointing=True, packed_dropout=packed_dropout).double().train()
    checkpointed.load_state_dict(plain.state_dict())
    ids, mask, types = _batch()
    results = []
    for model in (plain, checkpointed):
        torch.manual_seed(1)
        loss = model(ids, mask, types).square().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-12, atol=1e-12, msg=name)
