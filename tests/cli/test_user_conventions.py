"""What a Lightning/MLflow user expects from `comera`: the final checkpoint, named runs, a step progress bar,
a summary at the end, quiet evaluation, optimisers and schedulers from the command line."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from helpers.cli import CONFIGS, TINY_TRAINER, _run, _tiny_overrides
from mlflow.tracking import MlflowClient

from comera_lightning.callbacks import StepProgressBar

QUICKSTART = f"--config={CONFIGS / 'quickstart.yaml'}"


def _overrides(workdir: Path) -> list[str]:
    return _tiny_overrides("quickstart.yaml", workdir / "mnli")


@pytest.mark.slow
def test_last_checkpoint_is_the_end_of_training_between_validation_checks(workdir, capsys):
    """max_steps 10 with validation every 4 steps: Lightning alone validates (and saves last.ckpt) at step 8."""
    cli = _run(
        "fit",
        QUICKSTART,
        *_overrides(workdir),
        *TINY_TRAINER,
        "--trainer.max_steps=10",
        "--trainer.limit_train_batches=null",
        "--trainer.max_epochs=null",
        "--trainer.val_check_interval=4",
        "--trainer.check_val_every_n_epoch=null",
    )
    last = Path(cli.trainer.checkpoint_callback.last_model_path)
    assert last.name == "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 10
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    steps = [m.step + 1 for m in client.get_metric_history(cli.trainer.logger.run_id, "val/loss")]
    assert steps == [4, 8, 10]

    summary = capsys.readouterr().out
    assert "comera: trained 10 steps" in summary
    assert "compression" in summary and "active parameters" in summary
    assert "val/loss" in summary and f"checkpoint: {last}" in summary
    assert cli.trainer.logger.run_id in summary and "mlflow ui --backend-store-uri sqlite:///" in summary
    # the run's own page in the UI's training view (MLflow 3 opens its GenAI view by default)
    logger = cli.trainer.logger
    link = (
        f"http://127.0.0.1:5000/#/experiments/{logger.experiment_id}/runs/{logger.run_id}?workflowType=machine_learning"
    )
    assert link in summary
    assert "best:" not in summary


@pytest.mark.slow
def test_runs_are_named_by_config_subcommand_and_time_and_evaluation_is_quiet(workdir):
    fit = _run("fit", QUICKSTART, *_overrides(workdir), *TINY_TRAINER)
    checkpoint = fit.trainer.checkpoint_callback.last_model_path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate = _run("validate", QUICKSTART, *_overrides(workdir), *TINY_TRAINER, f"--ckpt_path={checkpoint}")
    noise = [
        str(w.message)
        for w in caught
        if "Please add the following callbacks" in str(w.message) or "dirpath has changed" in str(w.message)
    ]
    assert not noise, noise
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    names = [client.get_run(cli.trainer.logger.run_id).info.run_name for cli in (fit, validate)]
    assert names[0].startswith("quickstart-fit-20") and names[1].startswith("quickstart-validate-20"), names
    assert "val/loss" in validate.trainer.callback_metrics


@pytest.mark.slow
def test_an_explicit_run_name_is_kept(workdir):
    cli = _run("fit", QUICKSTART, *_overrides(workdir), *TINY_TRAINER, "--trainer.logger.init_args.run_name=mine")
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    assert client.get_run(cli.trainer.logger.run_id).info.run_name == "mine"


@pytest.mark.slow
def test_progress_bar_counts_towards_max_steps_across_epochs(workdir, monkeypatch):
    monkeypatch.setattr("comera_lightning.cli.comera_cli._interactive_output", lambda: True)  # as on a terminal
    trainer_args = [
        a for a in TINY_TRAINER if "progress_bar" not in a and "limit_train_batches" not in a and "max_epochs" not in a
    ]
    cli = _run(
        "fit",
        QUICKSTART,
        *_overrides(workdir),
        *trainer_args,
        "--trainer.max_steps=9",
        "--data.max_sequences=200",
        "--data.val_fraction=0.5",
    )
    assert cli.trainer.current_epoch >= 1, "the run should cross an epoch boundary"
    bar = cli.trainer.progress_bar_callback
    assert isinstance(bar, StepProgressBar)
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.total, task.completed) == (9, 9)
    assert task.description.startswith("Steps") and "-2" not in task.description


@pytest.mark.slow
def test_optimizer_and_scheduler_from_the_command_line_keep_the_three_groups(workdir):
    cli = _run(
        "fit",
        QUICKSTART,
        *_overrides(workdir),
        *TINY_TRAINER,
        "--model.optim.warmup_steps=0",
        "--optimizer=torch.optim.SGD",
        "--optimizer.momentum=0.9",
        "--lr_scheduler=torch.optim.lr_scheduler.StepLR",
        "--lr_scheduler.step_size=3",
    )
    optimizer = cli.trainer.optimizers[0]
    assert type(optimizer) is torch.optim.SGD
    model = cli.model
    assert sorted(g["initial_lr"] for g in optimizer.param_groups) == sorted(
        [model.optim.lr_cores, model.optim.lr_gates, model.optim.lr_other]
    )
    assert all(g["momentum"] == 0.9 for g in optimizer.param_groups)
    scheduler = cli.trainer.lr_scheduler_configs[0].scheduler
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR and scheduler.step_size == 3


def test_scheduler_with_builtin_warmup_is_refused(workdir):
    with pytest.raises(ValueError, match=r"warmup_steps=100.*model.optim.warmup_steps 0"):
        _run(
            "fit",
            QUICKSTART,
            *_overrides(workdir),
            *TINY_TRAINER,
            "--lr_scheduler=torch.optim.lr_scheduler.StepLR",
            "--lr_scheduler.step_size=3",
        )


def test_runs_folder_is_ignored_by_git():
    ignored = (Path(__file__).resolve().parents[2] / ".gitignore").read_text().split()
    assert "runs/" in ignored


@pytest.mark.slow
def test_system_metrics_are_an_option_of_the_logger(workdir):
    pytest.importorskip("psutil")
    cli = _run(
        "fit",
        QUICKSTART,
        *_overrides(workdir),
        *TINY_TRAINER,
        "--trainer.max_steps=12",
        "--trainer.limit_train_batches=12",
        "--trainer.logger.init_args.log_system_metrics=true",
        "--trainer.logger.init_args.system_metrics_interval_s=0.2",
    )
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    keys = set(client.get_run(cli.trainer.logger.run_id).data.metrics)
    assert any(key.startswith("system/cpu_utilization") for key in keys), sorted(keys)


def test_system_metrics_interval_must_be_positive():
    from comera_lightning.loggers import ResilientMLFlowLogger

    with pytest.raises(ValueError, match="system_metrics_interval_s must be > 0"):
        ResilientMLFlowLogger(system_metrics_interval_s=0)


@pytest.mark.slow
def test_fit_exports_the_compact_model_to_mlflow_and_comera_export_writes_one(workdir, capsys):
    from comera_lightning.cli import main
    from comera_lightning.export import load_exported, load_exported_tokenizer, read_export_metadata

    cli = _run("fit", QUICKSTART, *_overrides(workdir), *TINY_TRAINER)
    run_id = cli.trainer.logger.run_id
    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    assert "model/model.safetensors" in {a.path for a in client.list_artifacts(run_id, "model")}
    exported = Path(cli.trainer.checkpoint_callback.dirpath).parent / "model.safetensors"
    assert f"compact model: {exported}" in capsys.readouterr().out
    assert read_export_metadata(exported)["size"]["compression_ratio"] > 1
    # the fit's export carries the data module's tokenizer: text in, the model's ids out
    tokenizer = load_exported_tokenizer(exported)
    text = "def f(x):\n    return x"
    assert tokenizer.encode(text).ids == cli.datamodule.tokenizer.encode(text).ids

    checkpoint = cli.trainer.checkpoint_callback.last_model_path
    out = workdir / "export" / "quickstart.safetensors"
    main(["export", f"--ckpt_path={checkpoint}", f"--out={out}"])
    assert "comera: wrote" in capsys.readouterr().out
    model = load_exported(out)
    batch = next(iter(cli.datamodule.val_dataloader()))
    cli.model.eval()
    with torch.no_grad():
        expected = cli.model.model.encoder(batch["input_ids"], batch.get("attention_mask"))
        assert torch.allclose(model.model.encoder(batch["input_ids"], batch.get("attention_mask")), expected, atol=1e-5)

    before = out.read_bytes()
    with pytest.raises(SystemExit) as refused:
        main(["export", f"--ckpt_path={checkpoint}", f"--out={out}"])
    assert refused.value.code == 2 and "overwrite" in capsys.readouterr().err
    assert out.read_bytes() == before


@pytest.mark.slow
def test_predict_writes_a_file_per_run_by_default(workdir, capsys):
    import json

    fit = _run("fit", QUICKSTART, *_overrides(workdir), *TINY_TRAINER)
    checkpoint = fit.trainer.checkpoint_callback.last_model_path
    capsys.readouterr()
    predict = _run(
        "predict",
        QUICKSTART,
        *_overrides(workdir),
        *TINY_TRAINER,
        f"--ckpt_path={checkpoint}",
        "--trainer.limit_predict_batches=2",
    )
    written = sorted((workdir / "runs" / "predictions").glob("quickstart-predict-*.jsonl"))
    assert len(written) == 1 and f"comera: predictions in {written[0].relative_to(workdir)}" in capsys.readouterr().out
    records = [json.loads(line) for line in written[0].read_text().splitlines()]
    assert records and {"true_id", "top_ids", "top_probs"} <= set(records[0])
    assert not predict.trainer.predict_loop.predictions  # kept in the file, not in memory
