"""Installed, not cloned: a wheel built from this tree, in a fresh venv, away from the checkout, runs the
quickstart by name, finds the callback fragments and answers to ``python -m comera_lightning``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--model.d_model=32",
    "--model.num_heads=2",
    "--model.d_ff=64",
    "--model.num_layers=1",
    "--model.max_len=16",
    "--model.vocab_size=512",
    "--model.layer_config.rank=4",
    "--model.layer_config.embedding_rank=4",
    "--model.layer_config.min_features=16",
    "--model.optim.warmup_steps=0",
    "--data.vocab_size=512",
    "--data.seq_len=16",
    "--data.batch_size=8",
    "--data.max_files=10",
    "--data.max_sequences=200",
    "--trainer.max_steps=3",
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


#: builds and installs the wheel once, then runs from it: all of it is slow
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A venv holding only the built wheel; the dependencies come from the test environment's
    site-packages through a ``.pth`` file (which does not run the checkout's editable-install hook)."""
    root = tmp_path_factory.mktemp("wheel")
    # build from a copy: setuptools' build/ folder in the checkout could carry stale modules into the wheel
    source = root / "source"
    shutil.copytree(
        REPO,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".*", "build", "dist", "runs", "mlruns", "mlflow.db", "benchmarks", "docs", "tests", "*.egg-info"
        ),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(root / "dist"), str(source)],
        check=True,
        cwd=root,
    )
    wheel = next((root / "dist").glob("comera_lightning-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "test_env_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)], check=True
    )
    work = root / "work"
    work.mkdir()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db", "PYTHONPATH": ""}
    return venv, env


def _run(venv: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    cwd = Path(env["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///")).parent
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_wheel_is_imported_not_the_checkout(installed):
    venv, env = installed
    found = _run(
        venv, env, str(venv / "bin" / "python"), "-c", "import comera_lightning; print(comera_lightning.__file__)"
    )
    assert found.returncode == 0, found.stderr
    assert str(venv) in found.stdout and str(REPO) not in found.stdout


def test_configs_and_fragments_are_installed_and_listed(installed):
    venv, env = installed
    listed = _run(venv, env, str(venv / "bin" / "python"), "-m", "comera_lightning", "configs")
    assert listed.returncode == 0, listed.stderr
    names = {line.split()[0] for line in listed.stdout.splitlines()}
    assert {"quickstart", "mnli_6enc", "callbacks/rank_adaptation", "callbacks/rank_monitor"} <= names
    path = _run(venv, env, str(venv / "bin" / "comera"), "configs", "callbacks/rank_adaptation")
    assert path.returncode == 0 and Path(path.stdout.strip()).is_file() and str(venv) in path.stdout


def test_quickstart_by_name_with_a_fragment_fits_from_the_wheel(installed):
    venv, env = installed
    fit = _run(
        venv,
        env,
        str(venv / "bin" / "comera"),
        "fit",
        "--config",
        "quickstart",
        "--config=callbacks/divergence_guard.yaml",
        *TINY,
    )
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "comera: trained 3 steps" in fit.stdout and "last.ckpt" in fit.stdout


def test_an_unknown_config_name_fails_clearly(installed):
    venv, env = installed
    failed = _run(venv, env, str(venv / "bin" / "comera"), "fit", "--config", "no_such_config")
    assert failed.returncode != 0
    assert "no_such_config" in failed.stderr
