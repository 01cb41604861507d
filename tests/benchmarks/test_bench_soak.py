"""bench_soak: a short soak samples memory in a fresh process per mode and reports the growth against the target."""

from __future__ import annotations

import json

from benchmarks import bench_soak as bench


def test_a_short_soak_samples_every_mode_and_reports_the_slope(tmp_path, capsys):
    bench.main(
        [
            "--quick",
            "--steps",
            "60",
            "--sample-every",
            "20",
            "--warmup",
            "20",
            "--modes",
            "off",
            "truncate+ckpt",
            "--out-dir",
            str(tmp_path),
        ]
    )
    res = json.loads((tmp_path / "soak_quick.json").read_text())
    for mode in ("off", "truncate+ckpt"):
        samples = res["results"][mode]["samples"]
        assert [s["step"] for s in samples] == [0, 20, 40, 60]
        assert all(s["rss_bytes"] > 0 and s["open_fds"] > 0 for s in samples)
        assert set(res["results"][mode]["growth_per_10k"]) == {"rss_bytes", "python_blocks", "open_fds"}
    assert "RSS MB / 10k steps" in capsys.readouterr().out


def test_growth_is_the_least_squares_slope_after_the_warmup():
    samples = [{"step": s, "rss": 1000 + (5 * s if s >= 100 else 50 * s)} for s in range(0, 400, 50)]
    assert bench.growth_per_10k(samples, "rss", warmup=100) == 5 * 10_000
    assert bench.growth_per_10k(samples[:2], "rss", warmup=100) is None
