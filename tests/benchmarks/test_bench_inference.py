"""bench_inference: the smoke run decodes with and without the cache and times the three forward executions."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_inference as bench


def test_quick_run_writes_both_parts(tmp_path, capsys):
    bench.main(["--quick", "--threads", "1", "--max-other-load", "1.0", "--out-dir", str(tmp_path)])
    res = json.loads((tmp_path / "inference_quick.json").read_text())
    decode = res["decode"]["d64 b1"]
    assert decode["cache_equals_rerun"] and decode["compression"] >= 10
    assert set(decode["tokens_per_s"]) == {
        "comera cache",
        "comera cache, checked per call",
        "comera no cache",
        "dense cache",
        "dense no cache",
    }
    assert decode["peak_bytes"]["comera cache"] < decode["peak_bytes"]["dense cache"]  # 10x fewer parameters
    forward = res["forward"]["classifier b1"]
    assert set(forward["latency_s"]) == {"comera TT", "comera untensorised", "dense"}
    out = capsys.readouterr().out
    assert "cache vs none (CoMERA)" in out and "untensorised vs dense" in out


def test_peak_bytes_counts_what_a_step_keeps_alive():
    model = torch.nn.Linear(8, 8)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())

    def step():
        kept = [torch.ones(1024) for _ in range(3)]  # 3 x 4 KiB alive at once
        return sum(t.sum() for t in kept)

    assert bench.peak_bytes(step, model) - resident == pytest.approx(3 * 4096, abs=64)
