"""bench_activation_memory: the smoke run reports four candidates, and checkpointing keeps fewer activations."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_activation_memory as bench


@pytest.mark.slow
def test_quick_run_measures_less_activation_memory_with_checkpointing(tmp_path, capsys):
    assert bench.main(["--quick", "--threads", "1", "--max-other-load", "1.0", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "activation_memory.json").read_text())
    names = {bench.DENSE, bench.COMERA, bench.DENSE + bench.CHECKPOINTED, bench.COMERA + bench.CHECKPOINTED}
    assert set(res["memory"]) == set(res["step_s"]) == names
    for plain in (bench.DENSE, bench.COMERA):
        kept, checkpointed = res["memory"][plain], res["memory"][plain + bench.CHECKPOINTED]
        assert checkpointed["total"] < kept["total"]
    assert "step / plain twin" in capsys.readouterr().out
