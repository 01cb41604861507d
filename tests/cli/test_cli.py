"""The `comera` CLI end to end: every shipped config, fit and validate at tiny sizes, MLflow read back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.cli import CONFIGS, TINY_TRAINER, _callbacks_config, _run, _small_source_tree, _tiny_overrides
from mlflow.tracking import MlflowClient

from comera_lightning.callbacks import PaperLateStage, RankAdaptation, ScheduledLateStage
from comera_lightning.nn import tt_layers


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_print_config(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run("fit", f"--config={CONFIGS / name}", "--print_config")
    assert exit_info.value.code == 0
    assert "class_path" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_config_fits_and_validates_tiny(name, workdir):
    overrides = _tiny_overrides(name, workdir / "mnli")
    cli = _run("fit", f"--config={CONFIGS / name}", *overrides, *TINY_TRAINER)
    assert cli.trainer.global_step == 6
    checkpoint = Path(
        cli.trainer.checkpoint_callback.last_model_path or cli.trainer.checkpoint_callback.best_model_path
    )
    assert checkpoint.is_file() and checkpoint.resolve().is_relative_to(workdir / "runs")
    validated = _run("validate", f"--config={CONFIGS / name}", *overrides, *TINY_TRAINER, f"--ckpt_path={checkpoint}")
    assert validated.trainer.callback_metrics, "validate produced no metrics"


@pytest.mark.slow
def test_quickstart_tracks_ranks_in_mlflow_and_validates_truncated_checkpoint(workdir):
    config = CONFIGS / "quickstart.yaml"
    overrides = _tiny_overrides("quickstart.yaml", workdir / "mnli")
    shrink = [
        "--trainer.max_steps=24",
        "--trainer.limit_train_batches=24",
        "--model.optim.lr_gates=0.2",
        "--model.optim.warmup_steps=0",
        f"--config={_callbacks_config(workdir, gamma=1.0, late_start_step=8, truncate_every_n_steps=8)}",
    ]
    cli = _run("fit", f"--config={config}", *overrides, *TINY_TRAINER, *shrink)
    adaptation = next(c for c in cli.trainer.callbacks if isinstance(c, RankAdaptation))
    assert adaptation.truncations >= 1, "no truncation happened in the tiny quickstart"

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    run_id = cli.trainer.logger.run_id
    keys = set(client.get_run(run_id).data.metrics)
    assert "train/loss" in keys and "compression_ratio" in keys
    rank_keys = [k for k in keys if k.startswith("rank/")]
    assert rank_keys
    history = client.get_metric_history(run_id, "compression_ratio")
    assert history[-1].value > history[0].value
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert "config.yaml" in artifacts
    assert {a.path for a in client.list_artifacts(run_id, "comera")} >= {
        "comera/rank_evolution.png",
        "comera/rank_history.json",
    }

    checkpoint = cli.trainer.checkpoint_callback.last_model_path
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    validated = _run("validate", f"--config={config}", *overrides, *TINY_TRAINER, f"--ckpt_path={checkpoint}")
    layers = tt_layers(validated.model)
    assert layers
    for name, layer in layers:  # the model was built with full ranks and adopted the checkpoint's
        for k, core in enumerate(layer.cores):
            assert core.shape == saved[f"{name}.cores.{k}"].shape
    assert "val/loss" in validated.trainer.callback_metrics


@pytest.mark.slow
def test_quickstart_runs_under_ddp_spawn_and_bf16(workdir, capfd):
    overrides = _tiny_overrides("quickstart.yaml", workdir / "mnli")
    _run(
        "fit",
        f"--config={CONFIGS / 'quickstart.yaml'}",
        *overrides,
        *TINY_TRAINER,
        "--trainer.strategy=ddp_spawn",
        "--trainer.devices=2",
        "--trainer.max_steps=4",
    )
    # TT gradients come in their parameters' layout: DDP copies nothing extra into its buckets
    assert "Grad strides do not match bucket view strides" not in capfd.readouterr().err
    cli = _run(
        "fit", f"--config={CONFIGS / 'quickstart.yaml'}", *overrides, *TINY_TRAINER, "--trainer.precision=bf16-mixed"
    )
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def test_unknown_key_and_bad_type_fail_clearly(workdir, capsys):
    with pytest.raises(SystemExit):
        _run("fit", f"--config={CONFIGS / 'quickstart.yaml'}", "--model.no_such_option=1")
    assert "no_such_option" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _run("fit", f"--config={CONFIGS / 'quickstart.yaml'}", "--trainer.max_steps=many")
    assert "max_steps" in capsys.readouterr().err


@pytest.mark.slow
def test_quickstart_validates_by_global_step_across_epochs_on_a_small_corpus(workdir):
    """A corpus with fewer batches per epoch than val_check_interval still trains and validates every
    val_check_interval optimiser steps, across epoch boundaries (the config validates by global step)."""
    root = _small_source_tree(workdir / "small_src")
    overrides = _tiny_overrides("quickstart.yaml", workdir / "mnli")
    small = [
        f"--data.root={root}",
        "--data.max_files=null",
        "--data.max_sequences=40",
        "--data.val_fraction=0.2",
        "--trainer.max_steps=21",
        "--trainer.val_check_interval=7",
        "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
    ]
    cli = _run("fit", f"--config={CONFIGS / 'quickstart.yaml'}", *overrides, *small)
    assert cli.trainer.num_training_batches == 5  # 40 rows / batch 8: fewer than val_check_interval
    assert cli.trainer.global_step == 21 and cli.trainer.current_epoch >= 4
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    steps = [m.step for m in client.get_metric_history(cli.trainer.logger.run_id, "val/loss")]
    # Lightning logs what happens after optimiser step k (its training loss, a validation) at logger step k - 1
    assert [s + 1 for s in steps] == [7, 14, 21], f"validated after optimiser steps {[s + 1 for s in steps]}"


def test_binary_corpus_is_refused_up_front_naming_the_files(workdir):
    """A source tree of binary .py files fails before training with the files and the fix, not with
    Lightning's unrelated val_check_interval message."""
    root = workdir / "binary_src"
    root.mkdir()
    for i in range(7):
        (root / f"blob{i}.py").write_bytes(bytes(range(256)) * 16)
    overrides = _tiny_overrides("quickstart.yaml", workdir / "mnli")
    with pytest.raises(ValueError) as info:
        _run("fit", f"--config={CONFIGS / 'quickstart.yaml'}", *overrides, *TINY_TRAINER, f"--data.root={root}")
    message = str(info.value)
    assert "binary" in message and str(root) in message and "7 of the 7 file(s)" in message
    assert "blob0.py, blob1.py, blob2.py, blob3.py, blob4.py and 2 more" in message
    assert "root=" in message and "val_check_interval" not in message


@pytest.mark.slow
@pytest.mark.parametrize(
    "late_stage",
    [
        "paper",
        '{"class_path": "comera_lightning.callbacks.ScheduledLateStage", '
        '"init_args": {"ramp_steps": 8, "cut_every_n_steps": 2, "max_cut_fraction": 0.5}}',
    ],
)
def test_late_stage_policy_from_yaml(workdir, late_stage):
    overrides = _tiny_overrides("quickstart.yaml", workdir / "mnli")
    config = _callbacks_config(workdir, late_start_step=4, target_compression=15.0, late_stage=late_stage)
    cli = _run(
        "fit",
        f"--config={CONFIGS / 'quickstart.yaml'}",
        *overrides,
        *TINY_TRAINER,
        "--trainer.max_steps=16",
        "--trainer.limit_train_batches=16",
        f"--config={config}",
    )
    adaptation = next(c for c in cli.trainer.callbacks if isinstance(c, RankAdaptation))
    assert adaptation.stage == 1
    if late_stage == "paper":
        assert isinstance(adaptation.late_stage, PaperLateStage)
    else:
        assert isinstance(adaptation.late_stage, ScheduledLateStage) and adaptation.late_stage.ramp == 8
        assert adaptation.late_stage.slices_cut > 0
