"""Fixtures shared across test folders."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from comera_lightning.data import write_synthetic_mnli


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same random state of torch, NumPy and Python's ``random`` (a folder's conftest
    may seed torch again with its own seed); a test that wants other draws seeds its own generator."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run in a temp directory with its own MLflow store and caches."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    write_synthetic_mnli(tmp_path / "mnli", num_train=256, num_val=64, fmt="tsv", seed=0)
    return tmp_path


@pytest.fixture
def rank_zero_said(monkeypatch):
    """``rank_zero_said(module)``: the list that collects every ``rank_zero_info`` message ``module`` sends from now
    on. Read from the call, not from logging: whether Lightning's loggers reach pytest's capture depends on which
    tests ran first."""

    def record(module) -> list[str]:
        said: list[str] = []
        monkeypatch.setattr(module, "rank_zero_info", lambda message, *args, **kwargs: said.append(str(message)))
        return said

    return record
