"""The equal-size study: its baselines are what they claim to be, its comparisons and the end-to-end path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pareto_study as ps
import pytest
import study

from comera_lightning.nn import size_report, tt_layers


def test_points_parse_and_refuse_bad_input():
    assert ps.Point.parse("dense:48") == ps.Point("dense", 48.0)
    assert ps.Point.parse("comera:20:floor=0.5:head=64") == ps.Point("comera", 20.0, 0.5, 64)
    assert ps.Point.parse("comera:20:floor=0.5").name == "comera:20:floor=0.5"
    assert ps.Point.parse("comera:20:floor=0.5").family == "comera:floor=0.5"
    assert ps.Point.parse("comera:50:ramp=0.9") == ps.Point("comera", 50.0, ramp_fraction=0.9)
    assert ps.Point.parse("comera:50:floor=1:ramp=0.9").name == "comera:50:floor=1:ramp=0.9"
    assert ps.Point.parse("lowrank:8").family == "lowrank" and ps.Point.parse("comera:5").family == "comera"
    for bad, match in [
        ("sparse:3", "write dense:WIDTH"),
        ("dense", "write dense:WIDTH"),
        ("dense:x", "not a number"),
        ("dense:4.5", "positive integers"),
        ("comera:0", "positive"),
        ("dense:8:floor=1", "only comera points take options"),
        ("comera:5:gamma=1", "only floor=F"),
        ("comera:5:floor=high", "floor needs a number"),
        ("comera:5:ramp=0", r"in \(0, 1\]"),
        ("comera:5:ramp=1.5", r"in \(0, 1\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            ps.Point.parse(bad)


def test_corpus_roots():
    assert ps.corpus_root("stdlib") is None
    assert Path(ps.corpus_root("site:torch")).name == "torch"
    with pytest.raises(ValueError, match="no installed package folder"):
        ps.corpus_root("site:no_such_package_here")
    with pytest.raises(ValueError, match="is not a folder"):
        ps.corpus_root("/no/such/folder")


@pytest.fixture(scope="module")
def spec():
    return ps.study_spec("mlm", "stdlib", 0, None, quick=False)


def test_dense_points_are_the_same_architecture_narrowed(spec):
    full, _, method = ps.build_point(spec, ps.Point.parse("dense:128"))
    narrow, _, _ = ps.build_point(spec, ps.Point.parse("dense:32"))
    assert method == "dense" and not list(tt_layers(full)) and not list(tt_layers(narrow))
    hp = narrow.hparams
    # the head width stays (128 / 4 heads = 32), d_ff keeps its ratio to d_model
    assert (hp.d_model, hp.num_heads, hp.d_ff, hp.num_layers) == (32, 1, 128, spec.task_kwargs["num_layers"])
    assert size_report(narrow).active_parameters < size_report(full).active_parameters


def test_low_rank_points_are_plain_products_with_frozen_gates(spec):
    sizes = []
    for rank in (4, 8):
        task, _, method = ps.build_point(spec, ps.Point.parse(f"lowrank:{rank}"))
        layers = [layer for _, layer in tt_layers(task)]
        assert method == "dense"  # no rank callbacks: nothing decides ranks
        assert layers and all(
            len(layer.cores) == 2 and layer.ranks == [1, min(rank, *layer.mode_sizes), 1] for layer in layers
        )
        assert not any(gate.requires_grad for layer in layers for gate in layer.gates)
        sizes.append(size_report(task).active_parameters)
    assert sizes[0] < sizes[1]


def test_comera_points_carry_their_target_and_allocation(spec):
    _, run_spec, method = ps.build_point(spec, ps.Point.parse("comera:20:floor=0.5"))
    assert method == "comera" and run_spec.rank_kwargs["target_compression"] == 20.0
    assert run_spec.rank_kwargs["late_stage"].layer_floor == 0.5
    _, run_spec, _ = ps.build_point(spec, ps.Point.parse("comera:50:ramp=0.9"))
    assert run_spec.rank_kwargs["late_stage"].ramp_fraction == 0.9
    assert run_spec.rank_kwargs["late_stage"].layer_floor == 0.0  # the policy's default
    task, _, _ = ps.build_point(spec, ps.Point.parse("comera:20:head=16"))
    decoder = task.model.get_submodule("head.decoder")
    assert (len(decoder.cores), decoder.ranks[1]) == (2, 16)
    with pytest.raises(ValueError, match="head=R is for the MLM's decoder"):
        ps.task_kwargs(ps.study_spec("lm", "stdlib", 0, None, quick=True), ps.Point.parse("comera:5:head=8"))


def test_interpolation_in_log_parameters():
    curve = [(100.0, 0.1), (10_000.0, 0.3)]
    assert ps.interpolate_log(curve, 1000.0) == pytest.approx(0.2)
    assert ps.interpolate_log(curve, 100.0) == pytest.approx(0.1)
    assert ps.interpolate_log(curve, 50.0) is None and ps.interpolate_log(curve, 20_000.0) is None
    # below the curve: the smallest (larger) baseline model, flagged; above it: nothing to compare with
    assert ps.baseline_at(curve, 50.0) == (0.1, True)
    assert ps.baseline_at(curve, 1000.0) == (pytest.approx(0.2), False)
    assert ps.baseline_at(curve, 20_000.0) == (None, False)


def _study(seed, runs, task="mlm", higher=True):
    return {
        "task": task,
        "seed": seed,
        "higher_is_better": higher,
        "late_start_step": 4,
        "spec": {"steps": 10},
        "runs": {
            name: {
                "family": name.split(":")[0],
                "kind": name.split(":")[0],
                "metric": "m",
                "final_metric": value,
                "params_active": params,
                "compression_ratio": 1000 / params,
                "late_dip": 0.0 if name.startswith("comera") else None,
            }
            for name, (params, value) in runs.items()
        },
    }


def test_aggregate_compares_at_equal_size_and_finds_the_free_compression():
    a = _study(
        0,
        {
            "dense:64": (1000, 0.50),
            "dense:16": (100, 0.20),
            "dense:8": (10, 0.10),
            "lowrank:4": (100, 0.25),
            "lowrank:2": (10, 0.05),
            "comera:10": (100, 0.495),
            "comera:50": (20, 0.30),
        },
    )
    b = _study(
        1,
        {
            "dense:64": (1000, 0.52),
            "dense:16": (100, 0.22),
            "dense:8": (10, 0.12),
            "lowrank:4": (100, 0.27),
            "lowrank:2": (10, 0.07),
            "comera:10": (100, 0.505),
            "comera:50": (20, 0.10),
        },
    )
    agg = ps.aggregate([a, b])
    p = agg["points"]["comera:50"]
    assert (p["metric_mean"], p["metric_min"], p["metric_max"]) == pytest.approx((0.20, 0.10, 0.30))
    c = agg["comparisons"]["comera:10"]
    assert c["vs_dense"] == pytest.approx(0.50 - 0.21) and c["seeds_above_dense"] == "2/2"
    # at 20 parameters: dense interpolates between 0.11 (10) and 0.21 (100) in log-parameters
    expected = 0.11 + math.log(2) / math.log(10) * 0.10
    assert agg["comparisons"]["comera:50"]["dense_at_same_size"] == pytest.approx(expected)
    assert agg["comparisons"]["comera:50"]["seeds_above_dense"] == "1/2"
    # within one point of the full dense model (0.51): comera:10 (0.50) at 1000 / 100 = 10x
    assert agg["free_compression"] == {"compression": pytest.approx(10.0), "point": "comera:10"}
    tiny = ps.aggregate([_study(0, {"dense:64": (1000, 0.5), "dense:8": (10, 0.1), "comera:100": (5, 0.15)})])
    assert tiny["comparisons"]["comera:100"]["dense_is_larger"] is True
    assert "+0.0500 (vs its smallest, larger model)" in ps.markdown(tiny, "t")
    text = ps.markdown(agg, "t")
    assert "| comera:10 | 100 | 10.0x | 0.5000 | +0.2900 | 2/2 |" in text and "10.0x (comera:10)" in text
    with pytest.raises(ValueError, match="mix tasks"):
        ps.aggregate([a, _study(2, {"dense:8": (10, 1.0)}, task="lm")])
    with pytest.raises(ValueError, match="nothing to aggregate"):
        ps.aggregate([])


def test_perplexity_tolerance_is_five_percent():
    a = _study(
        0,
        {"dense:64": (1000, 20.0), "dense:8": (10, 80.0), "comera:5": (200, 20.9), "comera:20": (50, 21.5)},
        task="lm",
        higher=False,
    )
    agg = ps.aggregate([a])
    assert agg["free_compression"]["point"] == "comera:5"  # 20.9 <= 21.0, 21.5 > 21.0
    assert agg["comparisons"]["comera:20"]["vs_dense"] > 0  # dense perplexity at 50 parameters is higher


def test_late_dip_measures_the_fall_after_the_switch():
    validations = [{"step": s, "metrics": {"m": v}} for s, v in [(2, 0.1), (4, 0.3), (6, 0.25), (8, 0.35)]]
    assert study.late_dip(validations, "m", 4) == pytest.approx(0.05)
    assert study.late_dip(validations, "m", 5) == pytest.approx(0.05)  # the last value before the switch
    assert study.late_dip(validations, "m", 8) is None
    perplexity = [{"step": 4, "metrics": {"m": 10.0}}, {"step": 6, "metrics": {"m": 11.0}}]
    assert study.late_dip(perplexity, "m", 4, higher_is_better=False) == pytest.approx(0.1)


def test_end_to_end_resumes_and_aggregates(tmp_path, capsys):
    argv = [
        "--task",
        "mlm",
        "--quick",
        "--steps",
        "4",
        "--threads",
        "1",
        "--out-dir",
        str(tmp_path),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--points",
        "dense:16",
        "lowrank:2",
        "comera:4:floor=1",
    ]
    assert ps.main(argv) == 0
    out = tmp_path / "pareto_mlm_stdlib_s0_quick.json"
    study = json.loads(out.read_text())
    assert set(study["runs"]) == {"dense:16", "lowrank:2", "comera:4:floor=1"}
    hashes = {r["first_batch_hash"] for r in study["runs"].values()}
    assert len(hashes) == 1  # every model saw the same first batch
    assert study["runs"]["comera:4:floor=1"]["layer_floor"] == 1.0
    assert study["runs"]["comera:4:floor=1"]["ramp_steps"] >= 1  # the default rule's ramp, as run
    assert ps.main(argv) == 0  # a rerun skips what is there
    assert capsys.readouterr().out.count("already in") == 3
    assert ps.main(["--aggregate", str(out), "--out", str(tmp_path / "agg")]) == 0
    assert (tmp_path / "agg.png").stat().st_size > 0 and "comera:4:floor=1" in (tmp_path / "agg.md").read_text()
    with pytest.raises(SystemExit):
        ps.main(["--aggregate", str(out)])  # no --out
    with pytest.raises(SystemExit):
        ps.main(["--points", "dense:x", "--quick"])


def test_a_wider_study_scales_the_full_model():
    wide = ps.study_spec("mlm", "stdlib", 0, 100, quick=False, d_model=256)
    kwargs = wide.task_kwargs
    assert (kwargs["d_model"], kwargs["num_heads"], kwargs["d_ff"], wide.steps) == (256, 8, 1024, 100)
    assert kwargs["layer_config"].get("tt_linears", True)  # CoMERA's layers stay TT; dense points narrow from here
    with pytest.raises(ValueError, match="d_model must be >= 1"):
        ps.study_spec("mlm", "stdlib", 0, None, quick=False, d_model=0)
