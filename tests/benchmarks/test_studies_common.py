"""What the training studies share: their tasks' specs, the corpora, the models at another width, bad settings, the
worker pool and the study file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.studies import common as study


def test_corpus_roots():
    assert study.corpus_root("stdlib") is None
    assert Path(study.corpus_root("site:torch")).name == "torch"
    with pytest.raises(ValueError, match="no installed package folder"):
        study.corpus_root("site:no_such_package_here")
    with pytest.raises(ValueError, match="is not a folder"):
        study.corpus_root("/no/such/folder")


def test_the_masked_lm_is_the_quickstart_model_and_schedule():
    spec = study.study_spec("mlm", "stdlib", 3, None, quick=False)
    assert (spec.name, spec.seed, spec.steps, spec.late_start_step) == ("mlm", 3, 2000, 800)
    assert spec.task_kwargs["d_model"] == 128 and spec.rank_kwargs["target_compression"] == 20.0
    assert spec.data_kwargs["root"] is None  # the data modules' own default: the standard library
    quick = study.study_spec("mlm", "stdlib", 0, 30, quick=True)
    assert quick.task_kwargs["d_model"] == 64 and quick.steps == 30


def test_the_decoder_comes_from_its_config():
    spec = study.study_spec("lm", "stdlib", 0, 100, quick=False)
    assert spec.name == "lm" and spec.steps == 100


def test_a_wider_study_scales_the_full_model():
    wide = study.study_spec("mlm", "stdlib", 0, 100, quick=False, d_model=256)
    kwargs = wide.task_kwargs
    assert (kwargs["d_model"], kwargs["num_heads"], kwargs["d_ff"], wide.steps) == (256, 8, 1024, 100)
    assert kwargs["layer_config"].get("tt_linears", True)  # CoMERA's layers stay TT
    with pytest.raises(ValueError, match="d_model must be >= 1"):
        study.study_spec("mlm", "stdlib", 0, None, quick=False, d_model=0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown task"):
        study.study_spec("bert", "stdlib", 0, None, quick=True)
    spec = study.mlm_spec(quick=True)
    with pytest.raises(ValueError, match="late_fraction"):
        replace(spec, late_fraction=1.5).check()
    with pytest.raises(ValueError, match="steps must be >= 1"):
        replace(spec, steps=0).check()


def test_run_pool_runs_until_the_plan_is_empty_and_hands_failures_on():
    import math
    from concurrent.futures import ProcessPoolExecutor
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Job:
        x: float

        @property
        def key(self) -> float:
            return self.x

    done: dict[float, object] = {}

    def pending() -> list[Job]:
        # the second job only appears once the first has finished: the plan is asked again after each run
        return [Job(x) for x in ((4.0, -1.0) if 4.0 in done else (4.0,)) if x not in done]

    def submit(pool: ProcessPoolExecutor, job: Job):
        return pool.submit(math.sqrt, job.x)

    def finish(job: Job, outcome, wall_s: float) -> None:
        assert wall_s >= 0
        done[job.x] = outcome

    study.run_pool(pending, submit, finish, workers=2, threads=1, deadline=None)
    assert done[4.0] == 2.0
    assert isinstance(done[-1.0], ValueError)  # math domain error: recorded, not raised

    done.clear()
    study.run_pool(pending, submit, finish, workers=1, threads=1, deadline=0.0)  # past its deadline: starts nothing
    assert done == {}


def test_a_study_file_records_each_run_resumes_and_refuses_another_protocol(tmp_path):
    import json
    import math
    from dataclasses import dataclass

    from benchmarks.studies import driver

    @dataclass(frozen=True)
    class Job(driver.StudyJob):
        phase: str
        lr: float

    class Study(driver.StudyFile):
        FORMAT, FIXED, WALL_S = "test-study/1", ("grid",), True

        def failed(self, job: Job) -> dict:
            return {"tokens": 0}

    path = tmp_path / "study.json"
    study = Study(path, None, "lm", "stdlib", {"grid": [1e-3], "steps": 4})
    study._finish(Job("sweep", 1e-3), {"phase": "sweep", "lr": 1e-3, "val_loss": 2.0}, 3.0)
    study._finish(Job("sweep", 2e-3), ValueError("diverged"), 1.0)  # a failed run is recorded, not raised
    state = json.loads(path.read_text())
    assert state["format"] == "test-study/1" and (state["task"], state["corpus"]) == ("lm", "stdlib")
    ok, failed = state["runs"]
    assert ok["wall_s"] == 3.0 and "machine" in state
    assert failed["tokens"] == 0 and "diverged" in failed["error"] and math.isnan(failed["val_loss"])
    # a run's job is read back from its entry; the rates rounded, so a float's last bits do not make another job
    assert {Job.of(run).key for run in state["runs"]} == {Job("sweep", 1e-3).key, Job("sweep", 2e-3 + 1e-16).key}

    resumed = Study(path, None, "lm", "stdlib", {"grid": [1e-3], "steps": 8})  # only FIXED keys must match
    assert len(resumed.runs) == 2 and resumed.state["protocol"]["steps"] == 8
    refused = r"another protocol \(theirs, this one's: \{'grid': \(\[0\.001\], \[0\.002\]\)\}\); give another --out"
    with pytest.raises(ValueError, match=refused):
        Study(path, None, "lm", "stdlib", {"grid": [2e-3], "steps": 4})
