"""bench_truncation: the smoke run cuts the copy to the kept share and times both steps."""

from __future__ import annotations

import json

import bench_truncation as bench


def test_quick_run_cuts_the_copy_and_times_both(tmp_path, capsys):
    assert (
        bench.main(
            ["--quick", "--keep", "0.5", "--threads", "1", "--max-other-load", "1.0", "--out-dir", str(tmp_path)]
        )
        == 0
    )
    res = json.loads((tmp_path / "truncation.json").read_text())
    for before, after in zip(res["ranks_before"], res["ranks_after"], strict=True):  # every bond cut to about half
        assert all(0.4 * b <= a <= 0.6 * b for b, a in zip(before[1:-1], after[1:-1], strict=True)), (before, after)
    assert 0.2 < res["parameter_ratio"] < 0.5
    assert res["step_seconds_before"] > 0 and res["step_seconds_after"] > 0
    assert "step time after/before" in capsys.readouterr().out
