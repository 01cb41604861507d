"""A checkpoint written by an earlier release (a tiny decoder whose ranks the late stage had cut, `comera fit` with
`configs/llm_cpu.yaml`) still loads, exports and resumes: moving code must not break users' saved runs.

The fixture was written by::

    comera fit --config configs/llm_cpu.yaml --config <callbacks: RankAdaptation late_start_step 4,
        truncate_every_n_steps 4, min_dead_fraction 0.1, target_compression 3; ContractionPlanner; ModelCheckpoint>
        --model.d_model=32 --model.num_heads=2 --model.d_ff=64 --model.num_layers=1 --model.max_len=16
        --model.vocab_size=512 --model.layer_config.rank=4 --model.layer_config.embedding_rank=4
        --model.layer_config.min_features=16 --model.layer_config.layer_ranks='{lm_head: 8}' --data.vocab_size=512
        --data.seq_len=16 --data.batch_size=8 --data.max_files=20 --data.max_sequences=400 --trainer.max_steps=12
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from comera_lightning import load_from_checkpoint
from comera_lightning.export import export_checkpoint, load_exported
from comera_lightning.lit import CausalLM
from comera_lightning.nn import tt_layers

FIXTURE = Path(__file__).parent / "fixtures" / "decoder_rank_cut.ckpt"


def test_the_old_checkpoint_reloads_with_its_cut_ranks():
    model = load_from_checkpoint(CausalLM, FIXTURE)
    checkpoint = torch.load(FIXTURE, weights_only=False, map_location="cpu")
    state = checkpoint["state_dict"]
    for name, layer in tt_layers(model):
        # every layer adopted the checkpoint's core shapes, the cut ones included
        for k, core in enumerate(layer.cores):
            assert tuple(core.shape) == tuple(state[f"{name}.cores.{k}"].shape)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        logits = model.model(ids)
    assert logits.shape == (2, 16, 512) and torch.isfinite(logits).all()


def test_the_old_checkpoint_exports_and_the_export_computes_the_same(tmp_path):
    out = export_checkpoint(FIXTURE, tmp_path / "model.safetensors")
    exported = load_exported(out)
    model = load_from_checkpoint(CausalLM, FIXTURE).eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported.model(ids), model.model(ids))


@pytest.mark.slow
def test_the_old_checkpoint_resumes_training(workdir):
    from helpers.cli import CONFIGS

    from comera_lightning.cli import ComeraCLI

    callbacks = workdir / "callbacks.yaml"
    callbacks.write_text(
        "trainer:\n  callbacks:\n    - class_path: RankAdaptation\n      init_args:\n        late_start_step: 4\n"
        "        truncate_every_n_steps: 4\n        min_dead_fraction: 0.1\n        target_compression: 3.0\n"
        "    - class_path: ContractionPlanner\n    - class_path: ModelCheckpoint\n      init_args:\n"
        "        save_last: true\n"
    )
    from helpers.cli import TINY_ENCODER

    args = [
        "fit",
        f"--config={CONFIGS / 'llm_cpu.yaml'}",
        f"--config={callbacks}",
        *TINY_ENCODER,
        "--model.layer_config.layer_ranks={lm_head: 8}",
        "--data.max_files=20",
        "--data.max_sequences=400",
        "--trainer.max_steps=16",
        "--trainer.max_epochs=3",
        "--trainer.limit_train_batches=12",
        "--trainer.limit_val_batches=2",
        "--trainer.val_check_interval=null",
        "--trainer.enable_progress_bar=false",
        f"--ckpt_path={FIXTURE}",
    ]
    cli = ComeraCLI(args=args)
    assert cli.trainer.global_step == 16  # 12 in the checkpoint, 4 more
    for name, layer in tt_layers(cli.model):
        assert all(torch.isfinite(core).all() for core in layer.cores), name
