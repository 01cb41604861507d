"""Two-process FSDP2 runs for tests/test_sharding.py: ``python tests/helpers/fsdp_worker.py OUT [SCENARIO ...]``.

Lightning's ``ModelParallelStrategy`` starts the second process by running this script again (a spawn-free
launch that must not re-run pytest), so the runs live here and write what the test compares to ``OUT``:
``<scenario>.rank<r>.json`` with the losses each process saw and the layers' ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from comera_lightning.callbacks import Tensorize
from comera_lightning.nn.tensorize import tt_layers
from comera_lightning.strategies import FSDP2Strategy
from tests.helpers.sharding_cases import (
    BATCH,
    DenseRegressor,
    ShardedRegressor,
    parity_callbacks,
    parity_loader,
    truncation_callbacks,
    truncation_loader,
)


def _trainer(out: Path, callbacks: list, max_steps: int, **kwargs) -> Trainer:
    return Trainer(
        strategy=FSDP2Strategy(),
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=out,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kwargs,
    )


def _write(out: Path, name: str, model, trainer: Trainer, **extra) -> None:
    record = {"losses": model.losses, "ranks": {n: layer.ranks for n, layer in tt_layers(model)}, **extra}
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def parity(out: Path) -> None:
    model = ShardedRegressor()
    trainer = _trainer(out, parity_callbacks(), max_steps=50, enable_checkpointing=False)
    trainer.fit(model, parity_loader(BATCH))
    sharded = all(type(p).__name__ == "DTensor" for p in model.parameters())
    _write(out, "parity", model, trainer, sharded=sharded)


def truncation(out: Path) -> None:
    model = ShardedRegressor()
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", filename="{step}", every_n_train_steps=8, save_top_k=-1)
    trainer = _trainer(out, [*truncation_callbacks(), checkpoint], max_steps=16)
    trainer.fit(model, truncation_loader(BATCH))
    local = sum(p.to_local().numel() for p in model.parameters())
    layer = model.net[0]
    layer.remove_slices_(0, [0])
    try:  # a sharded layer cannot resize itself: the strategy reshards
        layer.truncate_()
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    _write(out, "truncation", model, trainer, local_parameters=local, refused=refused)


def resume(out: Path) -> None:
    model = ShardedRegressor()  # built at the initial ranks; the checkpoint's are smaller
    trainer = _trainer(out, truncation_callbacks(), max_steps=16, enable_checkpointing=False)
    trainer.fit(model, truncation_loader(BATCH), ckpt_path=out / "ckpt" / "step=8.ckpt")
    _write(out, "resume", model, trainer)


def resume_from_file(out: Path) -> None:
    model = ShardedRegressor()  # a one-process run's .ckpt file, saved after cuts, continued under FSDP2
    trainer = _trainer(out, truncation_callbacks(), max_steps=16, enable_checkpointing=False)
    trainer.fit(model, truncation_loader(BATCH), ckpt_path=out / "single-step=8.ckpt")
    _write(out, "resume_from_file", model, trainer)


def tensorize(out: Path) -> None:
    model = DenseRegressor()
    checkpoint = ModelCheckpoint(dirpath=out / "tensorize", filename="{step}")
    callbacks = [Tensorize(rank=8, min_features=16), *truncation_callbacks(), checkpoint]
    trainer = _trainer(out, callbacks, max_steps=16)
    trainer.fit(model, truncation_loader(BATCH))
    _write(out, "tensorize", model, trainer, sharded=all(type(p).__name__ == "DTensor" for p in model.parameters()))


if __name__ == "__main__":
    torch.set_num_threads(1)
    folder = Path(sys.argv[1])
    for scenario in sys.argv[2:] or ["parity", "truncation", "resume", "resume_from_file", "tensorize"]:
        globals()[scenario](folder)
    os.environ.pop("LOCAL_RANK", None)
