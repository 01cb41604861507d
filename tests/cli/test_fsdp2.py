"""``comera fit`` under FSDP2 with two gloo processes: ranks shrink, layers are cut and resharded, the distributed
checkpoint resumes and exports (the library pieces: tests/test_sharding.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.cli import CONFIGS, TINY_ENCODER

from comera_lightning.cli import main
from comera_lightning.export import load_exported, read_export_metadata
from comera_lightning.nn.tensorize import tt_layers

FAST_CUTS = """trainer:
  callbacks:
    - class_path: RankAdaptation
      init_args:
        late_start_step: 2
        truncate_every_n_steps: 2
        min_dead_fraction: 0.1
        target_compression: 14.0
        late_stage:
          class_path: comera_lightning.callbacks.ScheduledLateStage
          init_args: {ramp_steps: 4, cut_every_n_steps: 2, max_cut_fraction: 0.5, loss_tolerance: 100.0}
    - class_path: ContractionPlanner
    - class_path: ModelCheckpoint
      init_args:
        dirpath: ckpt
        save_last: true
"""


def _comera_fit(workdir, *args: str) -> str:
    """``comera fit`` with 2 processes; Lightning starts the second by running the same command again."""
    command = [
        sys.executable,
        "-m",
        "comera_lightning",
        "fit",
        f"--config={CONFIGS / 'quickstart.yaml'}",
        f"--config={workdir / 'cuts.yaml'}",
        f"--config={CONFIGS / 'callbacks' / 'fsdp2.yaml'}",
        *TINY_ENCODER,
        "--data.max_files=4",
        "--data.max_sequences=120",
        "--data.val_fraction=0.2",
        "--trainer.limit_val_batches=0",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.mark.slow
def test_comera_fit_under_fsdp2_cuts_checkpoints_resumes_and_exports(workdir):
    (workdir / "cuts.yaml").write_text(FAST_CUTS)
    first = _comera_fit(workdir, "--trainer.max_steps=6")
    assert "comera: trained 6 steps" in first and "compression 14.0x" in first
    checkpoint = workdir / "ckpt" / "last.ckpt"
    assert (checkpoint / "meta.pt").is_file()  # a distributed checkpoint folder
    exported = load_exported(workdir / "model.safetensors")  # written by the fit, from that folder
    ranks = {name: layer.ranks for name, layer in tt_layers(exported)}
    assert any(r[1] < 4 for r in ranks.values()), ranks  # built at rank 4, cut while training

    second = _comera_fit(workdir, "--trainer.max_steps=8", f"--ckpt_path={checkpoint}")
    assert "comera: trained 8 steps" in second
    main(["export", f"--ckpt_path={checkpoint}", f"--out={workdir / 'resumed.safetensors'}"])
    resumed = load_exported(workdir / "resumed.safetensors")
    assert read_export_metadata(workdir / "resumed.safetensors")["task"].endswith(".MaskedLM")
    assert {name: layer.ranks for name, layer in tt_layers(resumed)}.keys() == ranks.keys()
