"""Fixtures shared across test folders."""

from __future__ import annotations

import pytest

from comera_lightning.data import write_synthetic_mnli


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run in a temp directory with its own MLflow store and caches."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    write_synthetic_mnli(tmp_path / "mnli", num_train=256, num_val=64, fmt="tsv", seed=0)
    return tmp_path
