"""CoMERA under FSDP2 (comera_lightning.strategies), on the CPU with two gloo processes against one process.

The two-process runs start through Lightning's own launcher, which runs its script again for the second process,
so they live in tests/helpers/fsdp_worker.py; one launch runs them all (Lightning's import dominates).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from comera_lightning import load_from_checkpoint
from comera_lightning.callbacks import RankAdaptation
from comera_lightning.export import export_checkpoint, load_exported
from comera_lightning.nn import TTLinear
from comera_lightning.nn.distributed import full_tensor, is_sharded, write_full_
from comera_lightning.nn.tensorize import tt_layers
from comera_lightning.strategies import FSDP2Strategy, checkpoint_shapes, shard_model
from comera_lightning.strategies.resharding import default_shard_units, fully_shard_model
from comera_lightning.utilities.checkpoint_io import read_checkpoint
from tests.helpers.sharding_cases import (
    BATCH,
    DenseRegressor,
    ShardedRegressor,
    parity_callbacks,
    parity_loader,
    truncation_callbacks,
    truncation_loader,
)

WORKER = Path(__file__).parent / "helpers" / "fsdp_worker.py"


def _fit_one_process(callbacks: list, max_steps: int, loader, folder: Path | None = None) -> ShardedRegressor:
    """The one-process reference; with ``folder``, checkpoints after 8 steps to ``folder/single-step=8.ckpt``."""
    model = ShardedRegressor()
    if folder is not None:
        callbacks = [
            *callbacks,
            ModelCheckpoint(dirpath=folder, filename="single-{step}", every_n_train_steps=8, save_top_k=-1),
        ]
    Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=folder is not None,
        limit_val_batches=0,
        callbacks=callbacks,
    ).fit(model, loader)
    return model


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """Runs every two-process scenario once; returns the folder with their results and checkpoints."""
    out = tmp_path_factory.mktemp("fsdp2")
    single = _fit_one_process(truncation_callbacks(), 16, truncation_loader(2 * BATCH), folder=out)
    (out / "single.json").write_text(json.dumps({"losses": single.losses}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(WORKER), str(out)], cwd=out, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _results(out: Path, scenario: str) -> list[dict]:
    return [json.loads((out / f"{scenario}.rank{r}.json").read_text()) for r in range(2)]


def _global_losses(results: list[dict]) -> list[float]:
    # each process saw half of the batch: the mean of the halves' mean losses is the whole batch's
    return [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"], strict=True)]


@pytest.mark.slow
def test_loss_parity_with_one_process(two_processes):
    results = _results(two_processes, "parity")
    assert all(r["sharded"] for r in results), "the model was not sharded"
    reference = _fit_one_process(parity_callbacks(), 50, parity_loader(2 * BATCH)).losses
    sharded = _global_losses(results)
    assert len(sharded) == len(reference) == 50
    worst = max(abs(a - b) / abs(b) for a, b in zip(sharded, reference, strict=True))
    assert worst <= 1e-5, worst


@pytest.mark.slow
def test_truncation_gives_the_ranks_of_one_process_and_shrinks_the_shards(two_processes):
    results = _results(two_processes, "truncation")
    reference = _fit_one_process(truncation_callbacks(), 16, truncation_loader(2 * BATCH))
    ranks = {name: layer.ranks for name, layer in tt_layers(reference)}
    assert ranks != {name: layer.ranks for name, layer in tt_layers(ShardedRegressor())}, "nothing was cut"
    assert results[0]["ranks"] == results[1]["ranks"] == ranks
    assert "FSDP2Strategy" in results[0]["refused"]  # TTLayer.truncate_() on sharded parameters names the fix
    initial = sum(p.numel() for p in ShardedRegressor().parameters())
    assert sum(r["local_parameters"] for r in results) == sum(p.numel() for p in reference.parameters()) < initial
    worst = max(abs(a - b) / abs(b) for a, b in zip(_global_losses(results), reference.losses, strict=True))
    assert worst <= 1e-5, worst


@pytest.mark.slow
def test_resume_from_the_sharded_checkpoint_equals_the_uninterrupted_run(two_processes):
    folder = two_processes / "ckpt" / "step=8.ckpt"
    assert folder.is_dir()
    shapes = checkpoint_shapes(folder)
    initial = {name: tuple(p.shape) for name, p in ShardedRegressor().named_parameters()}
    assert any(shapes[name] != shape for name, shape in initial.items()), "the checkpoint holds the initial ranks"
    uninterrupted, resumed = _results(two_processes, "truncation"), _results(two_processes, "resume")
    assert _global_losses(resumed) == _global_losses(uninterrupted)[8:]
    assert resumed[0]["ranks"] == uninterrupted[0]["ranks"]


@pytest.mark.slow
def test_a_one_process_checkpoint_after_cuts_resumes_under_fsdp2(two_processes):
    single = json.loads((two_processes / "single.json").read_text())["losses"]
    resumed = _results(two_processes, "resume_from_file")
    assert resumed[0]["ranks"] == _results(two_processes, "truncation")[0]["ranks"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(_global_losses(resumed), single[8:], strict=True))
    assert worst <= 1e-5, worst


@pytest.mark.slow
def test_export_from_the_sharded_checkpoint(two_processes, tmp_path):
    folder = two_processes / "ckpt" / "step=16.ckpt"
    checkpoint = read_checkpoint(folder)
    assert checkpoint["global_step"] == 16
    out = export_checkpoint(
        folder, tmp_path / "model.safetensors", task="tests.helpers.sharding_cases.ShardedRegressor"
    )
    model = load_exported(out)
    ranks = _results(two_processes, "truncation")[0]["ranks"]
    assert {name: layer.ranks for name, layer in tt_layers(model)} == ranks
    # the same model as the unsharded state the checkpoint holds
    reference = ShardedRegressor()
    reference.load_state_dict(checkpoint["state_dict"])
    x = torch.randn(5, 32)
    torch.testing.assert_close(model(x), reference(x))


@pytest.mark.slow
def test_tensorize_callback_under_fsdp2(two_processes):
    results = _results(two_processes, "tensorize")
    assert all(r["sharded"] for r in results), "the swapped layers were not sharded"
    assert results[0]["ranks"] and results[0]["ranks"] == results[1]["ranks"]
    assert any(ranks != [1, 8, 8, 1] for ranks in results[0]["ranks"].values()), "nothing was cut"
    losses = _global_losses(results)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    # the user's dense class, rebuilt with the TT layers and cut ranks of the sharded checkpoint
    model = load_from_checkpoint(DenseRegressor, two_processes / "tensorize" / "step=16.ckpt")
    assert {name: layer.ranks for name, layer in tt_layers(model)} == results[0]["ranks"]


# --- single-process pieces -------------------------------------------------------------------------------------
def test_helpers_are_the_identity_on_plain_tensors():
    t = torch.arange(4.0)
    assert full_tensor(t) is t and not is_sharded(t)
    write_full_(t, torch.zeros(4))
    assert t.tolist() == [0.0] * 4


def test_default_units_are_blocks_then_leaves_and_skip_tied_modules():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.blocks = nn.ModuleList([nn.Sequential(TTLinear(8, 8, rank=2)) for _ in range(2)])
            self.head = nn.Linear(8, 10)
            self.tied = nn.Linear(8, 10)
            self.tied.weight = self.embed.weight
            self.norm = nn.LayerNorm(8)  # parameters of its own: a unit, so a direct call gathers them

    units = default_shard_units(Model(), leaf_types=(TTLinear, nn.Embedding, nn.Linear))
    assert units == ["blocks.0", "blocks.1", "head", "norm"]  # embed and tied share a weight: left to the root


def test_unknown_unit_is_refused():
    with pytest.raises(ValueError, match=r"no submodule named .*; name units as model.named_modules"):
        fully_shard_model(nn.Linear(2, 2), mesh=None, units=["nope"])  # type: ignore[arg-type]


def test_shard_model_does_nothing_without_a_mesh():
    model = ShardedRegressor()
    assert shard_model(model) == []
    assert not any(is_sharded(p) for p in model.parameters())


def test_tensor_parallel_mesh_is_refused():
    class Mesh:
        mesh_dim_names = ("data_parallel", "tensor_parallel")

        def __getitem__(self, name):
            return type("Sub", (), {"size": lambda self: 2})()

    model = ShardedRegressor()
    model._device_mesh = Mesh()
    with pytest.raises(
        ValueError, match=r"tensor parallelism of size 2. Use comera_lightning.strategies.FSDP2Strategy\(\)"
    ):
        shard_model(model)
    with pytest.raises(
        ValueError, match="FSDP2Strategy shards data parallel only: tensor_parallel_size must be 1, got 2"
    ):
        FSDP2Strategy(tensor_parallel_size=2)
    with pytest.raises(
        ValueError,
        match=r"saves distributed checkpoints .*; for one file, consolidate one with .*read_checkpoint or export",
    ):
        FSDP2Strategy(save_distributed_checkpoint=False)


def test_truncation_under_plain_model_parallel_strategy_names_the_fix(tmp_path):
    trainer = Trainer(
        strategy=ModelParallelStrategy(), accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path
    )
    with pytest.raises(
        ValueError,
        match=r"not supported under ModelParallelStrategy .*use comera_lightning.strategies.FSDP2Strategy, which",
    ):
        RankAdaptation().setup(trainer, ShardedRegressor(), "fit")
    RankAdaptation(truncate_every_n_steps=None).setup(trainer, ShardedRegressor(), "fit")  # masking only: fine


def test_truncation_plan_changes_nothing_until_truncate():
    layer = TTLinear(8, 8, rank=2)
    layer.rank_mask_0[0] = False
    record = layer.truncation_plan()
    assert record and [tuple(c.shape) for c in layer.cores] == [tuple(c.shape) for c in TTLinear(8, 8, rank=2).cores]
    layer.truncate_()
    assert layer.ranks[1] == 1


def test_reading_a_folder_that_is_no_checkpoint(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"not a distributed checkpoint \(no .metadata and meta.pt\); pass a .ckpt file or the folder a sharded",
    ):
        read_checkpoint(tmp_path)
