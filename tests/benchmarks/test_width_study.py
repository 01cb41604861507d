"""The width study's protocol (sweep at the smallest width, check at the largest, transfer, interpolated finals), its
FLOP count along shrinking ranks, and the report's comparisons."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.studies import width as ws
from benchmarks.studies import width_report as wr


def finished(job: ws.Job, loss: float, **extra) -> dict:
    return {**job.__dict__, "val_loss": loss, **extra}


def test_the_rate_between_two_widths_is_read_off_a_line_in_log_log_and_rounded_to_the_grid():
    low, high = (128, 0.04), (512, 0.01)
    assert ws.interpolated_rate(128, low, high, 1.25e-3) == pytest.approx(0.04)
    assert ws.interpolated_rate(512, low, high, 1.25e-3) == pytest.approx(0.01)
    assert ws.interpolated_rate(256, low, high, 1.25e-3) == pytest.approx(0.02)  # halfway in log width
    # 0.04 -> 0.005 over 128 -> 768: at 256 the line gives 0.0183, rounded to the grid's 0.02
    assert ws.interpolated_rate(256, (128, 0.04), (768, 0.005), 1.25e-3) == pytest.approx(0.02)


def plan(**kwargs) -> ws.Plan:
    widths = {"dense": (64, 256), "tt": (128, 512)}
    return ws.Plan(["dense", "tt"], widths, "mup", [0], steps=100, sweep_steps=10, transfer_widths=(128, 512), **kwargs)


def run_until(p: ws.Plan, loss, phases=("sweep", "check", "transfer", "final")) -> list[dict]:
    """Run what the plan asks for (losses from ``loss(job)``) until only other phases are pending."""
    runs: list[dict] = []
    while True:
        todo = [j for j in p.pending(runs) if j.phase in phases]
        if not todo:
            return runs
        runs += [finished(j, loss(j)) for j in todo]


def valley(centre_by_key):
    """A loss with its minimum at the rate ``centre_by_key(job)``, quadratic in log rate."""
    return lambda job: 3.0 + math.log2(job.lr / centre_by_key(job)) ** 2


def test_the_plan_sweeps_at_the_smallest_width_checks_at_the_largest_and_interpolates_between():
    p = plan()
    first = [j for j in p.pending([]) if j.phase != "transfer"]
    assert {(j.phase, j.family, j.width) for j in first} == {("sweep", "dense", 64), ("sweep", "tt", 128)}
    assert all(j.parameterization == ("standard" if j.family == "dense" else "mup") for j in first)
    # dense's best rate halves per doubling of width (0.04 at 64, 0.01 at 256); the TT's stays at 0.02
    centre = valley(lambda j: 0.04 * 64 / j.width if j.family == "dense" else 0.02)
    runs = run_until(p, centre, ("sweep", "check"))
    checks = [r for r in runs if r["phase"] == "check"]
    assert {(r["family"], r["width"]) for r in checks} == {("dense", 256), ("tt", 512)}
    # the dense check grew past its lower edge: 0.04 /2, x1, x2 first, then 0.01 (the true best)
    assert sorted(r["lr"] for r in checks if r["family"] == "dense") == pytest.approx([0.005, 0.01, 0.02, 0.04, 0.08])
    _, chosen = p.rates(runs, "dense")
    assert chosen == pytest.approx({64: 0.04, 256: 0.01})
    _, chosen = p.rates(runs, "tt")
    assert chosen == pytest.approx({128: 0.02, 512: 0.02})
    # the transfer sweeps come before the finals; the tt sweep at 128 under mup is the protocol's own, not repeated
    pending = p.pending(runs)
    transfer = [j for j in pending if j.phase == "transfer"]
    assert {(j.width, j.parameterization) for j in transfer} == {(128, "standard"), (512, "standard"), (512, "mup")}
    assert pending.index(transfer[-1]) < min(i for i, j in enumerate(pending) if j.phase == "final")
    finals = [j for j in pending if j.phase == "final"]
    # dense's front first (cheapest first), then the tensorised finals, largest first
    assert [(j.family, j.width) for j in finals] == [("dense", 64), ("dense", 256), ("tt", 512), ("tt", 128)]


def test_a_check_keeps_growing_past_its_edge_until_the_best_rate_is_inside():
    # dense's best rate falls 16x from 64 to 256 (0.04 -> 0.0025): the check starts at 0.02/0.04/0.08 and must
    # grow downwards three times before 0.0025 has a worse rate on both sides
    p = plan()
    centre = valley(lambda j: 0.04 * (64 / j.width) ** 2 if j.family == "dense" else 0.02)
    runs = run_until(p, centre, ("sweep", "check"))
    checked = sorted(r["lr"] for r in runs if r["phase"] == "check" and r["family"] == "dense")
    assert checked == pytest.approx([0.00125, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08])
    _, chosen = p.rates(runs, "dense")
    assert chosen == pytest.approx({64: 0.04, 256: 0.0025})


def test_a_plan_needs_two_widths_per_family_and_known_families():
    with pytest.raises(ValueError, match="at least two widths"):
        ws.Plan(["dense"], {"dense": (64,)}, "mup", [0], 10, 5)
    with pytest.raises(ValueError, match="unknown families"):
        ws.Plan(["lowrank"], {"lowrank": (64, 128)}, "mup", [0], 10, 5)


class _Trainer:
    def __init__(self) -> None:
        self.global_step = 0


def test_the_flop_meter_counts_each_step_at_the_ranks_it_ran_at(monkeypatch):
    signatures = iter([(1,), (1,), (2,), (2,), (3,)])
    flops = iter([100, 60, 10])
    monkeypatch.setattr(ws, "_rank_signature", lambda task: next(signatures))
    monkeypatch.setattr(ws.ts, "step_flops", lambda task, batch: next(flops))
    meter = ws.flop_meter(batch=None)
    trainer = _Trainer()
    meter.on_train_start(trainer, None)
    for step in (1, 2, 3, 4):  # a cut after step 2 and after step 4
        trainer.global_step = step
        meter.on_train_batch_end(trainer, None, None, None, step)
    assert meter.changes == [(0, 100), (2, 60), (4, 10)]
    assert meter.flops_until(2) == 200 and meter.flops_until(4) == 320 and meter.flops_until(6) == 340


def test_the_study_refuses_a_file_of_another_protocol(tmp_path, monkeypatch):
    monkeypatch.setattr(ws.ts, "base_spec", lambda *a, **k: None)
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"protocol": {"sweep_steps": 99}, "runs": []}))
    with pytest.raises(ValueError, match=r"another protocol .* give another --out"):
        ws.Study(path, plan(), quick=False, cache_dir=tmp_path)


GRID = [0.0025, 0.005, 0.01, 0.02, 0.04]


def state_of(runs: list[dict]) -> dict:
    return {"protocol": {"transfer_widths": [128, 512], "widths": {}, "seeds": [0], "grid": GRID}, "runs": runs}


def test_the_report_measures_how_far_the_best_rate_moved_per_parameterisation():
    runs = []
    for param, best in (("standard", {128: 0.02, 512: 0.005}), ("mup", {128: 0.02, 512: 0.02})):
        for width in (128, 512):
            for lr in GRID:
                loss = 3 + abs(math.log2(lr / best[width]))
                runs.append(finished(ws.Job("transfer", "tt", width, param, 0, lr, 10), loss))
    moved = wr.transfer(state_of(runs))
    assert moved["standard"]["moved"] == pytest.approx(4.0) and moved["mup"]["moved"] == pytest.approx(1.0)
    # a sweep still running reports no best rate, not the best of what has run so far
    half = [r for r in runs if not (r["parameterization"] == "mup" and r["width"] == 512 and r["lr"] > 0.005)]
    found = wr.transfer(state_of(half))["mup"]
    assert found["best"][512] is None and found["moved"] is None


def test_the_report_reads_dense_loss_off_its_front_at_a_rivals_cost_and_never_extrapolates_it():
    def final(family, width, flops, loss):
        return finished(ws.Job("final", family, width, "mup", 0, 0.01, 10), loss, train_flops=flops, params_active=1)

    runs = [final("dense", 64, 1e12, 4.0), final("dense", 128, 4e12, 3.0), final("tt", 128, 2e12, 3.2)]
    runs += [final("tt", 512, 8e12, 2.9), final("tt", 1024, 16e12, 3.1), final("tt", 32, 0.5e12, 3.9)]
    rows = {width: (text, wins) for width, _, text, wins in wr.compare(state_of(runs), "tt", "train_flops")}
    assert rows[128] == ("3.500 (-8.6%)", True)  # halfway between 1e12 and 4e12 in log FLOPs: dense's 3.5
    assert rows[512] == ("outside dense's range", None)  # beyond dense's largest, and better than it: no verdict
    assert rows[1024] == ("behind dense d 128 (3.000 at less)", False)  # dense does better for less
    assert rows[32] == ("ahead of dense d 64 (4.000 at more)", True)  # better than dense for less


def test_the_report_reads_the_protocols_check_as_the_study_grew_it():
    # dense swept at 64 (best 0.02) and checked at 256 down to 0.0025, still at the edge: the study's five
    # extensions ask for 0.00125 next, so the report must not call 0.0025 the checked rate yet
    sweep = [
        finished(ws.Job("sweep", "dense", 64, "standard", 0, lr, 10), 3 + abs(math.log2(lr / 0.02))) for lr in GRID
    ]
    check = [
        finished(ws.Job("check", "dense", 256, "standard", 0, lr, 10), 3 + math.log2(lr / 0.0025))
        for lr in (0.0025, 0.005, 0.01, 0.02, 0.04)
    ]
    state = state_of(sweep + check)
    state["protocol"].update(widths={"dense": [64, 256]}, check_extensions=5)
    assert wr.protocol_transfer(state) == []
    deeper = finished(ws.Job("check", "dense", 256, "standard", 0, 0.00125, 10), 3.5)
    state["runs"].append(deeper)
    assert wr.protocol_transfer(state) == [("dense", 64, 0.02, 256, 0.0025)]


def test_the_headline_places_comera_on_every_front_and_says_where_it_wins():
    def final(family, width, loss, cost):
        costs = dict(train_flops=cost * 1e12, params_active=int(cost * 1e5), peak_memory=cost * 2**20)
        return finished(ws.Job("final", family, width, "mup", 0, 0.01, 10), loss, flops_per_step=[[0, 1]], **costs)

    runs = [final("dense", 64, 4.0, 1.0), final("dense", 128, 3.0, 4.0)]
    runs += [final("comera", 128, 3.2, 2.0), final("comera", 768, 2.5, 8.0)]
    state = state_of(runs)
    # a step of cost/10 s alone: 10 steps take cost s, the same cost on the clock front as on the others
    state["clock_alone"] = {
        "step_s": {f"{r['family']}/{r['width']}/start": r["params_active"] / 1e6 for r in runs},
        "step_flops": {f"{r['family']}/{r['width']}/start": 1 for r in runs},
    }
    state["protocol"].update(widths={"dense": [64, 128], "comera": [128, 768]}, steps=10, parameterization="mup")
    table = wr.headline_table(state).splitlines()
    assert len(table) == 4  # header, rule, one row per CoMERA width
    # at d 128 CoMERA costs 2 on every front, halfway (in log cost) between dense's 1 and 4: dense's loss there is 3.5
    assert table[2].startswith("| 128 | 200 k | 3.200 | 3.500 (-8.6%)") and table[2].count("3.500 (-8.6%)") == 4
    assert table[3].count("outside dense's range") == 4  # beyond dense's largest cost: not extrapolated
    text = wr.headline(state)
    assert "4 of 4 of these finals finished" in text
    assert "Below dense at the same cost: training FLOPs at d 128; training clock, run alone at d 128" in text
    assert text.endswith("Above: nowhere.")
    early = state_of(runs[:2])
    early["protocol"].update(state["protocol"])
    assert wr.headline(early).endswith("No CoMERA (early schedule) final has finished yet.")


def test_the_clock_alone_adds_each_stretch_of_the_counted_schedule_at_its_own_step_time():
    run = {"family": "comera", "width": 256, "steps": 10, "flops_per_step": [[0, 100], [4, 80], [6, 60], [10, 60]]}
    clock = {
        "step_s": {"comera/256/start": 1.0, "comera/256/end": 0.5, "dense/64/start": 0.2},
        "step_flops": {"comera/256/start": 100, "comera/256/end": 60, "dense/64/start": 7},
    }
    # 4 steps at 1 s, 2 at 0.75 s (80 FLOPs: halfway between the two shapes timed), 4 at 0.5 s
    assert wr.alone_seconds(run, clock) == pytest.approx(7.5)
    dense = {"family": "dense", "width": 64, "steps": 10, "flops_per_step": [[0, 7]]}
    assert wr.alone_seconds(dense, clock) == pytest.approx(2.0)
    assert wr.alone_seconds({**dense, "width": 128}, clock) is None  # not timed: no clock, never a guess


def test_the_clock_alone_is_absent_from_the_fronts_until_it_was_measured():
    run = finished(ws.Job("final", "dense", 64, "standard", 0, 0.01, 10), 3.0, flops_per_step=[[0, 1]])
    state = state_of([run])
    assert "train_s_alone" not in wr.finals(state)[0]
    state["clock_alone"] = {"step_s": {"dense/64/start": 0.5}, "step_flops": {"dense/64/start": 1}}
    assert wr.finals(state)[0]["train_s_alone"] == pytest.approx(5.0)


def test_a_layer_is_cut_to_the_ranks_a_run_ended_with_keeping_its_leading_slices():
    import torch

    from benchmarks.studies import width_clock as wc
    from comera_lightning.nn import TTLinear

    torch.manual_seed(0)
    model = torch.nn.Sequential(TTLinear(16, 16, rank=6, in_modes=[4, 4], out_modes=[4, 4]))
    layer = model[0]
    before = [core.detach().clone() for core in layer.cores]
    inner = layer.ranks[1:-1]
    wanted = [1, *[max(1, r - 2) for r in inner], 1]
    wc.cut_to_ranks_(model, {"0": wanted})
    assert layer.ranks == wanted
    for k, core in enumerate(layer.cores):  # every core keeps the leading slices of both its bonds
        assert torch.equal(core.detach(), before[k][: wanted[k], ..., : wanted[k + 1]])
    assert model(torch.randn(3, 16)).shape == (3, 16)
    with pytest.raises(RuntimeError, match="wanted"):
        wc.cut_to_ranks_(model, {"0": [1, *[r + 1 for r in wanted[1:-1]], 1]})  # cannot grow back


def test_later_seeds_run_only_at_the_widths_and_families_asked_for():
    p = plan(seed_widths=[128], seed_families=["tt"])
    p.seeds = [0, 1]
    runs = run_until(p, valley(lambda job: 0.02))
    finals = sorted((r["family"], r["width"], r["seed"]) for r in runs if r["phase"] == "final")
    assert finals == [("dense", 64, 0), ("dense", 256, 0), ("tt", 128, 0), ("tt", 128, 1), ("tt", 512, 0)]
    assert ws.final_widths([128, 512], "tt", 1, [0, 1]) == [128, 512]  # no restriction: every width
    cost = dict(params_active=1000, train_flops=1e9, train_s=1.0, flops_per_step=[[0, 1]], tokens=100)
    state = state_of([{**r, **cost} if r["phase"] == "final" else r for r in runs])
    state["protocol"].update(
        widths={"dense": [64, 256], "tt": [128, 512]}, seeds=[0, 1], seed_widths=[128], seed_families=["tt"]
    )
    state["protocol"].update(steps=100, sweep_steps=10, parameterization="mup")
    rendered = wr.render(state, "w", Path("/tmp/width_report_test"))
    assert "Finals finished: 4 of 4 at seed 0, and 1 of later seeds." in rendered


def test_the_compute_table_says_how_much_of_a_shapes_flops_went_to_the_cpus_zero_padding():
    run = finished(
        ws.Job("final", "tt", 512, "mup", 0, 0.01, 10), 3.0, flops_per_step=[[0, 200]], tokens=20, params_active=10
    )
    state = state_of([run])
    assert "not counted" in wr.compute_per_token(state)
    state["clock_alone"] = {
        "step_s": {},
        "step_flops": {"tt/512/start": 200},
        "step_flops_unpadded": {"tt/512/start": 180},
    }
    row = wr.compute_per_token(state).splitlines()[-1]
    assert row.endswith("| 10.0% |")


def test_comera_is_set_against_the_uniform_tt_seed_by_seed_at_each_width_both_trained():
    def final(family, width, seed, loss):
        return finished(ws.Job("final", family, width, "mup", seed, 0.01, 10), loss)

    runs = [final("comera", 128, 0, 4.0), final("comera", 128, 1, 4.2), final("tt", 128, 0, 4.1)]
    runs += [final("tt", 128, 1, 4.1), final("comera", 256, 0, 3.5), final("tt", 512, 0, 3.0)]
    state = state_of(runs)
    state["protocol"]["widths"] = {"comera": [128, 256], "tt": [128, 512]}
    assert wr.seed_lines(state) == [
        "- d 128, seeds 0, 1: CoMERA minus the uniform TT -0.100, +0.100 (mean +0.000); ahead in 1 of 2. "
        "The losses: CoMERA 4.000 / 4.200; the uniform TT 4.100 / 4.100."
    ]


def test_a_later_seed_is_read_off_its_own_dense_front_where_that_front_reaches():
    def final(family, width, seed, loss, cost):
        costs = dict(train_flops=cost * 1e12, params_active=int(cost * 1e5), flops_per_step=[[0, 1]])
        return finished(ws.Job("final", family, width, "mup", seed, 0.01, 10), loss, **costs)

    runs = [final("dense", 64, 1, 4.0, 1.0), final("dense", 128, 1, 3.0, 4.0)]
    runs += [final("comera", 512, 1, 3.6, 2.0), final("comera", 768, 1, 2.5, 8.0), final("dense", 64, 0, 9.0, 2.0)]
    lines = wr.later_seed_lines(state_of(runs))
    assert lines == [
        "- seed 1: CoMERA (early schedule) against dense at equal training FLOPs: d 512: 3.600 against 3.500 (+2.9%).",
        "- seed 1: CoMERA (early schedule) against dense at equal active parameters: d 512: 3.600 against 3.500 "
        "(+2.9%).",
    ]  # d 768 is beyond seed 1's dense front (no verdict, left out); seed 0's dense at 9.0 is not read


def test_the_clock_refuses_a_gpu_it_does_not_have_and_widths_the_study_did_not_finish(tmp_path, capsys, monkeypatch):
    import torch

    from benchmarks.studies import width_clock as wc

    run = finished(ws.Job("final", "dense", 64, "standard", 0, 0.01, 10), 3.0, flops_per_step=[[0, 1]])
    path = tmp_path / "width.json"
    path.write_text(json.dumps(state_of([run])))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in (
        (["--device", "cuda"], "torch sees no CUDA device here"),
        (["--widths", "128"], "no finished final run of seed 0 to time (widths: [128])"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            wc.main(["--out", str(path), *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert json.loads(path.read_text()) == state_of([run])  # nothing written
