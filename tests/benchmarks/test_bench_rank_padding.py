"""bench_rank_padding: the smoke run times the three candidates, and its switch really turns the padding off."""

from __future__ import annotations

import json

import bench_rank_padding as bench

import comera_lightning.tt.contract as contract


def test_padding_off_switches_the_rule_off_and_restores_it():
    assert contract.bottleneck_padding(30, "cpu") == 2
    with bench.padding_off():
        assert contract.bottleneck_padding(30, "cpu") == 0
    assert contract.bottleneck_padding(30, "cpu") == 2


def test_quick_run_writes_all_candidates(tmp_path, capsys):
    assert bench.main(["--quick", "--threads", "1", "--max-other-load", "1.0", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "rank_padding.json").read_text())
    assert res["padding"] == 2 and set(res["results"][0]["median_s"]) == {"padded", "unpadded", "nn.Linear"}
    assert "unpadded / padded" in capsys.readouterr().out
