"""bench_host_memory: the smoke run measures both settings for both candidates and leaves glibc's defaults."""

from __future__ import annotations

import json
import platform

import bench_host_memory as bench
import pytest


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_quick_run_measures_both_settings(tmp_path, capsys, monkeypatch):
    settings = []
    real = bench.keep_freed_memory
    monkeypatch.setattr(bench, "keep_freed_memory", lambda enabled=True: settings.append(enabled) or real(enabled))
    assert bench.main(["--quick", "--threads", "1", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "host_memory.json").read_text())
    assert set(res["medians"]) == {"dense+AdamW", "CoMERA r30"}
    assert all(set(m) == set(bench.MODES) for m in res["medians"].values())
    assert settings[0] is False and settings[-1] is False and True in settings
    assert "dense / CoMERA step" in capsys.readouterr().out
