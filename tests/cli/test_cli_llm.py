"""`comera` on the decoder configs: they parse, the CPU one builds, and fit -> predict on a tiny corpus samples code
from the truncated checkpoint."""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers.cli import CONFIGS, TINY_ENCODER, TINY_TRAINER, _callbacks_config, _run, _small_source_tree

from comera_lightning.callbacks import RankAdaptation
from comera_lightning.data import CodeLMDataModule
from comera_lightning.lit import CausalLM
from comera_lightning.nn import size_report, tt_layers

LLM_CONFIGS = {
    "llm_cpu.yaml": "CodeLMDataModule",
    "llm_text_cpu.yaml": "TextLMDataModule",
    "llm_60m.yaml": "TextLMDataModule",
    "llm_130m.yaml": "TextLMDataModule",
}
NO_LOGGER = ["--trainer.logger=false"]  # MLflow is covered by test_cli.py; here it would only cost time


@pytest.mark.parametrize("name", LLM_CONFIGS)
def test_llm_config_parses(name, capsys):
    data_module = LLM_CONFIGS[name]
    with pytest.raises(SystemExit) as exit_info:
        _run("fit", f"--config={CONFIGS / name}", "--print_config")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "CausalLM" in out and data_module in out and "RankAdaptation" in out


def test_llm_cpu_config_builds_a_tensorised_decoder():
    config = yaml.safe_load((CONFIGS / "llm_cpu.yaml").read_text())
    assert config["model"]["class_path"] == "CausalLM" and config["data"]["class_path"] == "CodeLMDataModule"
    model = CausalLM(**config["model"]["init_args"])
    datamodule = CodeLMDataModule(**config["data"]["init_args"])  # lazy: reads no file yet
    kinds = model.model.layer_kinds
    assert kinds["embed_tokens"] == "tt" and kinds["lm_head"] == "tt" and kinds["layers.1.mlp.down_proj"] == "tt"
    head = model.model.lm_head  # the config's low-rank head: one mode per side, its own rank
    assert (head.in_modes, head.out_modes, head.ranks) == ([128], [2048], [1, 64, 1])
    assert size_report(model).compression_ratio > 2  # before any cut; the late stage goes on to 10x
    assert model.model.max_len >= datamodule.seq_len and model.vocab_size >= datamodule.vocab_size


def test_llm_cpu_fit_then_predict_samples_from_the_truncated_checkpoint(workdir, capsys):
    root = _small_source_tree(workdir / "src", n_files=8)
    config = CONFIGS / "llm_cpu.yaml"
    callbacks = _callbacks_config(
        workdir, gamma=1.0, late_start_step=6, truncate_every_n_steps=6, target_compression=3.0
    )
    data = [
        f"--data.root={root}",
        "--data.max_files=null",
        "--data.max_sequences=null",
        "--data.val_fraction=0.25",
        "--data.num_prompts=2",
        "--data.prompt_len=6",
    ]
    fitted = _run(
        "fit",
        f"--config={config}",
        *TINY_ENCODER,
        *data,
        *TINY_TRAINER,
        *NO_LOGGER,
        "--trainer.max_steps=18",
        "--trainer.limit_train_batches=18",
        "--model.optim.lr_gates=0.2",
        "--model.optim.warmup_steps=0",
        f"--config={callbacks}",
    )
    adaptation = next(c for c in fitted.trainer.callbacks if isinstance(c, RankAdaptation))
    assert adaptation.truncations >= 1
    checkpoint = fitted.trainer.checkpoint_callback.last_model_path
    saved = torch.load(checkpoint, weights_only=True)["state_dict"]
    capsys.readouterr()

    predicted = _run(
        "predict",
        f"--config={config}",
        *TINY_ENCODER,
        *data,
        *TINY_TRAINER,
        *NO_LOGGER,
        "--model.generate_max_new_tokens=5",
        "--model.generate_top_k=3",
        "--model.generate_temperature=0.8",
        f"--ckpt_path={checkpoint}",
    )
    layers = tt_layers(predicted.model)
    assert layers
    for name, layer in layers:  # built at full rank, restored at the checkpoint's truncated ranks
        for k, core in enumerate(layer.cores):
            assert core.shape == saved[f"{name}.cores.{k}"].shape
    assert predicted.model.generate_top_k == 3  # the command line decides sampling, not the checkpoint
    out = capsys.readouterr().out
    assert out.count("--- continuation:") == 2


def test_llm_text_cpu_config_reads_the_standard_library_as_plain_text():
    from comera_lightning.data import TextLMDataModule

    config = yaml.safe_load((CONFIGS / "llm_text_cpu.yaml").read_text())
    datamodule = TextLMDataModule(**config["data"]["init_args"])
    sources = datamodule.sources()
    assert len(sources["train"]) > 100 and not sources["val"]  # validation: a fraction of the documents
    assert {s.format for s in sources["train"]} == {"text"} and all(s.name.endswith(".py") for s in sources["train"])
    model = CausalLM(**config["model"]["init_args"])
    assert model.model.max_len >= datamodule.seq_len and model.vocab_size >= datamodule.vocab_size
