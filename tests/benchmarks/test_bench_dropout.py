"""bench_dropout: the smoke run times both dropouts at both sites."""

from __future__ import annotations

import json

import bench_dropout as bench
import torch


def test_quick_run_writes_both_sites(tmp_path, capsys):
    assert bench.main(["--quick", "--threads", "1", "--max-other-load", "1.0", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "dropout.json").read_text())
    assert [r["site"].split()[0] for r in res["results"]] == ["hidden", "attention"]
    assert set(res["results"][1]["median_s"]) == {"torch", "packed", "no dropout"}
    assert "torch / packed" in capsys.readouterr().out
    assert [m["shape"][1:] for m in res["masking"]] == [[12, 16, 16], [16, 768]]
    assert all(set(m["median_s"]) == {"where", "mul"} for m in res["masking"])


def test_both_masking_ops_give_the_same_values():
    ops = bench.masking_candidates((3, 5, 7), 0.3)
    assert torch.equal(ops["where"](), ops["mul"]())
