"""The quality study end to end at a tiny size: same steps, same budget, honest sizes, clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import quality_seeds
import quality_study as qs

STEPS, BUDGET_S, VAL_EVERY = 6, 1.5, 3


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, str]:
    """One tiny run of both studies and both protocols through ``main`` (the command-line path)."""
    out = tmp_path_factory.mktemp("quality")
    argv = [
        "--quick",
        "--steps",
        str(STEPS),
        "--budget-s",
        str(BUDGET_S),
        "--val-every",
        str(VAL_EVERY),
        "--threads",
        "1",  # two threads on a busy 2-core machine spin-wait on each other: 10x slower steps
        "--out-dir",
        str(out),
        "--cache-dir",
        str(out / "cache"),
    ]
    assert qs.main(argv) == 0
    return out, (out / "quality_study.md").read_text()


def _load(out: Path, name: str) -> dict:
    return json.loads((out / f"quality_{name}.json").read_text())


def _runs(result: dict) -> dict[tuple[str, str], dict]:
    return {(r["method"], r["protocol"]): r for r in result["runs"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", qs.STUDIES)
def test_outputs_exist_and_sizes_are_consistent(study, name):
    out, text = study
    result = _load(out, name)
    png = (out / f"quality_{name}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    runs = _runs(result)
    assert set(runs) == {(m, p) for m in qs.DEFAULT_METHODS for p in qs.DEFAULT_PROTOCOLS}
    dense, comera = runs["dense", "steps"], runs["comera", "steps"]
    for r in (runs["dense", "steps"], runs["dense", "time"]):
        for size in (r["size_at_start"], r["size_final"], *r["validations"]):
            assert size["compression_ratio"] == 1.0
            assert size["params_active"] == size["params_dense_equivalent"] == size["params_trainable"]
        assert r["ranks_final"] == {} and "rank_adaptation" not in r
    for r in (runs["comera", "steps"], runs["comera", "time"]):
        final = r["final"]
        assert final["compression_ratio"] > 1.0
        assert final["params_active"] < final["params_dense_equivalent"]
        assert final["compression_ratio"] == pytest.approx(final["params_dense_equivalent"] / final["params_active"])
        assert r["ranks_final"] and all(ranks[0] == ranks[-1] == 1 for ranks in r["ranks_final"].values())
        # "same architecture otherwise": the TT model stands for exactly the dense model's parameters
        assert final["params_dense_equivalent"] == dense["size_final"]["params_trainable"]
    # the headline metric is in range and the summary is the difference of the finals
    metric = result["spec"]["metric"]
    for r in result["runs"]:
        value = r["final"]["metrics"][metric]
        assert 0.0 <= value <= 1.0
        assert math.isfinite(r["final"]["metrics"][result["spec"]["secondary"]])
    summary = result["summary"]["steps"]
    delta = comera["final"]["metrics"][metric] - dense["final"]["metrics"][metric]
    assert summary["metric_delta"] == pytest.approx(delta)
    assert summary["same_data_order"] and result["summary"]["time"]["same_data_order"]
    assert len({r["first_batch_hash"] for r in result["runs"]}) == 1  # one data order for all four runs
    # every row of the markdown table is there
    section = text.split(f"### {name}:")[1].split("###")[0]
    for method in qs.DEFAULT_METHODS:
        assert f"| {method} | steps |" in section and f"| {method} | time ({BUDGET_S:g} s) |" in section
    assert result["machine"]["cpu_count"] >= 1 and "settings" in result


@pytest.mark.slow
@pytest.mark.parametrize("name", qs.STUDIES)
def test_protocols_are_respected(study, name):
    out, _ = study
    result = _load(out, name)
    runs = _runs(result)
    for method in qs.DEFAULT_METHODS:
        same_steps, budget = runs[method, "steps"], runs[method, "time"]
        assert same_steps["steps"] == STEPS and not same_steps["stopped_by_budget"]
        assert [v["step"] for v in same_steps["validations"]] == list(range(VAL_EVERY, STEPS + 1, VAL_EVERY))
        # the budget stops training after the first step that reaches it: at most one step (plus the
        # callbacks after it) too long
        assert budget["stopped_by_budget"] and budget["budget_s"] == BUDGET_S
        assert BUDGET_S <= budget["train_s"] <= BUDGET_S + max(budget["step_s"]) + 0.5
        assert budget["validations"][-1]["step"] == budget["steps"]
        assert all(v["train_s"] <= budget["train_s"] + 1e-9 for v in budget["validations"])
        for r in (same_steps, budget):
            # one interval per step; together they are the training clock (minus the time before step 1)
            assert len(r["step_s"]) == r["steps"] and min(r["step_s"]) > 0
            assert sum(r["step_s"]) <= r["train_s"] + 1e-6
            assert r["median_step_s"] > 0 and isinstance(r["contended"], bool)
            assert r["other_load"] is None or 0.0 <= r["other_load"] <= 1.0
            assert [v["step"] for v in r["validations"]] == sorted(v["step"] for v in r["validations"])
    # CoMERA's schedule: the late stage starts at late_fraction of the steps, or of the budget's seconds
    steps_schedule = runs["comera", "steps"]["rank_adaptation"]
    assert steps_schedule["stage"] == 1
    assert steps_schedule["switch_step"] == round(result["spec"]["late_fraction"] * STEPS)
    time_schedule = runs["comera", "time"]["rank_adaptation"]
    assert time_schedule["stage"] == 1 and 0 < time_schedule["switch_step"] <= runs["comera", "time"]["steps"]
    late_s = result["spec"]["late_fraction"] * BUDGET_S
    assert all(v["train_s"] >= late_s for v in runs["comera", "time"]["validations"] if v["stage"] == 1)


@pytest.mark.slow
def test_baseline_is_reported(study):
    out, text = study
    mlm, dlrm = _load(out, "mlm"), _load(out, "dlrm")
    assert 0.0 <= mlm["baseline"]["unigram_accuracy"] < 1.0 and mlm["baseline"]["val_masked_tokens"] > 0
    assert 0.0 < dlrm["baseline"]["train_click_rate"] < 1.0 and dlrm["baseline"]["constant_logloss"] > 0
    assert "Floor:" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--budget-s", "-3"], "--budget-s must be a positive number"),
        (["--budget-s", "nan"], "--budget-s must be a positive number"),
        (["--val-every", "0"], "--val-every must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--max-other-load", "2"], "--max-other-load is a share"),
        (["--study", "bert"], "invalid choice"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as err:
        qs.main([*argv, "--out-dir", str(tmp_path)])
    assert err.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing ran


def test_bad_settings_in_the_api_are_refused():
    with pytest.raises(ValueError, match="unknown study"):
        qs.make_specs("bert")
    with pytest.raises(ValueError, match="late_fraction"):
        qs.replace(qs.mlm_spec(quick=True), late_fraction=1.5).check()
    with pytest.raises(ValueError, match="budget_s"):
        qs.make_specs("dlrm", quick=True, budget_s=0.0)
    with pytest.raises(ValueError, match="unknown protocol"):
        qs.run_study(qs.dlrm_spec(quick=True), protocols=("epochs",))
    with pytest.raises(ValueError, match="unknown method"):
        qs.build_task(qs.dlrm_spec(quick=True), "galore")


@pytest.mark.slow
def test_matched_protocol_gives_comera_the_dense_runs_wall_clock(tmp_path):
    argv = [
        "--quick",
        "--study",
        "mlm",
        "--protocol",
        "matched",
        "--steps",
        str(STEPS),
        "--val-every",
        "3",
        "--methods",
        "dense",
        "comera",
        "comera-paper",
        "--threads",
        "1",
        "--tag",
        "_m",
        "--out-dir",
        str(tmp_path),
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    assert qs.main(argv) == 0
    result = json.loads((tmp_path / "quality_mlm_m.json").read_text())
    assert not (tmp_path / "quality_mlm_m.partial.json").exists()
    ratio = result["step_ratio"]["ratio_dense_over_comera"]
    assert ratio > 0 and result["step_ratio"]["rounds_total"] >= 1
    runs = _runs(result)
    assert runs["dense", "matched"]["steps"] == STEPS
    for method in ("comera", "comera-paper"):
        assert runs[method, "matched"]["steps"] == max(1, round(STEPS * ratio))
        assert not runs[method, "matched"]["stopped_by_budget"]
    assert runs["comera-paper", "matched"]["rank_adaptation"]["late_stage"] == {}
    assert runs["comera", "matched"]["rank_adaptation"]["late_stage"]["start_step"] is not None
    assert set(result["summary"]) == {"matched", "matched (comera-paper)"}


@pytest.mark.slow
def test_a_cut_off_study_resumes_and_a_changed_one_is_refused(study, tmp_path, capsys):
    out, _ = study
    argv = [
        "--quick",
        "--study",
        "dlrm",
        "--steps",
        str(STEPS),
        "--budget-s",
        str(BUDGET_S),
        "--val-every",
        str(VAL_EVERY),
        "--threads",
        "1",
        "--out-dir",
        str(tmp_path),
    ]
    (tmp_path / "quality_dlrm.partial.json").write_text((out / "quality_dlrm.json").read_text())
    assert qs.main(argv) == 0
    assert capsys.readouterr().out.count("already in") == 4  # every run was there: nothing trained again
    assert _runs(_load(tmp_path, "dlrm")) == _runs(_load(out, "dlrm"))
    assert not (tmp_path / "quality_dlrm.partial.json").exists()
    (tmp_path / "quality_dlrm.partial.json").write_text((out / "quality_dlrm.json").read_text())
    with pytest.raises(SystemExit) as err:
        qs.main([*argv, "--steps", str(STEPS + 1)])
    assert err.value.code == 2 and "holds runs of another spec" in capsys.readouterr().err


@pytest.mark.slow
def test_seeds_aggregate_mean_spread_and_dip(study, tmp_path, capsys):
    out, _ = study
    stem = tmp_path / "mlm_steps"
    assert quality_seeds.main([str(out / "quality_mlm.json"), "--protocol", "steps", "--out", str(stem)]) == 0
    agg = json.loads(stem.with_suffix(".json").read_text())
    assert set(agg["summary"]) == set(qs.DEFAULT_METHODS)
    final = agg["summary"]["comera"]["final"]
    assert final["n"] == 1 and final["min"] == final["mean"] == final["max"]
    assert agg["summary"]["dense"]["delta_vs_dense"]["mean"] == 0.0
    assert agg["runs"]["comera"][0]["switch_step"] is not None
    assert stem.with_suffix(".png").stat().st_size > 0 and "| comera | 0 |" in stem.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        quality_seeds.main([str(out / "quality_mlm.json"), "--protocol", "matched", "--out", str(stem)])
