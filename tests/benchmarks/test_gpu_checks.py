"""The GPU checks' driver: it skips cleanly without CUDA, its verdicts read the checks' own outputs (a check that
failed shows as FAILED whatever it left behind), and the fits' callbacks and probe do what the checks rely on."""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from benchmarks import gpu_checks


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip is for machines without CUDA")
def test_without_cuda_every_check_is_skipped(tmp_path, capsys):
    assert gpu_checks.main(["--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["skipped"] is True
    assert "no CUDA device: skipped" in capsys.readouterr().out
    assert not (tmp_path / "work").exists()


def test_a_deadline_that_is_no_time_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_checks.main(["--out", str(tmp_path), "--deadline-s", "0"])
    assert exit_info.value.code == 2 and "--deadline-s must be a positive number" in capsys.readouterr().err


def _write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


def _fake_fit(truncations: int = 3, val_loss: float = 5.0) -> dict:
    """A fit check's fit_check.json: the first fit cut ranks and the resume went on."""
    step = {
        "global_step": 200,
        "truncations": truncations,
        "rank_sum_start": 500,
        "rank_sum_end": 300,
        "checkpoint": "a",
        "probe": {"val_loss": val_loss},
    }
    return {"first": step, "resumed": {**step, "global_step": 250, "probe": {"val_loss": 4.9}}}


def _fake_compile(default_graphs: int = 4, overhead_error: str | None = None) -> dict:
    """The compile check's compile_check.json: eager at 10 steps/s, default mode 15, reduce-overhead 25."""

    def run(mode, steps_per_s, graphs):
        record = {"mode": mode, "global_step": 150, "max_steps": 150, "steps_per_s": steps_per_s}
        if mode is not None:
            record["compile"] = {"compiled": ["model.encoder"], "graphs": graphs, "graph_breaks": 0, "resets": 0}
        return record

    overhead = {"mode": "reduce-overhead", "error": overhead_error} if overhead_error else run("r-o", 25.0, 4)
    return {"eager": run(None, 10.0, 0), "default": run("default", 15.0, default_graphs), "reduce-overhead": overhead}


def _fake_width_study(comera_loss: float) -> dict:
    """A width study timed on the GPU: dense at d 64 (1 s of training, loss 3.0) and d 128 (3 s, 2.5); CoMERA at
    d 128 trains 2 s, where dense's front reads 2.685 (log-linear in time between its two points)."""

    def final(family: str, width: int, loss: float, flops: int) -> dict:
        run = {"phase": "final", "seed": 0, "family": family, "width": width, "val_loss": loss, "steps": 10}
        return {**run, "flops_per_step": [[0, flops]]}

    runs = [final("dense", 64, 3.0, 10), final("dense", 128, 2.5, 20), final("comera", 128, comera_loss, 30)]
    step_s = {"dense/64/start": 0.1, "dense/128/start": 0.3, "comera/128/start": 0.2}
    flops = {"dense/64/start": 10, "dense/128/start": 20, "comera/128/start": 30}
    return {"runs": runs, "clock_alone": {"step_s": step_s, "step_flops": flops}}


def _fake_outputs(work: Path, *, step_speedup: float, graphs_speedup: float, comera_loss: float) -> None:
    """What the six checks write, trimmed to the fields the summary reads."""
    _write(
        work / "cuda_graphs" / "cuda_graphs.json",
        {
            "skipped": False,
            "identity": [{"identical": True}, {"identical": True}],
            "timing": [
                {"size": "quickstart", "precision": "bf16-mixed", "batch": 1, "speedup": graphs_speedup},
                {"size": "quickstart", "precision": "bf16-mixed", "batch": 32, "speedup": 1.05},
            ],
        },
    )
    cands = {
        "dense+AdamW": {"skipped": None, "memory": {"total": 900}},
        "dense+GaLore": {"skipped": None, "memory": {"total": 1000}},
        "CoMERA r30": {"skipped": None, "memory": {"total": 100}},
    }
    _write(
        work / "training_step" / "training_step_cuda_bf16.json",
        {
            "results": {
                "1": {"candidates": cands, "ratios": {"time dense/CoMERA": 1.1}},
                "32": {"candidates": cands, "ratios": {"time dense/CoMERA": step_speedup}},
            },
            "profiles": {"32": {"why": "aten::mm 40 %"}},
        },
    )
    for name in gpu_checks.FIT_CHECKS:
        _write(work / name / "fit_check.json", _fake_fit())
    _write(work / "compile" / "compile_check.json", _fake_compile())
    _write(work / "width_clock" / "width_stdlib.json", _fake_width_study(comera_loss))


def test_summary_judges_every_target(tmp_path):
    work = tmp_path / "work"
    _fake_outputs(work, step_speedup=2.5, graphs_speedup=1.4, comera_loss=2.6)
    (work / "fit_resume" / "last.ckpt").write_bytes(b"0" * 1000)  # checkpoints stay out of the archive
    (work / "fsdp2" / "last.ckpt").mkdir()  # FSDP2's checkpoints are folders: left out with their shards
    (work / "fsdp2" / "last.ckpt" / "__0_0.distcp").write_bytes(b"0" * 1000)
    (work / "compile" / "eager" / "log.txt").parent.mkdir(parents=True)
    (work / "compile" / "eager" / "log.txt").write_text("fit log")
    names = ("cuda_graphs", "training_step", "fit_resume", "fsdp2", "compile", "width_clock")
    status = {name: {"status": "ok", "wall_s": 1.0} for name in names}
    gpu_checks.write_summary(tmp_path, work, status, {"cuda": "NVIDIA H200"})
    summary = json.loads((tmp_path / "summary.json").read_text())["results"]
    assert summary["memory_galore_over_comera_batch1"] == pytest.approx(10.0)
    assert summary["cuda_graphs_speedup_batch1"] == 1.4 and summary["step_batch"] == 32
    assert summary["fsdp2"]["resumed"]["global_step"] == 250 and summary["compile"]["default"]["steps_per_s"] == 15.0
    text = (tmp_path / "summary.md").read_text()
    assert "NVIDIA H200" in text and text.count("| met |") == 8 and "MISSED" not in text and "FAILED" not in text
    assert "aten::mm 40 %" in text  # the profile travels with the summary
    assert "| d 128: 2.600 against 2.685 (-3.1%) | met |" in text  # CoMERA read against dense's front in time
    # the compiled fits' steps/s as ratios to the eager fit of the same run
    assert "1.50x eager's steps/s" in text and "2.50x eager's steps/s" in text
    assert "val loss 5.000, 4.900, resumed to step 250" in text
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        names = tar.getnames()
    for kept in ("width_clock/width_stdlib.json", "fit_resume/fit_check.json", "fsdp2/fit_check.json"):
        assert f"gpu_checks/{kept}" in names
    assert "gpu_checks/compile/compile_check.json" in names and "gpu_checks/compile/eager/log.txt" in names
    assert not any(".ckpt" in name or name.endswith(".distcp") for name in names)


def test_summary_reports_misses_and_missing_checks(tmp_path):
    work = tmp_path / "work"
    _fake_outputs(work, step_speedup=1.5, graphs_speedup=1.1, comera_loss=2.8)
    (work / "fit_resume" / "fit_check.json").unlink()
    gpu_checks.write_summary(
        tmp_path,
        work,
        {"fit_resume": {"status": "failed", "wall_s": 3.0, "detail": "exit 1"}},
        {"cuda": None, "cpu": "test CPU"},
    )
    text = (tmp_path / "summary.md").read_text()
    assert text.count("MISSED") == 3 and "exit 1" in text
    assert _verdict(text, "bf16 fit") == "FAILED (failed)"
    # checks that left nothing and have no status (not reached) stay n/a
    (work / "fsdp2" / "fit_check.json").unlink()
    (work / "compile" / "compile_check.json").unlink()
    gpu_checks.write_summary(tmp_path, work, {}, {"cuda": None, "cpu": "test CPU"})
    text = (tmp_path / "summary.md").read_text()
    assert _verdict(text, "FSDP2") == "n/a" and _verdict(text, "Compile (default") == "n/a"


def _verdict(text: str, row: str) -> str:
    """The verdict of the one target row of summary.md that starts with ``row``."""
    found = [line for line in text.splitlines() if line.startswith(f"| {row}")]
    assert len(found) == 1, (row, found)
    return found[0].rstrip(" |").rsplit("| ", 1)[-1]


def test_failed_checks_never_pass_on_what_they_left(tmp_path):
    """A check that failed or timed out is FAILED even when its folder holds passing results (an earlier run's, or
    a fit that finished before a later one failed); a check not reached is n/a; a compiled fit that failed is
    FAILED beside one that finished."""
    work = tmp_path / "work"
    _fake_outputs(work, step_speedup=2.5, graphs_speedup=1.4, comera_loss=2.6)
    _write(work / "compile" / "compile_check.json", _fake_compile(overhead_error="exit 1"))
    status = {
        "fit_resume": {"status": "ok", "wall_s": 50.0},
        "fsdp2": {"status": "timed out", "wall_s": 75.0, "detail": "after 75 s"},
        "compile": {"status": "failed", "wall_s": 90.0, "detail": "exit 1: see compile/log.txt"},
        "width_clock": {"status": "not run (deadline)", "wall_s": 0.0},
    }
    gpu_checks.write_summary(tmp_path, work, status, {"cuda": "NVIDIA H100"})
    text = (tmp_path / "summary.md").read_text()
    assert _verdict(text, "bf16 fit") == "met"
    assert _verdict(text, "FSDP2") == "FAILED (timed out)"
    assert _verdict(text, "Compile (default") == "met"  # it finished before reduce-overhead failed
    assert _verdict(text, "Compile (reduce-overhead") == "FAILED"
    assert _verdict(text, "width study") == "n/a"
    # a compiled fit whose variant is missing altogether (the check stopped before it) is FAILED too
    compiled = _fake_compile()
    del compiled["reduce-overhead"]
    _write(work / "compile" / "compile_check.json", compiled)
    gpu_checks.write_summary(tmp_path, work, status, {"cuda": "NVIDIA H100"})
    assert _verdict((tmp_path / "summary.md").read_text(), "Compile (reduce-overhead") == "FAILED (failed)"


@pytest.mark.parametrize(
    ("fit", "graphs", "row"),
    [
        (_fake_fit(truncations=0), 4, "bf16 fit"),  # nothing truncated
        (_fake_fit(val_loss=float("nan")), 4, "FSDP2"),  # a diverged fit
        (_fake_fit(), 0, "Compile (default"),  # compiled nothing: the modules never ran through their forward
    ],
)
def test_fits_that_did_not_do_their_job_are_missed(tmp_path, fit, graphs, row):
    work = tmp_path / "work"
    _fake_outputs(work, step_speedup=2.5, graphs_speedup=1.4, comera_loss=2.6)
    _write(work / ("fsdp2" if row == "FSDP2" else "fit_resume") / "fit_check.json", fit)
    _write(work / "compile" / "compile_check.json", _fake_compile(default_graphs=graphs))
    gpu_checks.write_summary(tmp_path, work, {}, {"cuda": "NVIDIA H100"})
    text = (tmp_path / "summary.md").read_text()
    assert _verdict(text, row) == "MISSED" and text.count("MISSED") == 1


def test_fit_callbacks_follow_the_early_schedule(tmp_path):
    """tuned_study's comera_early: the late stage at 10 % of the steps, the target reached by 50 %."""
    config = yaml.safe_load(gpu_checks.rank_callbacks(200, tmp_path / "probe.jsonl"))["trainer"]["callbacks"]
    rank = config[0]["init_args"]
    assert config[0]["class_path"] == "RankAdaptation" and rank["late_start_step"] == 20
    assert rank["late_stage"]["init_args"] == {"ramp_steps": 80} and rank["truncate_every_n_steps"] == 20
    assert config[-1]["class_path"] == "ModelCheckpoint"
    masks_only = yaml.safe_load(gpu_checks.rank_callbacks(150, tmp_path / "p", truncate=False, checkpoint=False))
    callbacks = masks_only["trainer"]["callbacks"]
    assert callbacks[0]["init_args"]["truncate_every_n_steps"] is None
    assert [c["class_path"] for c in callbacks][-1] == "benchmarks.gpu_checks.FitProbe"


class _LoggingModel(BoringModel):
    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)["x"]
        self.log("val/loss", loss)
        return loss


def test_fit_probe_records_steps_timing_and_the_last_validation(tmp_path):
    probe = tmp_path / "probe.jsonl"
    for max_steps in (8, 10):  # two fits append two records
        trainer = Trainer(
            max_steps=max_steps,
            limit_val_batches=1,
            val_check_interval=4,
            callbacks=[gpu_checks.FitProbe(str(probe), warmup_steps=2)],
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(_LoggingModel())
    first, second = gpu_checks.read_probes(probe)
    assert first["global_step"] == first["max_steps"] == 8 and second["global_step"] == 10
    assert first["timed_steps"] == 5 and first["steps_per_s"] == pytest.approx(1 / first["median_step_s"])
    assert first["val_step"] == 8 and first["val_loss"] == first["val"]["val/loss"]
    assert first["strategy"] == "SingleDeviceStrategy" and "compile" not in first


def test_the_checks_run_in_order_within_the_deadline(tmp_path):
    *short, last = gpu_checks.checks(tmp_path, dry=False)
    assert (*(check.name for check in short), last.name) == gpu_checks.CHECK_NAMES
    # the short checks' caps fit the device run's 540 s deadline; the width clock takes what they leave
    assert sum(check.limit_s for check in short) <= 540
    with pytest.raises(SystemExit) as exit_info:
        gpu_checks.main(["--out", str(tmp_path), "--only", "no_such_check"])
    assert exit_info.value.code == 2


def test_a_failing_check_process_is_reported_failed(tmp_path, monkeypatch):
    """run_checks end to end with stand-in commands: the one that exits 3 is failed in the status and the summary,
    the checks not named in ``only`` do not run."""
    ok = [sys.executable, "-c", "print('fine')"]
    fails = [sys.executable, "-c", "raise SystemExit(3)"]
    fake = [gpu_checks.Check("cuda_graphs", [ok], 60), gpu_checks.Check("fsdp2", [ok, fails, ok], 60)]
    monkeypatch.setattr(gpu_checks, "checks", lambda work, dry: fake)
    lines: list[str] = []
    status = gpu_checks.run_checks(tmp_path, False, 540.0, lines.append, only=["cuda_graphs", "fsdp2"])
    assert list(status) == ["cuda_graphs", "fsdp2"]
    assert status["cuda_graphs"]["status"] == "ok" and status["fsdp2"]["status"] == "failed"
    assert "exit 3" in status["fsdp2"]["detail"] and (tmp_path / "work" / "fsdp2" / "log.txt").read_text() == "fine\n"
    assert _verdict((tmp_path / "summary.md").read_text(), "FSDP2") == "FAILED (failed)"
