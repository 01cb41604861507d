"""The tuned quality protocol: the sweep picks the known best rate, the plan's order and dependencies, the sizes
of the families, and the report's refusal of malformed results."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.studies import report as qr
from benchmarks.studies import tuned as ts
from comera_lightning.nn import tt_layers
from comera_lightning.rank_adaptation.late_stage import BASE_RAMP_FRACTION, ramp_fraction_for


def run_sweep(train, grid=ts.GRID):
    """The driver's loop in miniature: run what sweep_rates asks for until it chooses."""
    done: dict[float, float] = {}
    while True:
        missing, best = ts.sweep_rates(done, grid)
        if not missing:
            return best, done
        for lr in missing:
            done[lr] = train(lr)


def test_a_sweep_on_a_tiny_model_picks_the_known_best_rate():
    # gradient descent on f(w) = curvature / 2 |w|^2 converges in one step exactly at lr = 1 / curvature, and
    # |1 - lr * curvature| per step elsewhere: the known best rate is 1 / curvature
    curvature = 100.0

    def train(lr: float) -> float:
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(8))
        optimizer = torch.optim.SGD([w], lr=lr)
        for _ in range(5):
            optimizer.zero_grad()
            (0.5 * curvature * w.pow(2).sum()).backward()
            optimizer.step()
        loss = float(0.5 * curvature * w.detach().pow(2).sum())
        return loss if math.isfinite(loss) else math.nan

    best, done = run_sweep(train, grid=(2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2))
    assert best == pytest.approx(1 / curvature) and len(done) == 5
    # the same model with the best rate below the grid: the grid grows downwards until the best is inside
    best, done = run_sweep(train, grid=(2e-2, 4e-2, 8e-2))
    assert best == pytest.approx(1e-2) and min(done) == pytest.approx(5e-3)


def test_the_grid_grows_past_an_edge_at_most_twice_and_diverged_rates_lose():
    best, done = run_sweep(lambda lr: (math.log2(lr) - math.log2(1e-5)) ** 2)  # the best rate far below the grid
    assert len(done) == 5 + ts.MAX_EXTENSIONS and best == pytest.approx(ts.GRID[0] / 4)
    runs = [{"lr": 1e-3, "val_loss": 3.0}, {"lr": 2e-3, "val_loss": math.nan}, {"lr": 4e-3, "val_loss": 2.5}]
    assert ts.best_rate(runs) == 4e-3
    assert ts.best_rate(runs[:2]) == 1e-3


def finished(job: ts.Job, loss: float, **extra) -> dict:
    return {**job.__dict__, "val_loss": loss, **extra}


def test_the_plan_runs_sweeps_then_checks_then_finals_and_tt_waits_for_comera():
    plan = ts.Plan(
        ["dense", "narrow", "comera", "tt"], [2.0, 5.0], [0, 1], steps=100, sweep_steps=20, grid=(1e-3, 2e-3, 4e-3)
    )
    first = plan.pending([])
    assert {(j.phase, j.family, j.size) for j in first} == {
        ("sweep", "dense", 1.0),
        ("sweep", "narrow", 5.0),
        ("sweep", "comera", 5.0),
    }
    assert all(j.steps == 20 and j.seed == 0 for j in first)
    # every sweep's best is its middle rate
    runs = [finished(j, 3.0 if math.isclose(j.lr, 2e-3) else 3.5) for j in first]
    second = plan.pending(runs)
    checks = [j for j in second if j.phase == "check"]
    assert {(j.family, j.size) for j in checks} == {("narrow", 2.0), ("comera", 2.0)}
    assert sorted(j.lr for j in checks if j.family == "narrow") == pytest.approx([1e-3, 2e-3, 4e-3])
    finals = [j for j in second if j.phase == "final"]
    assert {(j.family, j.size, j.seed) for j in finals} == {
        (f, s, seed) for f, s in [("dense", 1.0), ("narrow", 5.0), ("comera", 5.0)] for seed in (0, 1)
    }
    assert all(j.lr == 2e-3 and j.steps == 100 for j in finals)
    # every seed at the sweep size first (one whole comparison), seed by seed, CoMERA early; then the checks
    assert [(j.phase, j.family, j.seed) for j in second][:6] == [
        ("final", "dense", 0),
        ("final", "comera", 0),
        ("final", "narrow", 0),
        ("final", "dense", 1),
        ("final", "comera", 1),
        ("final", "narrow", 1),
    ]
    assert {j.phase for j in second[6:]} == {"check"}
    assert not any(j.family == "tt" for j in second)
    # the checks prefer x2 at 2x; CoMERA's seed-0 final at 5x unlocks the tt sweep
    runs += [finished(j, 2.0 if math.isclose(j.lr, 4e-3) else 3.0) for j in checks]
    comera_final = next(j for j in finals if j.family == "comera" and j.seed == 0)
    runs.append(finished(comera_final, 2.9, ranks_final={"model.fc": [1, 3, 1]}))
    third = plan.pending(runs)
    assert {(j.family, j.size, j.lr) for j in third if j.phase == "final" and j.size == 2.0} == {
        ("narrow", 2.0, 4e-3),
        ("comera", 2.0, 4e-3),
    }
    assert {(j.phase, j.family, j.size) for j in third if j.family == "tt"} == {("sweep", "tt", 5.0)}
    assert comera_final.key not in {j.key for j in third}


def test_other_sizes_go_in_the_order_asked_for_checks_before_finals():
    plan = ts.Plan(["narrow"], [5.0, 20.0, 2.0], [0, 1], steps=100, sweep_steps=20, grid=(1e-3, 2e-3, 4e-3))
    runs = [finished(j, 3.0 if math.isclose(j.lr, 2e-3) else 3.5) for j in plan.pending([])]
    runs += [finished(j, 3.0) for j in plan.pending(runs) if j.phase == "final"]
    checks = plan.pending(runs)
    assert [j.size for j in checks] == [20.0] * 3 + [2.0] * 3
    runs += [finished(j, 3.0) for j in checks if j.size == 20.0]
    # 20x whole (both seeds) before anything at 2x
    assert [(j.phase, j.size, j.seed) for j in plan.pending(runs)] == [
        ("final", 20.0, 0),
        ("final", 20.0, 1),
        ("check", 2.0, 0),
        ("check", 2.0, 0),
        ("check", 2.0, 0),
    ]


def test_a_rate_whose_final_diverges_is_dropped_for_that_size():
    plan = ts.Plan(["comera", "tt"], [5.0, 20.0], [0, 1], steps=100, sweep_steps=20, grid=(1e-3, 2e-3, 4e-3))
    runs = [finished(j, 3.0 if math.isclose(j.lr, 2e-3) else 3.5) for j in plan.pending([])]
    runs += [finished(j, 3.0, ranks_final={"fc": [1, 3, 1]}) for j in plan.pending(runs) if j.phase == "final"]
    checks = [j for j in plan.pending(runs) if j.phase == "check" and j.family == "comera"]
    # at 20x the short runs prefer x2 (4e-3), best below it is 1e-3
    runs += [finished(j, {1e-3: 3.2, 2e-3: 3.3, 4e-3: 3.1}[j.lr]) for j in checks]
    assert plan.chosen(runs, "comera", 20.0) == 4e-3
    diverged = ts.Job("final", "comera", 20.0, 0, 4e-3, 100)
    runs.append(finished(diverged, math.nan, ranks_final={"fc": [1, 9, 1]}))
    # the best short run below the diverged rate, for every seed; the diverged run's ranks never reach tt
    assert plan.chosen(runs, "comera", 20.0) == 1e-3
    finals = {(j.seed, j.lr) for j in plan.pending(runs) if j.phase == "final" and j.family == "comera"}
    assert finals == {(0, 1e-3), (1, 1e-3)}
    assert ts.comera_ranks(runs, 20.0, 0) is None
    assert not any(j.family == "tt" and j.size == 20.0 for j in plan.pending(runs))
    # when nothing below was run, half the diverged rate
    runs.append(finished(ts.Job("final", "comera", 20.0, 0, 1e-3, 100), math.inf))
    assert plan.chosen(runs, "comera", 20.0) == 5e-4
    assert ts.diverged_rates(runs, "comera", 20.0) == [1e-3, 4e-3]


def test_a_study_at_another_budget_takes_the_rates_and_runs_only_finals(tmp_path):
    plan = ts.Plan(["narrow", "comera"], [5.0, 20.0], [0], steps=100, sweep_steps=20, grid=(1e-3, 2e-3, 4e-3))
    runs = [finished(j, 3.0 if math.isclose(j.lr, 2e-3) else 3.5) for j in plan.pending([])]
    runs += [finished(j, 3.0 if math.isclose(j.lr, 4e-3) else 3.2) for j in plan.pending(runs) if j.phase == "check"]
    runs += [finished(j, 2.9) for j in plan.pending(runs) if j.phase == "final"]
    protocol = {"sweep_steps": 20, "grid": [1e-3, 2e-3, 4e-3], "quick": False}
    source = tmp_path / "lm_stdlib.json"
    source.write_text(json.dumps({"task": "lm", "corpus": "stdlib", "protocol": protocol, "runs": runs}))

    short, recheck = ts.short_runs_of(source, tmp_path / "lm_stdlib_long.json", "lm", "stdlib", protocol)
    assert not recheck
    assert {r["phase"] for r in short} == {"sweep", "check"} and len(short) == len(runs) - 4
    assert all(r["copied_from"] == "lm_stdlib.json" for r in short)
    longer = ts.Plan(["narrow", "comera"], [5.0, 20.0], [0], steps=400, sweep_steps=20, grid=(1e-3, 2e-3, 4e-3))
    todo = longer.pending(short)
    assert {(j.phase, j.family, j.size, j.lr, j.steps) for j in todo} == {
        ("final", family, size, lr, 400) for family in ("narrow", "comera") for size, lr in ((5.0, 2e-3), (20.0, 4e-3))
    }
    # the report names the source instead of repeating its sweeps
    text = qr.markdown({"rates_from": source.name, "protocol": protocol, "runs": short}, "lm_stdlib_long")
    assert "the sweeps and checks of `docs/data/lm_stdlib.json`" in text and "Learning-rate sweeps" not in text


def test_a_study_on_other_data_takes_only_the_sweeps_and_checks_every_size(tmp_path):
    grid = (1e-3, 2e-3, 4e-3)
    plan = ts.Plan(["dense", "narrow"], [5.0, 20.0], [0], steps=100, sweep_steps=20, grid=grid)
    runs = [finished(j, 3.0 if math.isclose(j.lr, 2e-3) else 3.5) for j in plan.pending([])]
    runs += [finished(j, 3.0) for j in plan.pending(runs)]  # the checks at 20x and the finals at 1x and 5x
    protocol = {"sweep_steps": 20, "grid": list(grid), "quick": False}
    source = tmp_path / "lm_stdlib.json"
    source.write_text(json.dumps({"task": "lm", "corpus": "stdlib", "protocol": protocol, "runs": runs}))

    more_data = {**protocol, "sweep_steps": 40, "set": ["data.max_files=null"]}  # longer checks are allowed
    short, recheck = ts.short_runs_of(source, tmp_path / "lm_stdlib_all.json", "lm", "stdlib", more_data, ["narrow"])
    assert recheck and {r["phase"] for r in short} == {"sweep"}  # the source's checks ran on its own data
    with pytest.raises(ValueError, match=r"no finished sweep of \['cola'\]"):
        ts.short_runs_of(source, tmp_path / "lm_stdlib_all.json", "lm", "stdlib", more_data, ["narrow", "cola"])
    longer = ts.Plan(["dense", "narrow"], [5.0, 20.0], [0], steps=400, sweep_steps=40, grid=grid, recheck=True)
    todo = longer.pending(short)
    # the swept rate is checked at every size, the sweep's own included, before any final
    assert {(j.phase, j.family, j.size) for j in todo} == {
        ("check", "dense", 1.0),
        ("check", "narrow", 5.0),
        ("check", "narrow", 20.0),
    }
    assert sorted(j.lr for j in todo if j.family == "dense") == pytest.approx([1e-3, 2e-3, 4e-3])
    assert {j.steps for j in todo} == {40}
    # on the new data the narrow model prefers /2 at 5x: its finals there follow the check, not the sweep
    preferred = {("narrow", 1e-3), ("dense", 2e-3)}
    checked = short + [finished(j, 2.0 if (j.family, j.lr) in preferred else 2.5) for j in todo]
    finals = longer.pending(checked)
    assert {(j.family, j.size, j.lr, j.steps) for j in finals} == {
        ("dense", 1.0, 2e-3, 400),
        ("narrow", 5.0, 1e-3, 400),
        ("narrow", 20.0, 1e-3, 400),
    }
    # a recheck at the sweep size comes before the finals there; other sizes follow as before
    half = short + [finished(j, 2.5) for j in todo if j.family == "dense"]
    assert [(j.phase, j.size) for j in longer.pending(half)] == [("check", 5.0)] * 3 + [("final", 1.0)] + [
        ("check", 20.0)
    ] * 3
    text = qr.markdown(
        {"rates_from": source.name, "protocol": {**more_data, "recheck": True, "steps": 400}, "runs": checked},
        "lm_stdlib_all",
    )
    assert "checked it at every size on its own data" in text and "| dense-narrowed | 5x | 2.000 |" in text
    assert "3.500" not in text  # the copied sweeps are the source's section's


def test_a_resumed_study_with_other_settings_is_refused(tmp_path):
    out = tmp_path / "lm_stdlib.json"
    plan = ts.Plan(["narrow"], [5.0], [0], steps=12, sweep_steps=6)
    ts.Study(out, "lm", "stdlib", plan, True, tmp_path, overrides=["data.max_sequences=300"]).save()
    ts.Study(out, "lm", "stdlib", plan, True, tmp_path, overrides=["data.max_sequences=300"])  # the same: resumes
    with pytest.raises(ValueError, match="another protocol"):
        ts.Study(out, "lm", "stdlib", plan, True, tmp_path)
    before = out.read_text()
    with pytest.raises(ValueError, match=r"SECTION\.KEY=VALUE"):
        ts.Study(tmp_path / "other.json", "lm", "stdlib", plan, True, tmp_path, overrides=["max_files=3"])
    assert out.read_text() == before and not (tmp_path / "other.json").exists()


def test_a_resumed_study_keeps_every_family_size_and_seed_it_has_run(tmp_path):
    out = tmp_path / "lm_stdlib.json"
    first = ts.Study(out, "lm", "stdlib", ts.Plan(["narrow", "dense"], [5.0], [0], 12, 6), True, tmp_path)
    first.runs.append(finished(ts.Job("final", "narrow", 5.0, 0, 1e-3, 12), 3.0))
    first.runs.append(finished(ts.Job("final", "lowrank", 5.0, 0, 1e-3, 12), 3.0))  # from an older invocation
    # a sweep copied from another study (--rates-from) is that study's family, not this one's
    first.runs.append(finished(ts.Job("sweep", "cola", 5.0, 0, 1e-3, 6), 3.0, copied_from="lm_other.json"))
    first.save()
    # resumed for one more family, size and seed: the protocol lists all of them, not only this invocation's
    again = ts.Study(out, "lm", "stdlib", ts.Plan(["galore"], [20.0], [1], 12, 6), True, tmp_path)
    protocol = again.state["protocol"]
    assert protocol["families"] == ["dense", "narrow", "lowrank", "galore"]
    assert protocol["sizes"] == [5.0, 20.0] and protocol["seeds"] == [0, 1]


def test_overrides_reach_the_spec():
    spec = ts.base_spec("lm", "stdlib", 0, 20, quick=True, overrides=["data.max_sequences=123", "data.root=/x"])
    assert spec.data_kwargs["max_sequences"] == 123 and spec.data_kwargs["root"] == "/x"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"corpus": "site:sqlalchemy"}, "another study"),
        ({"protocol": {"sweep_steps": 50, "grid": [1e-3], "quick": False}}, "another study"),
        ({"runs": []}, "no sweep or check runs"),
    ],
)
def test_rates_from_another_kind_of_study_is_refused(tmp_path, change, match):
    protocol = {"sweep_steps": 20, "grid": [1e-3], "quick": False}
    sweep = finished(ts.Job("sweep", "narrow", 5.0, 0, 1e-3, 20), 3.0)
    source = tmp_path / "src.json"
    source.write_text(json.dumps({"task": "lm", "corpus": "stdlib", "protocol": protocol, "runs": [sweep], **change}))
    with pytest.raises(ValueError, match=match):
        ts.short_runs_of(source, tmp_path / "out.json", "lm", "stdlib", protocol)
    with pytest.raises(ValueError, match="the --out file itself"):
        ts.short_runs_of(source, source, "lm", "stdlib", protocol)
    with pytest.raises(ValueError, match="does not exist"):
        ts.short_runs_of(tmp_path / "missing.json", source, "lm", "stdlib", protocol)


def test_plan_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="unknown families"):
        ts.Plan(["dense", "sparse"], [5.0], [0], 10, 5)
    with pytest.raises(ValueError, match="add comera to the families"):
        ts.Plan(["dense", "tt"], [5.0], [0], 10, 5)


@pytest.fixture(scope="module")
def quick_spec():
    return ts.base_spec("lm", "stdlib", 0, 20, quick=True)


def test_rivals_are_sized_at_or_just_above_the_target(quick_spec):
    full = ts.active_parameters(quick_spec, ts.family_kwargs(quick_spec, "dense", None))
    for family, step in (("narrow", 2), ("lowrank", 1), ("cola", 1)):
        knob = ts.knob_for(quick_spec, family, 5.0, full)
        count = ts.active_parameters(quick_spec, ts.family_kwargs(quick_spec, family, knob))
        smaller = ts.active_parameters(quick_spec, ts.family_kwargs(quick_spec, family, knob - step))
        assert smaller < full / 5 <= count, family
    # CoMERA starts at least 1.2x above its target: the default rank at 5x, a larger one at 1.1x
    assert ts.knob_for(quick_spec, "comera", 5.0, full) == quick_spec.task_kwargs["layer_config"]["rank"]
    assert ts.knob_for(quick_spec, "comera", 1.1, full) > quick_spec.task_kwargs["layer_config"]["rank"]


def test_the_families_build_what_they_claim(quick_spec):
    from benchmarks.studies import common as study

    def build(family, knob, ranks=None):
        torch.manual_seed(0)
        return study.task_class("lm")(**ts.family_kwargs(quick_spec, family, knob, ranks))

    cola, lowrank = build("cola", 4), build("lowrank", 4)
    kinds = {name: layer.bottleneck_activation for name, layer in tt_layers(cola) if hasattr(layer, "in_modes")}
    assert kinds and all((act == "silu") == (".layers." in name) for name, act in kinds.items())
    assert all(getattr(layer, "bottleneck_activation", None) is None for _, layer in tt_layers(lowrank))
    assert not any(g.requires_grad for _, layer in tt_layers(cola) for g in layer.gates)
    comera = build("comera", 8)
    ranks = {name: [1] + [max(1, r // 2) for r in layer.ranks[1:-1]] + [1] for name, layer in tt_layers(comera)}
    fixed = build("tt", 8, ranks)
    assert {name: layer.ranks for name, layer in tt_layers(fixed)} == ranks
    assert not any(g.requires_grad for _, layer in tt_layers(fixed) for g in layer.gates)
    assert all(g.requires_grad for _, layer in tt_layers(comera) for g in layer.gates)
    inside = build("comera_act", 8)  # CoLA's activation inside CoMERA: gated, so the rank callbacks can cut it
    assert {n: getattr(la, "bottleneck_activation", None) for n, la in tt_layers(inside)} == {
        n: ("silu" if ".layers." in n and hasattr(la, "in_modes") else None) for n, la in tt_layers(inside)
    }
    assert all(g.requires_grad for _, layer in tt_layers(inside) for g in layer.gates)
    for width in ts.narrow_widths(quick_spec):  # every narrowed width builds (even head widths, for rotary)
        build("narrow", width)
    with pytest.raises(ValueError, match="needs CoMERA's final ranks"):
        ts.family_kwargs(quick_spec, "tt", 8)


def test_optimiser_settings_follow_the_protocol():
    kwargs = ts.with_optim({"optim": {"lr_gates": 1.0, "weight_decay": 0.1}}, 3e-3, 1500)
    assert kwargs["optim"] == {
        "lr_gates": ts.GATE_LR,
        "weight_decay": 0.1,
        "lr_cores": 3e-3,
        "lr_other": 3e-3,
        "warmup_steps": 100,
        "schedule": "cosine",
        "final_lr_ratio": 0.1,
    }


# ------------------------------------------------------------------------------------------------------
# the report


def study_file(tmp_path, runs, name="lm_test"):
    path = tmp_path / f"{name}.json"
    path.write_text(
        json.dumps(
            {
                "task": "lm",
                "protocol": {"steps": 10, "seeds": [0, 1], "sweep_steps": 5},
                "full_dense_params": 1000,
                "runs": runs,
            }
        )
    )
    return path


def final_run(family, size, seed, loss, params, lr=1e-3, curve=None, **extra):
    return {
        "phase": "final",
        "family": family,
        "size": size,
        "seed": seed,
        "lr": lr,
        "tokens": 1000,
        "steps": 10,
        "params_active": params,
        "val_loss": loss,
        "curve": curve or [[500, loss + 0.5], [1000, loss]],
        **extra,
    }


def test_the_report_compares_at_each_size_and_finds_the_free_compression(tmp_path):
    runs = [final_run("dense", 1.0, s, 3.0, 1000, curve=[[200, 4.0], [800, 3.02], [1000, 3.0]]) for s in (0, 1)]
    runs += [
        final_run(
            "comera",
            5.0,
            s,
            3.0 + 0.01 * s,
            200,
            late_start_step=4,
            curve=[[400, 3.5], [600, 3.6], [1000, 3.0 + 0.01 * s]],
        )
        for s in (0, 1)
    ]
    runs += [final_run("narrow", 5.0, 0, 3.2, 210), final_run("narrow", 5.0, 1, 2.9, 210)]
    runs += [
        {**final_run("lowrank", 5.0, 0, 3.5, 205, lr=2e-3), "phase": "sweep"},
        {**final_run("lowrank", 5.0, 0, 3.4, 205, lr=4e-3), "phase": "sweep"},
    ]
    study = qr.load(study_file(tmp_path, runs))
    [row] = qr.comparisons(study)
    expected = (math.exp(3.2) + math.exp(2.9)) / (math.exp(3.0) + math.exp(3.01)) - 1
    assert row["narrow"]["ratio"] == pytest.approx(expected) and row["narrow"]["won"] == "1/2"
    assert "lowrank" not in row  # sweeps are not finals
    assert qr.free_compression(study) == 5.0
    # the last validation at or before 3/4 of the tokens (200 of 1000): the change over the last 80 %
    assert qr.last_quarter_change(study["runs"][0]) == pytest.approx((1.0 / 3.0, 0.8))
    assert qr.late_spike(study["runs"][2]) == pytest.approx(math.exp(0.1) - 1)
    text = qr.markdown(study, "lm_test")
    assert "| 5x | CoMERA | 0 k | 5.0x |" in text and "seed 0: 33.3%" in text and "**3.400**" not in text
    assert "over the last 80 % of its run" in text
    assert "| model | size | 0.002 | 0.004 |" in text and "| low-rank A B | 5x | 3.500 | 3.400 |" in text
    # the last panel: each family's lowest-seed curve at the middle size (the full-width model at 1x)
    curves = qr.figure(study, "lm_test").axes[4].get_lines()
    labels = [line.get_label() for line in curves]
    assert labels == ["dense (full width) (seed 0)", "dense-narrowed (seed 0)", "CoMERA (seed 0)"]
    assert list(curves[2].get_ydata()) == [3.5, 3.6, 3.0]


def test_the_convergence_is_measured_over_the_last_quarter_from_the_validation_points():
    # validations every 83 of 1000 steps, as the studies run: the last at or before 3/4 is step 747
    curve = [[83 * k, 4.0 - 0.01 * k] for k in range(1, 13)] + [[1000, 3.87]]
    change, share = qr.last_quarter_change(final_run("dense", 1.0, 0, 3.87, 1000, curve=curve))
    assert change == pytest.approx((3.91 - 3.87) / 3.87) and share == pytest.approx(0.253)
    assert qr.last_quarter_change(final_run("dense", 1.0, 0, 3.0, 1000, curve=[[1000, 3.0]])) is None
    text = qr.markdown({"runs": [final_run("dense", 1.0, 0, 3.87, 1000, curve=curve)]}, "lm_test")
    assert "seed 0: 1.0% over the last 25 % of its run (from the validation at 75 % of its tokens" in text


def flops_run(family, size, seed, late, start=100e12, end=25e12, steps=10, **extra):
    """A final run whose step FLOPs fall from ``start`` to ``end`` (4x) by a late stage switched at ``late``."""
    interpolated = (late * start + (steps - late) * (start + end) / 2) if late is not None else steps * start
    return final_run(
        family,
        size,
        seed,
        3.0,
        200,
        late_start_step=late,
        flops_per_step_start=start,
        flops_per_step_end=end if late is not None else start,
        train_flops=interpolated,
        **extra,
    )


def test_training_flops_are_counted_through_each_schedule_ramp():
    # the early schedule: the start model's FLOPs until step 1, then 4 steps (0.4 of 10) falling geometrically
    # from 100 to 25 (the size schedule's shape), then the end model's for the 5 steps left
    early = flops_run("comera_early", 5.0, 0, late=1)
    ramp = [100e12 * 0.25 ** (k / 4) for k in range(4)]
    assert qr.counted_flops(early) == pytest.approx(100e12 + sum(ramp) + 5 * 25e12)
    # the default schedule: from step 4, a ramp of 0.6 of the 6 steps left (4 steps), then 2 steps at the end's
    default = flops_run("comera", 5.0, 0, late=4)
    assert qr.counted_flops(default) == pytest.approx(4 * 100e12 + sum(ramp) + 2 * 25e12)
    assert qr.counted_flops(flops_run("comera_act", 5.0, 0, late=4)) == qr.counted_flops(default)
    # the schedules the study trains
    assert qr.EARLY_RAMP_SHARE_OF_RUN == ts.EARLY_RAMP_FRACTION
    assert qr.DEFAULT_RAMP_SHARE_OF_REST == BASE_RAMP_FRACTION == ramp_fraction_for(5.0, 1.0)
    # no late stage, or a schedule the report does not know: what the run recorded
    assert qr.counted_flops(flops_run("narrow", 5.0, 0, late=None)) == 1000e12
    assert qr.counted_flops(flops_run("comera_other", 5.0, 0, late=4)) == default["train_flops"]
    study = {"runs": [early, default, flops_run("comera", 5.0, 1, late=4), flops_run("comera_early", 5.0, 1, late=1)]}
    [saving] = qr.early_flop_savings(study)
    assert saving["size"] == 5.0
    assert saving["counted"] == pytest.approx(1 - qr.counted_flops(early) / qr.counted_flops(default))
    assert saving["stored"] == pytest.approx(1 - early["train_flops"] / default["train_flops"])
    text = qr.markdown(study, "lm_test")
    assert f"5x {-saving['counted']:+.1%} (the stored interpolation: {-saving['stored']:+.1%})" in text
    # the table's FLOPs are the counted ones
    assert f"| {qr.counted_flops(early) / 1e12:.2f} |" in text


def test_the_late_stage_spike_and_rise_are_reported_per_family():
    def run(family, seed, curve):
        return final_run(family, 20.0, seed, curve[-1][1], 50, late_start_step=4, curve=curve)

    study = {
        "runs": [
            # switch at 400 tokens (step 4 of 10): CoMERA's worst is +0.2 in loss over the value at the switch
            run("comera", 0, [[300, 4.0], [400, 3.9], [600, 4.1], [1000, 3.8]]),
            run("comera", 1, [[300, 4.0], [400, 3.9], [600, 4.0], [1000, 3.8]]),
            # the SiLU family's +0.5 is its own, not CoMERA's
            run("comera_act", 1, [[300, 4.0], [400, 3.9], [600, 4.4], [1000, 3.8]]),
            # falling through the switch, then rising 0.3 above its best so far: no spike over the switch's value
            run("comera_early", 0, [[300, 5.0], [500, 4.0], [700, 4.3], [1000, 3.9]]),
        ]
    }
    runs = study["runs"]
    assert qr.late_spike(runs[0]) == pytest.approx(math.exp(0.2) - 1)
    assert qr.late_rise(runs[0]) == pytest.approx(math.exp(0.2) - 1)
    assert qr.late_spike(runs[3]) == pytest.approx(math.exp(-0.7) - 1)
    assert qr.late_rise(runs[3]) == pytest.approx(math.exp(0.3) - 1)
    assert qr.late_rise(run("comera", 0, [[300, 4.0], [600, 3.5], [1000, 3.4]])) < 0  # never rose: negative
    rows = {(r["family"], r["size"]): r for r in qr.late_stage_rows(study)}
    assert rows[("comera", 20.0)]["seeds"] == [0, 1]
    assert rows[("comera", 20.0)]["spike"] == pytest.approx([math.exp(0.2) - 1, math.exp(0.1) - 1])
    assert rows[("comera_act", 20.0)]["spike"] == pytest.approx([math.exp(0.5) - 1])
    assert rows[("comera_early", 20.0)]["rise"] == pytest.approx([math.exp(0.3) - 1])
    text = qr.markdown(study, "lm_test")
    assert "| CoMERA | 20x | step 4 | 0 / 1 | +22.1 / +10.5 | +22.1 / +10.5 |" in text
    assert "| CoMERA + SiLU bottleneck | 20x | step 4 | 1 | +64.9 | +64.9 |" in text
    assert "| CoMERA, early late stage | 20x | step 4 | 0 | -50.3 | +35.0 |" in text


def test_the_report_gives_the_compression_reached_and_the_heads_ranks():
    runs = [
        final_run("comera", 20.0, 0, 4.0, 50, knob=32, ranks_final={"model.lm_head": [1, 15, 1], "x": [1, 9, 1]}),
        final_run("comera", 20.0, 1, 4.1, 56, knob=32, ranks_final={"model.lm_head": [1, 17, 1], "x": [1, 9, 1]}),
        final_run("lowrank", 20.0, 0, 4.2, 52, knob=5),
        final_run("cola", 20.0, 0, 4.3, 52, knob=5),
    ]
    study = {"full_dense_params": 1000, "runs": runs}
    text = qr.markdown(study, "lm_test")
    assert "| 20x | CoMERA | 0 k | 17.9-20.0x |" in text and "| 20x | low-rank A B | 0 k | 19.2x |" in text
    [head] = qr.head_ranks(study)
    assert head == {"size": 20.0, "comera_start": 64, "comera": (15, 17), "rivals": {"lowrank": 5, "cola": 5}}
    assert "20x: CoMERA from 64 to 15-17, low-rank A B 5, CoLA (B silu(A x)) 5" in text


def test_a_diverged_final_is_reported_and_left_out_of_the_tables():
    study = {
        "runs": [
            final_run("comera", 20.0, 0, math.nan, 1000) | {"lr": 4e-2, "curve": [[10, 4.0], [20, math.nan]]},
            final_run("comera", 20.0, 0, 3.1, 1000) | {"lr": 1e-2},
        ]
    }
    assert [r["lr"] for r in qr.finals(study)[("comera", 20.0)]] == [1e-2]
    text = qr.markdown(study, "lm_test")
    assert "Diverged finals" in text
    assert "CoMERA 20x seed 0 at lr 0.04 (first non-finite validation at 20 tokens)" in text


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda s: s.pop("runs"), "expected a JSON object with a list 'runs'"),
        (lambda s: s["runs"][0].pop("curve"), r"runs\[0\] has no 'curve'"),
        (lambda s: s["runs"][0].update(seed="0"), r"runs\[0\]\['seed'\] is '0', which is not a int"),
        (lambda s: s["runs"][0].update(curve=[[1, 2, 3]]), r"each point is \[tokens, val_loss\]"),
    ],
)
def test_a_malformed_results_file_is_refused_with_the_run_and_field(tmp_path, corrupt, match):
    study = {"runs": [final_run("dense", 1.0, 0, 3.0, 1000)]}
    corrupt(study)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(study))
    with pytest.raises(qr.StudyFileError, match=match):
        qr.load(path)
    assert qr.main([str(path)]) == 2


def test_a_file_that_is_not_json_and_missing_markers_name_the_fix(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{not json")
    with pytest.raises(qr.StudyFileError, match="not valid JSON"):
        qr.load(path)
    with pytest.raises(qr.StudyFileError, match="needs exactly one '<!-- quality:x begin -->'"):
        qr.replace_block("# Results\n", "x", "table\n")
    page = "a\n<!-- quality:x begin -->\nold\n<!-- quality:x end -->\nb\n"
    assert qr.replace_block(page, "x", "new\n") == "a\n<!-- quality:x begin -->\nnew\n<!-- quality:x end -->\nb\n"


def test_docs_results_are_what_docs_data_gives():
    # the committed tables are generated: a hand edit or a stale table fails here
    assert qr.main(["--check"]) == 0


@pytest.mark.parametrize("task", ["lm", "mlm"])
def test_a_quick_run_of_each_task_records_what_the_report_reads(task, tmp_path):
    spec = ts.base_spec(task, "stdlib", 0, 12, quick=True)
    full = ts.active_parameters(spec, ts.family_kwargs(spec, "dense", None))
    knob = ts.knob_for(spec, "comera", 5.0, full)
    job = ts.Job("final", "comera", 5.0, 0, 1e-2, 12)
    record = ts.run_job(job.__dict__, task, "stdlib", True, knob, None, str(ts.REPO / ".cache" / "comera"))
    assert math.isfinite(record["val_loss"]) and record["curve"] and record["tokens"] > 0
    assert record["flops_per_step_start"] > 0 and record["peak_memory"]["total"] > 0
    qr.validate({"runs": [record]}, "a quick run")  # what the report checks


def test_galore_is_refused_for_the_masked_lm():
    with pytest.raises(SystemExit):
        ts.main(["--task", "mlm", "--families", "galore", "--quick", "--out", "/nonexistent/x.json"])
