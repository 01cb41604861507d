"""bench_tt_linear on the shared harness: case list, einsum baselines, a one-case run end to end, CLI errors."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_tt_linear as bench

ONE_CASE = [
    "--quick",
    "--shapes",
    "768x768",
    "--rows",
    "1",
    "--ranks",
    "8",
    "--repeats",
    "1",
    "--min-case-s",
    "0",
    "--min-sample-ms",
    "1",
    "--max-other-load",
    "1",
    "--threads",
    "1",
]


def test_case_list_puts_the_main_cases_first_without_duplicates():
    for quick in (True, False):
        cases = bench.build_cases(quick)
        assert len(cases) == len(set(cases))
        main = [c for c in cases if c.is_main]
        assert cases[: len(main)] == main and main
    assert len(bench.build_cases(False)) == 3 * 4 * 3  # the main cases are part of the grid


def test_tt_equation_contracts_input_and_cores_like_the_dense_reconstruction():
    torch.manual_seed(0)
    in_modes, out_modes, ranks = (3, 4), (2, 5), (1, 2, 3, 2, 1)
    modes = (*in_modes, *out_modes)
    cores = [torch.randn(ranks[k], m, ranks[k + 1]) for k, m in enumerate(modes)]
    x = torch.randn(6, 12)
    y = torch.einsum(bench.tt_equation(2, 2), x.reshape(6, *in_modes), *cores).reshape(6, 10)
    full = cores[0]
    for core in cores[1:]:
        full = torch.tensordot(full, core, dims=([-1], [0]))
    weight = full.reshape(12, 10)  # boundary ranks are 1
    torch.testing.assert_close(y, x @ weight, rtol=1e-5, atol=1e-5)


def test_one_case_end_to_end_writes_tables_json_and_png(tmp_path, capsys):
    assert bench.main([*ONE_CASE, "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "## 1. TTLinear (planner's choice) vs nn.Linear" in out and "## Targets" in out
    data = json.loads((tmp_path / bench.JSON_NAME).read_text())
    assert (tmp_path / bench.PNG_NAME).stat().st_size > 10_000
    [case] = data["cases"]
    assert (case["shape"], case["rows"], case["rank"]) == ("768x768", 1, 8)
    cands = case["candidates"]
    assert set(cands) == {"nn.Linear", "planner", "torch.einsum", "tensorly+oe", *(f"plan:{p}" for p in bench.PLANS)}
    for name, c in cands.items():  # every TT candidate computes the planner's function
        if name != "nn.Linear":
            assert c["max_rel_err_vs_planner"] < 1e-4, name
        assert len(c["samples_s"]) == case["rounds_used"] >= 1 and c["median_s"] > 0
    assert cands["nn.Linear"]["memory"]["param_bytes"] == (768 * 768 + 768) * 4
    assert case["ratios"]["dense_time_over_tt_time"] == pytest.approx(
        cands["nn.Linear"]["median_s"] / cands["planner"]["median_s"]
    )
    assert case["noise_cell"].startswith(f"{case['rounds_clean']}/{case['rounds_total']}")
    assert data["meta"]["machine"]["torch"] == torch.__version__
    assert data["targets"]["planner_never_slower_than_best_einsum"]["met"] in (True, False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rows", "7"], "leave no case"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--shapes", "1x1"], "invalid choice"),
    ],
)
def test_bad_arguments_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_keep_freed_memory_is_applied_before_timing_and_recorded(tmp_path, monkeypatch, capsys):
    applied = []
    monkeypatch.setattr(bench.harness, "keep_freed_memory_for_run", lambda: applied.append(True))
    assert bench.main([*ONE_CASE, "--keep-freed-memory", "--out-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert applied == [True]
    assert json.loads((tmp_path / bench.JSON_NAME).read_text())["meta"]["keep_freed_memory"] is True
