"""DecoderLM: its pieces against float64 references, causality, TT/dense equivalence, names and tying."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from comera_lightning.models import DecoderLM
from comera_lightning.models.decoder import RMSNorm, apply_rotary, rotary_tables
from comera_lightning.nn import TTEmbedding, TTLinear, tt_layers
from comera_lightning.nn.base import TTLayer

LAYERS = dict(rank=4, embedding_rank=4, min_features=16)
TINY_DECODER = dict(vocab_size=97, d_model=32, num_heads=4, d_ff=48, num_layers=2, max_len=16, layer_config=LAYERS)
DENSE = dict(LAYERS, tt_linears=False, tt_embeddings=False)


def _kinds(model: nn.Module) -> dict[str, str]:
    return {
        name: "tt" if isinstance(m, TTLayer) else "dense"
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding, TTLayer))
    }


# --- pieces against float64 references ----------------------------------------------------------------------
def test_rmsnorm_matches_reference_float64():
    norm = RMSNorm(8, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8, dtype=torch.float64))
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    reference = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 8 + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), reference, rtol=1e-12, atol=1e-12)
    assert norm(x.float()).dtype == torch.float32 and norm(x.bfloat16()).dtype == torch.bfloat16


def test_rotary_matches_pairwise_rotation_float64():
    head_dim, seq_len, theta = 8, 6, 100.0
    x = torch.randn(2, 3, seq_len, head_dim, dtype=torch.float64)
    cos, sin = rotary_tables(seq_len, head_dim, theta, dtype=torch.float64)
    out = apply_rotary(x, cos, sin)
    reference = torch.empty_like(x)
    half = head_dim // 2
    for pos in range(seq_len):
        for i in range(half):  # channels i and i + half rotate together by pos * theta^(-2i/d)
            angle = pos * theta ** (-2 * i / head_dim)
            a, b = x[..., pos, i], x[..., pos, i + half]
            reference[..., pos, i] = a * math.cos(angle) - b * math.sin(angle)
            reference[..., pos, i + half] = a * math.sin(angle) + b * math.cos(angle)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation


def test_rotary_scores_depend_only_on_relative_position():
    head_dim = 16
    q, k = torch.randn(head_dim, dtype=torch.float64), torch.randn(head_dim, dtype=torch.float64)
    cos, sin = rotary_tables(20, head_dim, dtype=torch.float64)

    def score(m: int, n: int) -> torch.Tensor:
        return apply_rotary(q, cos[m], sin[m]) @ apply_rotary(k, cos[n], sin[n])

    torch.testing.assert_close(score(7, 3), score(14, 10))
    torch.testing.assert_close(score(2, 2), q @ k)
    offset_cos, offset_sin = rotary_tables(4, head_dim, offset=5, dtype=torch.float64)
    torch.testing.assert_close(offset_cos, cos[5:9])
    torch.testing.assert_close(offset_sin, sin[5:9])


def test_attention_block_matches_explicit_causal_softmax_float64():
    model = DecoderLM(**dict(TINY_DECODER, layer_config=DENSE, num_layers=1)).double()
    attention = model.layers[0].attention
    batch, seq_len, heads, head_dim = 2, 7, 4, 8
    x = torch.randn(batch, seq_len, 32, dtype=torch.float64)
    cos, sin = rotary_tables(seq_len, head_dim, dtype=torch.float64)

    def split(t):
        return t.reshape(batch, seq_len, heads, head_dim).transpose(1, 2)

    q = apply_rotary(split(x @ attention.q_proj.weight.T), cos, sin)
    k = apply_rotary(split(x @ attention.k_proj.weight.T), cos, sin)
    v = split(x @ attention.v_proj.weight.T)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    future = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    reference = (weights @ v).transpose(1, 2).reshape(batch, seq_len, 32) @ attention.o_proj.weight.T
    torch.testing.assert_close(attention(x, cos, sin), reference, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("tt", [True, False])
def test_future_tokens_never_change_past_logits(tt):
    model = DecoderLM(**dict(TINY_DECODER, layer_config=dict(LAYERS, tt_linears=tt, tt_embeddings=tt))).double().eval()
    ids = torch.randint(0, 97, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = torch.randint(0, 97, (2, 4))
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_swiglu_mlp_matches_reference():
    model = DecoderLM(**dict(TINY_DECODER, layer_config=DENSE, num_layers=1)).double()
    mlp = model.layers[0].mlp
    x = torch.randn(3, 32, dtype=torch.float64)
    reference = (F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), reference)


# --- TT vs dense: the same code --------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_tt_model_equals_dense_model_with_its_reconstructed_weights(tie):
    torch.manual_seed(0)
    tt = DecoderLM(**dict(TINY_DECODER, tie_embeddings=tie)).double()
    dense = DecoderLM(**dict(TINY_DECODER, tie_embeddings=tie, layer_config=DENSE)).double()
    dense_params = dict(dense.named_modules())
    with torch.no_grad():
        for name, module in tt.named_modules():
            if isinstance(module, (TTLinear, TTEmbedding)):
                dense_params[name].weight.copy_(module.weight_dense())
            elif isinstance(module, RMSNorm):
                dense_params[name].weight.copy_(module.weight)
    assert tt.layer_kinds.keys() == dense.layer_kinds.keys()
    ids = torch.randint(0, 97, (2, 9))
    torch.testing.assert_close(tt(ids), dense(ids), rtol=1e-9, atol=1e-9)


def test_layer_names_kinds_and_dense_layers():
    model = DecoderLM(**dict(TINY_DECODER, layer_config=dict(LAYERS, dense_layers=r"lm_head|mlp\.down_proj")))
    kinds = _kinds(model)
    assert kinds == model.layer_kinds
    assert kinds["embed_tokens"] == "tt" and kinds["lm_head"] == "dense"
    assert kinds["layers.1.attention.q_proj"] == "tt" and kinds["layers.0.mlp.down_proj"] == "dense"
    assert set(kinds) == {"embed_tokens", "lm_head"} | {
        f"layers.{i}.{part}"
        for i in range(2)
        for part in (
            "attention.q_proj",
            "attention.k_proj",
            "attention.v_proj",
            "attention.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert all(getattr(m, "bias", None) is None for m in model.modules() if isinstance(m, (nn.Linear, TTLinear)))
    dense = DecoderLM(**dict(TINY_DECODER, layer_config=DENSE))
    assert set(dense.layer_kinds.values()) == {"dense"} and dense.layer_kinds.keys() == kinds.keys()


@pytest.mark.parametrize("tt", [True, False])
def test_tied_embeddings_share_the_table_and_get_gradients(tt):
    model = DecoderLM(
        **dict(TINY_DECODER, tie_embeddings=True, layer_config=dict(LAYERS, tt_linears=tt, tt_embeddings=tt))
    )
    assert model.lm_head is None and "lm_head" not in model.layer_kinds
    ids = torch.randint(0, 97, (2, 5))
    logits = model(ids)
    assert logits.shape == (2, 5, 97)
    assert logits.std() < 5  # the table's init keeps first logits of order one
    logits.sum().backward()
    params = list(model.embed_tokens.parameters())
    assert params and all(p.grad is not None for p in params if p.requires_grad)


def test_shapes_longer_than_max_len_and_bad_inputs():
    model = DecoderLM(**TINY_DECODER)
    assert model(torch.randint(0, 97, (3, 16))).shape == (3, 16, 97)
    assert model(torch.randint(0, 97, (1, 20))).shape == (1, 20, 97)  # rotary tables extend on the fly
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq_len\), got shape \(5,\)"):
        model(torch.randint(0, 97, (5,)))
    with pytest.raises(ValueError, match="d_model=32 must be divisible by num_heads=5"):
        DecoderLM(**dict(TINY_DECODER, num_heads=5))
    with pytest.raises(ValueError, match=r"head dimension d_model / num_heads = 3 must be even"):
        DecoderLM(**dict(TINY_DECODER, d_model=36, num_heads=12))


def test_bf16_autocast_forward_and_backward():
    torch.manual_seed(0)
    model = DecoderLM(**TINY_DECODER)
    ids = torch.randint(0, 97, (2, 8))
    params = [p for p in model.parameters() if p.requires_grad]
    logits32 = model(ids)
    grads32 = torch.autograd.grad(F.cross_entropy(logits32.flatten(0, 1), ids.flatten()), params)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    assert (logits.float() - logits32).abs().max() <= 5e-2 * logits32.abs().max()
    grads = torch.autograd.grad(F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()), params)
    # the backward reaches every parameter, in its own fp32, close to the fp32 gradient
    for (name, param), g16, g32 in zip(
        ((n, p) for n, p in model.named_parameters() if p.requires_grad), grads, grads32, strict=True
    ):
        assert g16.dtype == param.dtype == torch.float32 and torch.isfinite(g16).all(), name
        assert (g16 - g32).norm() <= 0.1 * g32.norm() + 1e-6, name


@pytest.mark.parametrize("packed_dropout", [False, True])
def test_activation_checkpointing_gives_the_same_gradients_in_float64(packed_dropout):
    torch.manual_seed(0)
    options = dict(TINY_DECODER, dropout=0.1, packed_dropout=packed_dropout)
    plain = DecoderLM(**options).double().train()
    checkpointed = DecoderLM(**options, activation_checkpointing=True).double().train()
    checkpointed.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 97, (3, 12))
    grads = []
    for model in (plain, checkpointed):
        torch.manual_seed(1)
        model(ids).logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-12, atol=1e-12, msg=name)


# --- the context window and the key/value cache ---------------------------------------------------------------
def test_past_max_len_each_position_sees_the_window_of_max_len_tokens_float64():
    # one layer: the logits at position t are those of the window ids[t - max_len + 1 .. t] run alone, since
    # rotary scores depend only on relative positions (to the float32 precision of the rotary tables; attending
    # to one token more or less would change the logits by order one)
    model = DecoderLM(**dict(TINY_DECODER, num_layers=1)).double().eval()
    ids = torch.randint(0, 97, (2, 40))
    full = model(ids)
    for t in (15, 16, 27, 39):
        window = ids[:, max(0, t - 15) : t + 1]
        torch.testing.assert_close(full[:, t], model(window)[:, -1], rtol=1e-6, atol=1e-7)


def _truncated_tt_decoder() -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(**TINY_DECODER).double().eval()
    for _, layer in tt_layers(model):
        layer.truncate_to_share_(0.5)
    assert all(max(layer.ranks[1:-1]) <= 2 for _, layer in tt_layers(model))
    return model


@pytest.mark.parametrize("prompt_len", [5, 16, 23])
@pytest.mark.parametrize("chunk", [1, 3])
def test_cached_decoding_gives_the_logits_of_the_full_sequence_float64(prompt_len, chunk):
    # prompts shorter than, equal to and longer than max_len (16); TT layers at truncated ranks
    model = _truncated_tt_decoder()
    ids = torch.randint(0, 97, (2, prompt_len + 21))
    reference = model(ids)
    cache = model.new_cache()
    pieces = [model.head(model.hidden_states(ids[:, :prompt_len], cache))]
    for start in range(prompt_len, ids.shape[1], chunk):
        pieces.append(model.head(model.hidden_states(ids[:, start : start + chunk], cache)))
    torch.testing.assert_close(torch.cat(pieces, dim=1), reference, rtol=1e-10, atol=1e-10)
    assert cache.seen == ids.shape[1]
    assert cache.cached == 15 and len(cache.keys) == 2  # bounded: the last max_len - 1 positions per layer


def test_a_cache_belongs_to_one_batch():
    model = DecoderLM(**TINY_DECODER).eval()
    cache = model.new_cache()
    model.hidden_states(torch.randint(0, 97, (2, 4)), cache)
    with pytest.raises(
        ValueError,
        match=r"cache holds a batch of 2 sequences but input_ids has 3: use one cache per batch \(model.new_cache",
    ):
        model.hidden_states(torch.randint(0, 97, (3, 1)), cache)


# --- the TT layers' inference cache in generation ------------------------------------------------------------
def _generation_task(tie: bool):
    from comera_lightning.lit import CausalLM

    torch.manual_seed(0)
    config = dict(LAYERS, low_rank_linears=None if tie else "lm_head")  # the benchmark's low-rank head
    task = CausalLM(**dict(TINY_DECODER, layer_config=config, tie_embeddings=tie)).double()
    for _, layer in tt_layers(task.model):
        with torch.no_grad():
            for gate in layer.gates:
                gate.uniform_(0.5, 1.5)
    # eval before generate: it restores the mode it found, so the caches it filled stay to be checked
    return task.eval()


def _set_inference_cache(model: nn.Module, enabled: bool) -> None:
    for _, layer in tt_layers(model):
        layer.inference_cache = enabled


@pytest.mark.parametrize("tie", [False, True])
def test_greedy_generation_with_the_inference_cache_gives_the_same_tokens_float64(tie):
    task = _generation_task(tie)
    prompt = torch.randint(0, 97, (2, 5))
    _set_inference_cache(task.model, False)
    uncached = task.generate(prompt, 24, temperature=0.0, use_cache=True)  # past max_len: the sliding window too
    rerun = task.generate(prompt, 24, temperature=0.0, use_cache=False)
    assert all(layer._inference_entry is None for _, layer in tt_layers(task.model))
    _set_inference_cache(task.model, True)
    cached = task.generate(prompt, 24, temperature=0.0, use_cache=True)
    assert torch.equal(cached, uncached) and torch.equal(cached, rerun)
    assert all(layer._inference_entry is not None for _, layer in tt_layers(task.model))  # they were used
    with torch.no_grad():
        served = task.model(cached)
    torch.testing.assert_close(served, task.model(cached), rtol=1e-10, atol=1e-10)  # vs autograd on: uncached


@pytest.mark.parametrize("switch_to_train", [True, False])
def test_generation_after_an_optimizer_step_uses_the_new_weights_float64(switch_to_train):
    # with and without train() in between (a loop may train in eval mode); fused AdamW does not bump versions
    task = _generation_task(tie=False)
    ids = torch.randint(0, 97, (2, 12))
    task.generate(ids[:, :4], 6, temperature=0.0)
    with torch.no_grad():
        before = task.model(ids)
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=0.05, fused=True)
    task.model.train(switch_to_train)
    F.cross_entropy(task.model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    with torch.no_grad():
        task.model.eval()(ids)  # an eval forward without grad between backward and step refills the caches
    optimizer.step()
    with torch.no_grad():
        after = task.model(ids)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, task.model(ids), rtol=1e-10, atol=1e-10)  # vs autograd on: uncached
    cached = task.generate(ids[:, :4], 12, temperature=0.0)
    _set_inference_cache(task.model, False)
    assert torch.equal(cached, task.generate(ids[:, :4], 12, temperature=0.0))
