"""bench_gemm_layouts: every layout of a product computes the same matrix, and the smoke run writes the sums."""

from __future__ import annotations

import json

import bench_gemm_layouts as bench
import torch


def test_the_layouts_of_each_product_agree():
    table, dense = bench.products(rows=64, features=48, rank=8)
    assert len(table) == 6 and dense().shape == (64, 48)
    for product, layouts in table.items():
        results = [step() for step in layouts.values()]
        assert len(results) == 2, product
        torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-4, msg=product)


def test_quick_run_writes_the_gemm_sums(tmp_path, capsys):
    bench.main(["--quick", "--threads", "1", "--max-other-load", "1.0", "--out-dir", str(tmp_path)])
    res = json.loads((tmp_path / "gemm_layouts_quick.json").read_text())
    assert 0 < res["tt_gemms_best_s"] <= res["tt_gemms_s"]
    assert "on the GEMMs alone" in capsys.readouterr().out
