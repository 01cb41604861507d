"""Which weights an evaluation scores: ``--ckpt_path last`` finds the newest run's checkpoint, and no
``--ckpt_path`` at all says loudly that the weights are random."""

from __future__ import annotations

import os
import warnings

import pytest
from helpers.cli import CONFIGS, TINY_TRAINER, _tiny_overrides

from comera_lightning.cli import latest_checkpoint, main, missing_checkpoint_warning


def _checkpoint(root, experiment: str, run: str, mtime: float):
    path = root / experiment / run / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x")
    os.utime(path, (mtime, mtime))
    return path


def test_last_is_the_newest_runs_last_checkpoint(tmp_path):
    _checkpoint(tmp_path, "1", "aaa", 1_000)
    newest = _checkpoint(tmp_path, "2", "bbb", 3_000)
    _checkpoint(tmp_path, "1", "ccc", 2_000)
    (tmp_path / "fault_tolerance" / "quickstart-0123").mkdir(parents=True)  # not a run
    assert latest_checkpoint(tmp_path) == newest


def test_last_without_a_run_says_how_to_get_one(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train one first \(comera fit --config quickstart\)"):
        latest_checkpoint(tmp_path / "runs")


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_evaluating_without_a_checkpoint_names_the_flag(subcommand):
    message = missing_checkpoint_warning(subcommand, None)
    assert message is not None and "random" in message
    assert "--ckpt_path runs/<exp>/<run>/checkpoints/last.ckpt" in message and "--ckpt_path last" in message
    assert missing_checkpoint_warning(subcommand, "some.ckpt") is None
    assert missing_checkpoint_warning("fit", None) is None


@pytest.mark.slow
def test_validate_warns_without_a_checkpoint_and_last_finds_the_fit(workdir, rank_zero_said, capsys):
    from comera_lightning.cli import comera_cli

    messages = rank_zero_said(comera_cli)  # where ComeraCLI names the checkpoint --ckpt_path last found
    config = f"--config={CONFIGS / 'dlrm_criteo.yaml'}"
    overrides = [*_tiny_overrides("dlrm_criteo.yaml", workdir), *TINY_TRAINER]
    with pytest.warns(UserWarning, match=r"comera validate: no --ckpt_path.*random"):
        main(["validate", config, *overrides])

    with pytest.raises(SystemExit):  # no run yet
        main(["validate", config, *overrides, "--ckpt_path=last"])
    assert "comera fit --config quickstart" in capsys.readouterr().err

    main(["fit", config, *overrides])
    fitted = latest_checkpoint()  # runs/ of the working directory, as the CLI looks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["validate", config, *overrides, "--ckpt_path", "last"])
    assert f"comera: --ckpt_path last: {fitted}" in messages
    assert not [str(w.message) for w in caught if "random" in str(w.message)]

    out = workdir / "model.safetensors"
    main(["export", "--ckpt_path", "last", "--out", str(out)])
    assert out.is_file()
