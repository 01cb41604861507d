"""bench_compiled: the smoke run compiles dense and CoMERA whole (no graph break), reports the four steps and
explains a missed target with a profile."""

from __future__ import annotations

import json

from benchmarks import bench_compiled as bench


def test_quick_run_compiles_both_models_whole_and_writes_the_ratios(tmp_path, capsys):
    # backend "eager": dynamo traces the whole model (what graph breaks depend on) without a compiler behind it
    args = ["--quick", "--backend", "eager", "--repeats", "1", "--threads", "1", "--max-other-load", "1.0"]
    bench.main([*args, "--out-dir", str(tmp_path)])
    res = json.loads((tmp_path / "compiled_step_quick.json").read_text())
    assert set(res["median_s"]) == {"dense", "dense compiled", "CoMERA", "CoMERA compiled"}
    for name in ("dense compiled", "CoMERA compiled"):
        info = res["info"][name]
        assert info["graph_breaks"] == 0 and info["frames"]["ok"] == info["frames"]["total"] >= 1, name
    assert res["speedup_compiled"] > 0
    # the quick model misses the 6x target, so the compiled steps are profiled and the miss explained
    assert res["speedup_compiled"] < bench.TARGET
    assert res["profile"]["comera"]["top"] and res["profile"]["other"]["top"]
    out = capsys.readouterr().out
    assert "CoMERA compiled is" in out and "why (profile of the compiled steps)" in out
