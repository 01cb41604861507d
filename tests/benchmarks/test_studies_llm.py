"""The decoder study: config values changed from the command line, runs resized to a budget, the GPU options' errors,
and the matched protocol end to end on a text corpus in bf16 (the path the GPU check takes, on the CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.studies import common as study
from benchmarks.studies import llm as llm_study
from benchmarks.studies.common import REPO

LLM_60M = REPO / "configs" / "llm_60m.yaml"


def test_spec_from_a_text_config_keeps_its_datamodule_and_recipe():
    spec = study.spec_from_config(LLM_60M)
    assert spec.datamodule == "TextLMDataModule"
    assert spec.task_kwargs["layer_config"]["low_rank_linears"] == "lm_head"
    assert spec.task_kwargs["optim"]["schedule"] == "cosine"
    assert spec.late_fraction == pytest.approx(0.1)  # late_start_fraction
    assert "late_start_fraction" not in spec.rank_kwargs
    assert spec.rank_kwargs["late_stage"].ramp_fraction == 0.45  # the config's policy, built as the CLI would


def test_a_config_that_starts_the_late_stage_at_a_step(tmp_path):
    # the study places the switch itself (spec.late_fraction), so the step leaves the callback's arguments
    config = tmp_path / "llm.yaml"
    config.write_text(
        LLM_60M.read_text().replace("late_start_fraction: 0.1", "late_start_step: 2500"), encoding="utf-8"
    )
    spec = study.spec_from_config(config)
    assert spec.late_fraction == pytest.approx(0.25) and spec.late_start_step == 2500
    assert "late_start_fraction" not in spec.rank_kwargs and "late_start_step" not in spec.rank_kwargs


def test_overrides_set_nested_values_as_yaml():
    spec = study.spec_from_config(LLM_60M)
    study.apply_overrides(
        spec,
        [
            "data.root=stdlib",
            "data.val_files=null",
            "model.optim.warmup_steps=7",
            "rank.gamma=0.01",
            "data.files='**/*.py'",
        ],
    )
    assert spec.data_kwargs["root"] == "stdlib" and spec.data_kwargs["val_files"] is None
    assert spec.data_kwargs["files"] == "**/*.py"
    assert spec.task_kwargs["optim"]["warmup_steps"] == 7 and spec.task_kwargs["optim"]["schedule"] == "cosine"
    assert spec.rank_kwargs["gamma"] == 0.01


@pytest.mark.parametrize("item", ["data.root", "trainer.max_steps=3", "model=3"])
def test_overrides_refuse_what_they_cannot_place(item):
    spec = study.spec_from_config(LLM_60M)
    with pytest.raises(ValueError, match=r"SECTION.KEY=VALUE"):
        study.apply_overrides(spec, [item])


def test_run_length_keeps_every_interval_share_of_the_run():
    spec = study.spec_from_config(LLM_60M)  # 10000 steps, warmup 1000, truncation every 500, validation 1000
    short = llm_study.run_length(spec, 1000)
    assert short.steps == 1000 and short.late_start_step == 100
    assert short.task_kwargs["optim"]["warmup_steps"] == 100
    assert short.rank_kwargs["truncate_every_n_steps"] == 50 and short.val_every == 100
    assert spec.task_kwargs["optim"]["warmup_steps"] == 1000  # the original is left as it was
    tiny = llm_study.run_length(spec, 3)
    assert tiny.rank_kwargs["truncate_every_n_steps"] >= 1 and tiny.val_every >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_cuda_without_a_gpu_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        llm_study.main(["--accelerator", "cuda", "--quick", "--out-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_matched_protocol_on_a_text_corpus_in_bf16(tmp_path):
    argv = [
        "--quick",
        "--config",
        str(LLM_60M),
        "--protocols",
        "matched",
        "--methods",
        "dense",
        "comera",
        "--precision",
        "bf16-mixed",
        "--budget-s",
        "1.5",
        "--threads",
        "1",
        "--out-dir",
        str(tmp_path),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--set",
        "data.root=stdlib",
        "--set",
        "data.files='email/*.py'",
        "--set",
        "data.val_files=null",
        "--set",
        "data.tokenizer_path=null",
        "--set",
        "data.num_workers=0",
        "--set",
        "data.val_fraction=0.2",
    ]
    assert llm_study.main(argv) == 0
    result = json.loads((tmp_path / "llm_study.json").read_text())
    assert result["spec"]["precision"] == "bf16-mixed" and result["spec"]["datamodule"] == "TextLMDataModule"
    measured = result["step_measurements"][0]["methods"]
    runs = {r["method"]: r for r in result["runs"]}
    assert set(runs) == {"dense", "comera"}
    for method, run in runs.items():
        # each method trains the budget over its own measured step time
        assert run["protocol"] == "matched"
        assert run["steps"] == max(1, round(1.5 / measured[method]["median_s"]))
        assert torch.isfinite(torch.tensor(run["final"]["metrics"]["val/perplexity"]))
    assert runs["comera"]["final"]["compression_ratio"] > 1.0
    assert "tokens/s" in (tmp_path / "llm_study.md").read_text()


def test_a_corpus_too_small_to_validate_on_is_refused_by_name(tmp_path):
    argv = [
        "--quick",
        "--config",
        str(LLM_60M),
        "--protocols",
        "steps",
        "--methods",
        "dense",
        "--steps",
        "2",
        "--threads",
        "1",
        "--out-dir",
        str(tmp_path),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--set",
        "data.root=stdlib",
        "--set",
        "data.files='json/*.py'",
        "--set",
        "data.val_files=null",
        "--set",
        "data.tokenizer_path=null",
        "--set",
        "data.num_workers=0",
        "--set",
        "data.val_fraction=0.01",
    ]
    with pytest.raises(ValueError, match=r"validation set is empty .* data.val_fraction"):
        llm_study.main(argv)
