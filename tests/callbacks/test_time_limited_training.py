"""Training bounded by time only (Trainer(max_time=...)): warmup works, decay schedules refuse clearly, and a
RankAdaptation whose switch rule is an overridden policy (e.g. a wall-clock one) really reaches its late stage."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from tiny import TinyRegressor, regression_loader
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from comera_lightning.callbacks import RankAdaptation
from comera_lightning.lit.base import ComeraTask
from comera_lightning.nn import TTLinear
from comera_lightning.optim import OptimConfig


class _TinyTask(ComeraTask):
    def __init__(self, **schedule) -> None:
        super().__init__(OptimConfig(lr_cores=1e-2, lr_gates=1e-2, lr_other=1e-2, **schedule))
        self.model = nn.Sequential(TTLinear(16, 16, 4), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _time_limited_trainer(tmp_path, **kwargs) -> Trainer:
    # max_epochs=-1: no epoch or step limit, only the clock (what Trainer(max_time=...) users run)
    return Trainer(
        max_time={"seconds": 2},
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


def test_constant_schedule_with_warmup_trains_under_a_time_limit(tmp_path):
    task = _TinyTask(warmup_steps=5)
    trainer = _time_limited_trainer(tmp_path)
    trainer.fit(task, _loader())
    assert trainer.global_step > 5
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2)  # warmed up, then constant


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decaying_schedule_without_a_step_limit_is_refused_clearly(tmp_path, schedule):
    task = _TinyTask(schedule=schedule)
    trainer = _time_limited_trainer(tmp_path)
    with pytest.raises(ValueError, match=r"max_steps|max_epochs"):
        trainer.fit(task, _loader())


class _SwitchAtStep3(RankAdaptation):
    def should_enter_late_stage(self, trainer: Trainer) -> bool:
        return trainer.global_step >= 3


def test_overridden_switch_policy_reaches_the_late_stage(tmp_path):
    torch.manual_seed(0)
    callback = _SwitchAtStep3(target_compression=2.0)
    trainer = Trainer(
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[callback],
    )
    trainer.fit(TinyRegressor(), regression_loader())
    assert callback.switch_step == 3
    assert callback.loss_ema is not None
