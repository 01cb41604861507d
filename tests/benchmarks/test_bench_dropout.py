"""bench_dropout: the smoke run times both dropouts at both sites."""

from __future__ import annotations

import json

import bench_dropout as bench


def test_quick_run_writes_both_sites(tmp_path, capsys):
    assert bench.main(["--quick", "--threads", "1", "--max-other-load", "1.0", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "dropout.json").read_text())
    assert [r["site"].split()[0] for r in res["results"]] == ["hidden", "attention"]
    assert set(res["results"][1]["median_s"]) == {"torch", "packed", "no dropout"}
    assert "torch / packed" in capsys.readouterr().out
