"""While a CUDA graph is captured, the project's layers and tasks avoid host syncs and dynamic shapes.

No GPU here: ``capturing_graph`` is patched to report a capture; what a capture forbids (boolean-mask
selection, torch.unique, .tolist()) is made to raise, so the captured path is proven free of them and to
compute the same loss and gradients as the eager path.
"""

from __future__ import annotations

import pytest
import torch
from helpers.nn_reference import reference_linear_weight

from comera_lightning.lit import checks as checks_module
from comera_lightning.lit import mlm as mlm_module
from comera_lightning.lit.mlm import IGNORE, MaskedLM
from comera_lightning.nn import TTEmbedding, TTLinear
from comera_lightning.nn import base as base_module
from comera_lightning.nn import embedding as embedding_module
from comera_lightning.nn.base import capturing_graph
from comera_lightning.tt import ttm as ttm_module


@pytest.fixture
def capturing(monkeypatch):
    for module in (mlm_module, checks_module):
        monkeypatch.setattr(module, "capturing_graph", lambda: True)
    monkeypatch.setattr(embedding_module, "capturing_graph", lambda: True)  # torch.compile tracing or a capture

    def no_unique(*args, **kwargs):
        raise AssertionError("torch.unique (a dynamic shape) ran during capture")

    monkeypatch.setattr(ttm_module.torch, "unique", no_unique)


def _mlm_batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 12), generator=g)
    labels = torch.full_like(ids, IGNORE)
    chosen = torch.rand(ids.shape, generator=g) < 0.3
    chosen[0, 0] = True
    labels[chosen] = ids[chosen]
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def _task() -> MaskedLM:
    torch.manual_seed(0)
    return MaskedLM(
        vocab_size=256,
        d_model=32,
        num_heads=2,
        d_ff=64,
        num_layers=1,
        max_len=12,
        dropout=0.0,
        layer_config=dict(rank=4, embedding_rank=4, min_features=16),
    ).double()


def _loss_and_grads(task: MaskedLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    task.zero_grad(set_to_none=True)
    loss, _, _ = task._loss(batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in task.parameters() if p.grad is not None]


def test_not_capturing_on_cpu():
    assert capturing_graph() is False


@pytest.mark.parametrize("recorder", ["cuda_graph", "torch_compile"])
def test_either_recorder_alone_keeps_layers_off_the_inference_cache(recorder, monkeypatch):
    if recorder == "cuda_graph":  # a CUDA graph captured eagerly, with no torch.compile around it
        monkeypatch.setattr(base_module, "cuda_graph_capturing", lambda: True)
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert capturing_graph() is True
    torch.manual_seed(0)
    layer = TTLinear(24, 12, 4, in_modes=[2, 3, 4], out_modes=[3, 4], dtype=torch.float64).eval()
    x = torch.randn(3, 24, dtype=torch.float64)
    with torch.no_grad():
        y = layer(x)
    assert layer._inference_entry is None  # a recorded graph neither reads nor fills the cache
    torch.testing.assert_close(y, x @ reference_linear_weight(layer).T + layer.bias, rtol=1e-12, atol=1e-12)


def test_masked_lm_loss_under_capture_equals_eager_loss_and_gradients(capturing, monkeypatch):
    task = _task()
    batch = _mlm_batch(256)
    with monkeypatch.context() as patch:
        patch.setattr(mlm_module, "check_id_ranges", lambda *a: pytest.fail("host-side id check during capture"))
        _, logits, _ = task._loss(batch)
        assert logits.shape == (3 * 12, 256)  # every position decoded: a static shape, no boolean-mask selection
        captured_loss, captured_grads = _loss_and_grads(task, batch)
    monkeypatch.setattr(mlm_module, "capturing_graph", lambda: False)
    eager_loss, eager_grads = _loss_and_grads(task, batch)
    torch.testing.assert_close(captured_loss, eager_loss, rtol=1e-12, atol=1e-12)
    assert len(captured_grads) == len(eager_grads)
    for a, b in zip(captured_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_id_checks_are_skipped_under_capture_and_enforced_otherwise(capturing, monkeypatch):
    ids = torch.tensor([0, 999])
    checks_module.check_id_ranges([("ids", ids, 10, "fix it")])  # a capture cannot sync: skipped
    monkeypatch.setattr(checks_module, "capturing_graph", lambda: False)
    with pytest.raises(IndexError, match="fix it"):
        checks_module.check_id_ranges([("ids", ids, 10, "fix it")])


def test_tt_embedding_skips_dedup_under_capture_with_identical_rows(capturing, monkeypatch):
    torch.manual_seed(0)
    layer = TTEmbedding(100, 16, rank=4, deduplicate=True).double()
    ids = torch.tensor([[3, 3, 7], [99, 3, 0]])
    captured = layer(ids)
    monkeypatch.setattr(embedding_module, "capturing_graph", lambda: False)
    monkeypatch.undo()  # torch.unique back: the eager path deduplicates
    eager = layer(ids)
    torch.testing.assert_close(captured, eager, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(eager, layer.weight_dense()[ids], rtol=1e-10, atol=1e-12)
