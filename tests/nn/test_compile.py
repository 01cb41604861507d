"""torch.compile: TTLinear and TTEmbedding trace without graph breaks (with and without the
ContractionPlanner's plans) and the compiled forward and backward equal eager in float64."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from helpers.nn_reference import F64, randomize_gates_
from torch import nn

from comera_lightning.nn import TTEmbedding, TTLinear
from comera_lightning.tt import PLANS


def _layers(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A layer (or an embedding feeding a linear) in float64 and an input batch for it."""
    embedding = randomize_gates_(TTEmbedding(100, 12, rank=4, padding_idx=0, deduplicate=True)).to(F64)
    linear = randomize_gates_(TTLinear(37, 20, rank=3, in_modes=[5, 8], out_modes=[3, 7])).to(F64)  # padded
    ids = torch.tensor([[3, 0, 99], [3, 7, 3]])
    if kind == "linear":
        return linear, torch.randn(2, 3, 37, dtype=F64, requires_grad=True)
    if kind == "embedding":
        return embedding, ids
    return nn.Sequential(embedding, TTLinear(12, 20, rank=3).to(F64)), ids


def _breaks(module: nn.Module, x: torch.Tensor) -> int:
    dynamo.reset()
    return dynamo.explain(module)(x).graph_break_count


@pytest.mark.parametrize("kind", ["linear", "embedding", "both"])
def test_no_graph_breaks_without_and_with_planned_contractions(kind):
    from comera_lightning.callbacks import ContractionPlanner

    module, x = _layers(kind)
    assert _breaks(module, x) == 0  # no plan: chosen per call by the cost model, at trace time
    planner = ContractionPlanner(verbose=False)
    planner.on_train_batch_start(None, module, None, 0)  # hooks the linears to record their rows
    assert _breaks(module, x) == 0
    planner.on_train_batch_end(None, module, None, None, 0)  # plans eagerly, sets them on the layers
    linears = [m for m in module.modules() if isinstance(m, TTLinear)]
    assert len(planner.plans) == len(linears) and all(m.contraction_plan for m in linears)
    assert _breaks(module, x) == 0


def _forward_backward(module: nn.Module, x: torch.Tensor, fn=None) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    if x.requires_grad:
        x.grad = None
    y = (module if fn is None else fn)(x)
    (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum().backward()
    grads = [p.grad for p in module.parameters()] + ([x.grad] if x.requires_grad else [])
    return [y.detach(), *grads]


@pytest.mark.parametrize("kind, plan", [*[("linear", plan) for plan in (None, *PLANS)], ("both", None)])
def test_compiled_forward_backward_equals_eager(kind, plan):
    # aot_eager traces the backward too (TTLinearFunction's custom backward); inductor's C++ build takes minutes here
    module, x = _layers(kind)
    for layer in module.modules():
        if isinstance(layer, TTLinear):
            layer.set_contraction_plan(plan)
    dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    for got, want in zip(_forward_backward(module, x, compiled), _forward_backward(module, x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_compiled_embedding_skips_host_checks_and_dedup():
    module, ids = _layers("embedding")
    dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)  # fullgraph: no .min()/unique break
    for got, want in zip(_forward_backward(module, ids, compiled), _forward_backward(module, ids), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.all(compiled(ids)[ids == 0] == 0)  # the padding row


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("plan", [None, *PLANS])
def test_a_two_core_train_compiles_whole_without_grad(no_grad, plan):
    # one input and one output core (a low-rank head): torch.compile could not trace TTLinearFunction for it
    # without grad (a validation batch of a compiled model fell back to eager)
    layer = TTLinear(24, 40, rank=5, in_modes=[24], out_modes=[40]).to(F64).eval()
    layer.set_contraction_plan(plan)
    x = torch.randn(6, 24, dtype=F64)
    dynamo.reset()
    with no_grad():
        got = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
        torch.testing.assert_close(got, x @ layer.weight_dense().T, rtol=1e-12, atol=1e-12)
