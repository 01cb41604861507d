"""The GPU checks' driver: it skips cleanly without CUDA, and its verdicts read the checks' own outputs."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import gpu_checks
import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip is for machines without CUDA")
def test_without_cuda_every_check_is_skipped(tmp_path, capsys):
    assert gpu_checks.main(["--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["skipped"] is True
    assert "no CUDA device: skipped" in capsys.readouterr().out
    assert not (tmp_path / "work").exists()


def test_bad_budgets_are_refused(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        gpu_checks.main(["--out", str(tmp_path), "--llm-budget-s", "0"])
    assert exit_info.value.code == 2


def _write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


def _fake_outputs(work: Path, *, step_speedup: float, graphs_speedup: float, comera_ppl: float) -> None:
    """What the four checks write, trimmed to the fields the summary reads."""
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
    step = {"global_step": 200, "truncations": 3, "rank_sum_start": 500, "rank_sum_end": 300, "checkpoint": "a"}
    _write(work / "fit_resume" / "fit_check.json", {"first": step, "resumed": {**step, "global_step": 240}})

    def run(method, ppl):
        return {
            "method": method,
            "tokens": 1000,
            "train_s": 2.0,
            "final": {"metrics": {"val/perplexity": ppl}, "compression_ratio": 1.0},
        }

    _write(work / "llm_60m" / "llm_study.json", {"runs": [run("dense", 30.0), run("comera", comera_ppl)]})


def test_summary_judges_every_target(tmp_path):
    work = tmp_path / "work"
    _fake_outputs(work, step_speedup=2.5, graphs_speedup=1.4, comera_ppl=29.0)
    (work / "fit_resume" / "last.ckpt").write_bytes(b"0" * 1000)  # checkpoints stay out of the archive
    status = {name: {"status": "ok", "wall_s": 1.0} for name in ("cuda_graphs", "training_step", "fit_resume", "llm")}
    gpu_checks.write_summary(tmp_path, work, status, {"cuda": "NVIDIA H200"})
    summary = json.loads((tmp_path / "summary.json").read_text())["results"]
    assert summary["memory_galore_over_comera_batch1"] == pytest.approx(10.0)
    assert summary["cuda_graphs_speedup_batch1"] == 1.4 and summary["step_batch"] == 32
    text = (tmp_path / "summary.md").read_text()
    assert "NVIDIA H200" in text and text.count("| met |") == 5 and "MISSED" not in text
    assert "aten::mm 40 %" in text  # the profile travels with the summary
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        names = tar.getnames()
    assert "gpu_checks/llm_60m/llm_study.json" in names and "gpu_checks/fit_resume/fit_check.json" in names
    assert not any(name.endswith(".ckpt") for name in names)


def test_summary_reports_misses_and_missing_checks(tmp_path):
    work = tmp_path / "work"
    _fake_outputs(work, step_speedup=1.5, graphs_speedup=1.1, comera_ppl=31.0)
    (work / "fit_resume" / "fit_check.json").unlink()
    gpu_checks.write_summary(
        tmp_path,
        work,
        {"fit_resume": {"status": "failed", "wall_s": 3.0, "detail": "exit 1"}},
        {"cuda": None, "cpu": "test CPU"},
    )
    text = (tmp_path / "summary.md").read_text()
    assert text.count("MISSED") == 3 and "| n/a |" in text and "exit 1" in text
