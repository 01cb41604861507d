"""A small plain LightningModule (not one of ours) that tensorizes its own MLP, for callback tests."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from comera_lightning import tensorize
from comera_lightning.optim import comera_parameter_groups


class TinyRegressor(LightningModule):
    def __init__(self, rank: int = 8, lr: float = 1e-2, lr_gates: float = 5e-2, width: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, 32))
        self.records = tensorize(self.net, rank=rank, min_features=16)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y))

    def configure_optimizers(self):
        groups = comera_parameter_groups(
            self, lr_cores=self.hparams.lr, lr_gates=self.hparams.lr_gates, lr_other=self.hparams.lr
        )
        return torch.optim.AdamW(groups, weight_decay=0.0)


def regression_loader(n: int = 256, batch_size: int = 32, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    teacher = torch.randn(32, 4, generator=g) @ torch.randn(4, 32, generator=g) / 4
    y = torch.tanh(x @ teacher)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
