"""Shared settings of the end-to-end CLI tests (tests/cli, tests/data/test_code_pairs.py): the shipped configs,
tiny model and trainer overrides, and a quick callbacks config. The `workdir` fixture lives in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

from helpers.code_tree import small_source_tree

from comera_lightning.cli import ComeraCLI

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

TINY_ENCODER = [
    "--model.d_model=32",
    "--model.num_heads=2",
    "--model.d_ff=64",
    "--model.num_layers=1",
    "--model.max_len=16",
    "--model.vocab_size=512",
    "--model.layer_config.rank=4",
    "--model.layer_config.embedding_rank=4",
    "--model.layer_config.min_features=16",
    "--data.vocab_size=512",
    "--data.seq_len=16",
    "--data.batch_size=8",
]
TINY_TRAINER = [
    "--trainer.max_steps=6",
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=6",
    "--trainer.limit_val_batches=2",
    "--trainer.val_check_interval=null",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
]
#: the shipped configs whose data module is TextLMDataModule
TEXT_LM_CONFIGS = ("llm_60m.yaml", "llm_130m.yaml", "llm_text_cpu.yaml")
TINY_DLRM_TABLES = str([50, 3000, 20, 1500, 7] + [30] * 21)


def _callbacks_config(folder: Path, **adaptation: float) -> Path:
    """A config replacing the callbacks list with one whose RankAdaptation acts within a few steps."""
    settings = {"late_start_step": 4, "truncate_every_n_steps": 4, "min_dead_fraction": 0.1, **adaptation}
    lines = ["trainer:", "  callbacks:", "    - class_path: RankAdaptation", "      init_args:"]
    lines += [f"        {key}: {value}" for key, value in settings.items()]
    lines += [
        "    - class_path: ContractionPlanner",
        "    - class_path: RankMonitor",
        "      init_args:",
        "        log_every_n_steps: 4",
        "    - class_path: ModelCheckpoint",
        "      init_args:",
        "        save_last: true",
    ]
    path = folder / f"callbacks_{abs(hash(tuple(sorted(settings.items()))))}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _tiny_overrides(name: str, data_dir: Path) -> list[str]:
    if name == "dlrm_criteo.yaml":
        return [
            f"--model.table_sizes={TINY_DLRM_TABLES}",
            f"--data.table_sizes={TINY_DLRM_TABLES}",
            "--model.bottom_mlp=[32, 16]",
            "--model.top_mlp=[32]",
            "--model.layer_config.rank=4",
            "--model.layer_config.embedding_rank=4",
            "--data.synthetic=true",
            "--data.num_samples=2000",
            "--data.batch_size=128",
            f"--config={_callbacks_config(data_dir, target_compression=2.0)}",
        ]
    overrides = list(TINY_ENCODER)
    if name != "mnli_6enc_dense.yaml":  # tiny models cannot reach the configs' real compression targets
        overrides.append(f"--config={_callbacks_config(data_dir.parent, target_compression=3.0)}")
    if name.startswith("mnli"):
        overrides.append(f"--data.data_dir={data_dir}")
    elif name in TEXT_LM_CONFIGS:  # a generated corpus instead of the configs' /data layout or the stdlib
        corpus = small_source_tree(data_dir.parent / "text_corpus")
        overrides += [
            f"--data.files={corpus}/pkg0/*.py",
            f"--data.val_files={corpus}/pkg1/*.py",
            "--data.root=null",
            "--data.tokenizer_path=null",
            "--data.num_workers=0",
        ]
    elif name == "code_pairs.yaml":  # validates by step in the config; per epoch with TINY_TRAINER's interval
        overrides += [
            "--data.max_files=60",
            "--data.max_examples=300",
            "--data.val_fraction=0.25",
            "--trainer.check_val_every_n_epoch=1",
        ]
    else:
        overrides += ["--data.max_files=15", "--data.max_sequences=400", "--data.val_fraction=0.2"]
    return overrides


def _run(*args: str) -> ComeraCLI:
    return ComeraCLI(args=list(args))


def _small_source_tree(root: Path, n_files: int = 6) -> Path:
    """A corpus of a few small text .py files: a source tree far smaller than the standard library."""
    return small_source_tree(root, n_files, n_funcs=30)
