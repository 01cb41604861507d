"""The shared benchmark machinery: memory is what the tensors hold, timing keeps every candidate, run.py wiring."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

from benchmarks import harness
from benchmarks import run as bench_run


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _adamw_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor):
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()

    return step


def test_peak_memory_matches_hand_count_of_parameters_gradients_and_adamw_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 100))
    optimizer = torch.optim.AdamW(model.parameters())
    step = _adamw_step(model, optimizer, torch.randn(8, 300))
    step()
    mem = harness.peak_memory(step, [model], [optimizer])
    params = _param_bytes(model)
    assert mem["parameters"] == params
    assert mem["gradients"] == params
    # exp_avg + exp_avg_sq per parameter, plus one 4-byte step counter per parameter tensor
    assert mem["optimizer_state_persistent"] == 2 * params + 4 * len(list(model.parameters()))
    assert mem["optimizer_state"] >= mem["optimizer_state_persistent"]
    parts = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries", "other")
    assert mem["total"] == sum(mem[k] for k in parts)


def test_peak_memory_sees_activations_when_they_dominate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 16))
    x = torch.randn(2048, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = _adamw_step(model, optimizer, x)
    step()
    mem = harness.peak_memory(step, [model], [optimizer])
    hidden = 2048 * 4096 * 4  # one (rows x 4096) float32 activation
    assert mem["activations"] + mem["temporaries"] >= hidden
    assert mem["total"] > _param_bytes(model) + hidden


def test_interleave_keeps_every_candidate_and_orders_rounds_randomly():
    calls = {"a": 0, "b": 0}

    def make(name: str, size: int):
        def step() -> None:
            calls[name] += 1
            torch.randn(size, size) @ torch.randn(size, size)

        return step

    timing = harness.interleave(
        {"a": make("a", 8), "b": make("b", 200)}, repeats=3, min_sample_s=0.001, max_other_load=1.0, seed=1
    )
    assert set(timing.samples) == {"a", "b"}
    assert all(len(v) >= 3 for v in timing.samples.values())
    assert calls["a"] > 3 and calls["b"] > 3
    assert timing.ratio("b", "a") == pytest.approx(timing.median("b") / timing.median("a"))
    summary = timing.summary()
    json.dumps(summary)
    assert summary["rounds_clean"] == summary["rounds_total"]
    assert {tuple(r["order"]) for r in timing.rounds} <= {("a", "b"), ("b", "a")}


def test_interleave_rejects_zero_repeats():
    with pytest.raises(ValueError, match="repeats"):
        harness.interleave({"a": lambda: None}, repeats=0)


def test_table_is_markdown():
    text = harness.table(["x", "y"], [[1, "2.00x"]])
    assert text.splitlines() == ["| x | y |", "|---|---|", "| 1 | 2.00x |"]


def test_run_lists_every_comparison_and_its_script_exists(capsys):
    assert bench_run.main(["--list"]) == 0
    printed = capsys.readouterr().out
    for name, comparison in bench_run.COMPARISONS.items():
        assert name in printed
        assert importlib.util.find_spec(f"benchmarks.{comparison.script}") is not None, comparison.script


def test_run_all_refuses_per_script_arguments():
    with pytest.raises(SystemExit):
        bench_run.main(["all", "--batch", "1"])


def test_keep_freed_memory_without_glibc_is_a_clear_exit(monkeypatch):
    from comera_lightning.callbacks import host_memory

    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    with pytest.raises(SystemExit, match="needs glibc's malloc"):
        harness.keep_freed_memory_for_run()


def test_cuda_profile_leaves_the_final_device_drain_out_of_the_host_ops(monkeypatch):
    """On CUDA the profile window ends with cudaDeviceSynchronize (profile_ops' own and torch's profiler's on
    exit): waiting for the GPU, not host work of the step. Faked here: a CUDA profile's key averages."""
    from types import SimpleNamespace

    import torch.profiler

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(key, device, cpu_us, device_us=0.0):
        return SimpleNamespace(
            key=key,
            device_type=device,
            self_cpu_time_total=cpu_us,
            count=2,
            self_device_time_total=device_us,
            is_user_annotation=False,
        )

    averages = [
        event("aten::mm", cpu, 300.0, 500.0),
        event("cudaLaunchKernel", cpu, 100.0),
        event("cudaDeviceSynchronize", cpu, 5000.0),
        event("gemm_kernel", cuda, 0.0, 500.0),
    ]

    class FakeProfile:
        def __init__(self, activities):
            assert torch.profiler.ProfilerActivity.CUDA in activities

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return averages

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    out = harness.profile_ops(lambda: None, iterations=2)
    assert out["ops_s"] == pytest.approx({"aten::mm": 150e-6, "cudaLaunchKernel": 50e-6})
    assert out["total_self_cpu_s"] == pytest.approx(200e-6)
    assert [t["op"] for t in out["top"]] == ["aten::mm", "cudaLaunchKernel"]
    assert out["device_drain_wait_s"] == pytest.approx(2500e-6)
    assert out["total_self_device_s"] == pytest.approx(250e-6)
    assert out["top"][0]["self_device_s"] == pytest.approx(250e-6)
