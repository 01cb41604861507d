"""The models, data and callbacks that tests/test_sharding.py runs in one process and under FSDP2 in two."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from comera_lightning.callbacks import RankAdaptation, ScheduledLateStage
from comera_lightning.strategies import shard_model
from tests.tiny import TinyRegressor, regression_loader

BATCH = 16  # per process; the one-process reference takes both halves at once


class ShardedRegressor(TinyRegressor):
    """A user's LightningModule with the one call that FSDP2-shards it (nothing under DDP or on one device)."""

    def configure_model(self) -> None:
        shard_model(self)


class DenseRegressor(ShardedRegressor):
    """The same with plain ``nn.Linear`` layers, for the ``Tensorize`` callback to swap."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))


def parity_loader(batch: int) -> DataLoader:
    """The data of the parity runs: ``BATCH`` per process under FSDP2 (Lightning adds a shuffling
    ``DistributedSampler``); with ``2 * BATCH``, the one-process loader whose every batch is the union of the two
    processes' batches at that step."""
    loader = regression_loader(n=16 * BATCH, batch_size=batch)
    if batch == BATCH:
        return loader
    return DataLoader(loader.dataset, batch_sampler=_UnionOfShards(loader.dataset, processes=2))


class _UnionOfShards(Sampler):
    """Per step, the indices that ``processes`` shuffling ``DistributedSampler`` s (Lightning's) give together."""

    def __init__(self, dataset, processes: int) -> None:
        self.samplers = [
            DistributedSampler(dataset, num_replicas=processes, rank=r, shuffle=True) for r in range(processes)
        ]

        self.epoch = 0  # counted here: Lightning sets the epoch of its own samplers, not of a batch sampler

    def __len__(self) -> int:
        return len(self.samplers[0]) // BATCH

    def __iter__(self):
        for sampler in self.samplers:
            sampler.set_epoch(self.epoch)
        self.epoch += 1
        shards = [list(s) for s in self.samplers]
        for i in range(len(self)):
            yield [j for shard in shards for j in shard[i * BATCH : (i + 1) * BATCH]]


def truncation_loader(batch: int):
    # one batch per epoch: a resumed run sees the same data as the uninterrupted one, wherever it restarts
    return regression_loader(n=2 * BATCH, batch_size=batch)


def parity_callbacks() -> list:
    return [RankAdaptation(gamma=0.3, truncate_every_n_steps=None)]


def truncation_callbacks() -> list:
    """Rank adaptation that cuts within a few steps: slices removed every 2 steps from step 2, truncated every 4."""
    late = ScheduledLateStage(ramp_steps=8, cut_every_n_steps=2, max_cut_fraction=0.25, loss_tolerance=10.0)
    return [
        RankAdaptation(
            late_start_step=2, target_compression=4.0, late_stage=late, truncate_every_n_steps=4, min_dead_fraction=0.1
        )
    ]
