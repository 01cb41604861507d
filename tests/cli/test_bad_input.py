"""Bad input fails early with a message that names the problem and the fix, and never touches the user's files.

Layers (modes, ranks, thresholds), RankAdaptation arguments, token ids, data folders, checkpoint files given to
``comera validate --ckpt_path``, config files with unknown keys or wrong types, unwritable output folders.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import traceback
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from comera_lightning import TTEmbedding, TTLinear
from comera_lightning.callbacks import PaperLateStage, RankAdaptation, ScheduledLateStage
from comera_lightning.cli import ComeraCLI
from comera_lightning.data import CodeMLMDataModule, CriteoDataModule, MNLIDataModule, write_synthetic_mnli
from comera_lightning.lit import MaskedLM, SequenceClassification, check_checkpoint_file
from comera_lightning.lit import checks as checks_module

TINY = [
    "--model=SequenceClassification",
    "--data=MNLIDataModule",
    "--model.d_model=16",
    "--model.num_heads=2",
    "--model.d_ff=32",
    "--model.num_layers=1",
    "--model.max_len=16",
    "--model.vocab_size=300",
    "--model.layer_config.rank=4",
    "--model.layer_config.embedding_rank=4",
    "--model.layer_config.min_features=16",
    "--data.vocab_size=300",
    "--data.seq_len=16",
    "--data.batch_size=8",
    "--trainer.max_steps=2",
    "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=1",
    "--trainer.val_check_interval=null",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["comera"])  # LightningCLI warns when pytest's own arguments are there too


# ------------------------------------------------------------------------------------------------ layers
@pytest.mark.parametrize(
    "build, error, message",
    [
        (
            lambda: TTLinear(64, 64, in_modes=[4, 4, 3]),
            ValueError,
            r"in_modes: the product of modes \[4, 4, 3\] is 48 but must be at least 64; pass modes whose product is 64",
        ),
        (
            lambda: TTEmbedding(100, 16, dim_modes=[4, 3]),
            ValueError,
            r"dim_modes: the product of modes \[4, 3\] is 12 but must equal 16",
        ),
        (
            lambda: TTEmbedding(100, 16, vocab_modes=[10, 10], dim_modes=[2, 2, 4]),
            ValueError,
            "must have the same number of modes",
        ),
        (lambda: TTLinear(64, 64, in_modes=[0, 8, 8]), ValueError, r"every mode must be >= 1"),
        (lambda: TTLinear(64, 64, in_modes="448"), TypeError, "in_modes: modes must be a list of positive integers"),
        (lambda: TTLinear(64, 64, rank=0), ValueError, "rank must be >= 1, got 0"),
        (lambda: TTLinear(64, 64, rank=-3), ValueError, "rank must be >= 1, got -3"),
        (lambda: TTLinear(64, 64, rank=2.5), TypeError, "rank must be an int .* or a list of ints"),
        (lambda: TTLinear(64, 64, rank="8"), TypeError, "rank must be an int"),
        (
            lambda: TTLinear(64, 64, rank=[4, 4.5, 4, 4, 4], in_modes=[4, 4, 4], out_modes=[4, 4, 4]),
            TypeError,
            "or a list of ints",
        ),
        (
            lambda: TTLinear(64, 64, rank=[4, 0, 4, 4, 4], in_modes=[4, 4, 4], out_modes=[4, 4, 4]),
            ValueError,
            "rank of bond 2 must be >= 1, got 0",
        ),
        (
            lambda: TTLinear(64, 64, rank=[4, 100, 4, 4, 4], in_modes=[4, 4, 4], out_modes=[4, 4, 4]),
            ValueError,
            r"rank of bond 2 is 100 but modes \[4, 4, 4, 4, 4, 4\] allow at most 16 there .* pass a single int",
        ),
        (
            lambda: TTLinear(64, 64, rank=[4, 4], in_modes=[4, 4, 4], out_modes=[4, 4, 4]),
            ValueError,
            "expected 5 internal ranks for 6 cores",
        ),
        (
            lambda: TTEmbedding(100, 16, rank=[50], vocab_modes=[10, 10], dim_modes=[4, 4]),
            ValueError,
            r"rank of bond 1 is 50 but modes \[40, 40\] allow at most 40",
        ),
        (lambda: TTLinear(64, 64, rank_threshold=1.0), ValueError, r"rank_threshold must be in \[0, 1\)"),
        (lambda: TTEmbedding(100, 16, rank_threshold=-0.1), ValueError, r"rank_threshold must be in \[0, 1\)"),
        (lambda: TTLinear(64, 64, rank_threshold=float("nan")), ValueError, r"rank_threshold must be in \[0, 1\)"),
        (lambda: TTLinear(64, 64, rank=4).refresh_masks_(2.0), ValueError, r"threshold must be in \[0, 1\)"),
    ],
)
def test_layer_arguments(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_single_int_rank_is_clamped_by_design():
    layer = TTLinear(64, 64, rank=1000, in_modes=[4, 4, 4], out_modes=[4, 4, 4])
    assert layer.ranks == [1, 4, 16, 64, 16, 4, 1]


def test_token_ids_outside_the_vocabulary():
    embedding = TTEmbedding(100, 16, rank=4)
    for bad in (100, -1):
        with pytest.raises(
            IndexError,
            match=rf"token id {bad} is outside the vocabulary \[0, 100\); check the "
            r"tokenizer's vocabulary size against num_embeddings=100",
        ):
            embedding(torch.tensor([[1, bad]]))
    with pytest.raises(TypeError, match="expects integer token ids"):
        embedding(torch.tensor([1.0]))

    small = dict(d_model=16, num_heads=2, d_ff=32, num_layers=1, max_len=16)
    layers = dict(rank=4, embedding_rank=4, min_features=16)
    ids = torch.randint(0, 300, (2, 8))
    labels = torch.full((2, 8), -100)
    labels[:, 2] = 5
    vocabulary = r"outside \[0, 300\); the model's vocabulary has 300 ids: set model.vocab_size to at least"
    for tt in (True, False):  # a TT word embedding and a dense one fail alike
        mlm = MaskedLM(vocab_size=300, layer_config=dict(layers, tt_embeddings=tt), **small)
        with pytest.raises(IndexError, match=rf"input_ids holds 300, {vocabulary}"):
            mlm.training_step({"input_ids": ids.index_fill(1, torch.tensor([3]), 300), "labels": labels}, 0)
        with pytest.raises(IndexError, match=rf"labels \(besides -100, the ignored .*\) holds 999, {vocabulary}"):
            mlm.training_step({"input_ids": ids, "labels": labels.index_fill(1, torch.tensor([2]), 999)}, 0)
        classifier = SequenceClassification(
            vocab_size=300, num_classes=3, layer_config=dict(layers, tt_embeddings=tt), **small
        )
        with pytest.raises(IndexError, match=rf"input_ids holds -1, {vocabulary}"):
            classifier.training_step(
                {"input_ids": ids.index_fill(1, torch.tensor([0]), -1), "labels": torch.tensor([0, 1])}, 0
            )
        with pytest.raises(IndexError, match=r"labels holds 3, outside \[0, 3\); set model.num_classes"):
            classifier.training_step({"input_ids": ids, "labels": torch.tensor([0, 3])}, 0)
        with pytest.raises(IndexError, match=r"token_type_ids holds 2, outside \[0, 2\); set model.type_vocab_size"):
            classifier.training_step(
                {"input_ids": ids, "token_type_ids": torch.full_like(ids, 2), "labels": torch.tensor([0, 1])}, 0
            )


# ------------------------------------------------------------------------------------------------ RankAdaptation
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(threshold=1.0), r"threshold must be in \[0, 1\)"),
        (dict(threshold=-0.5), r"threshold must be in \[0, 1\)"),
        (dict(target_compression=0.5), "target_compression must be > 1"),
        (dict(target_compression=float("inf")), "target_compression must be > 1 .* and finite"),
        (dict(target_size=0), "target_size must be a positive parameter count"),
        (dict(target_size_ratio=1.5), r"target_size_ratio must be in \(0, 1\)"),
        (dict(target_loss=float("nan")), "target_loss must be a finite number"),
        (dict(late_start_loss=float("inf")), "late_start_loss must be a finite number"),
        (dict(late_start_step=-1), "late_start_step must be >= 0"),
        (dict(gamma=float("nan")), "gamma must be >= 0 and finite"),
        (dict(late_stage="bang-bang"), r"unknown late-stage policy 'bang-bang'; use one of \['paper', 'scheduled'\]"),
        (dict(min_dead_fraction=0.0), r"min_dead_fraction must be in \(0, 1\]"),
        (dict(loss_smoothing=1.0), r"loss_smoothing must be in \[0, 1\)"),
    ],
)
def test_rank_adaptation_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RankAdaptation(**kwargs)


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (
            PaperLateStage,
            dict(task_weight_base=0.9),
            "task_weight_base must be > 1 so the task loss keeps a positive weight",
        ),
        (PaperLateStage, dict(penalty_weight_base=-1.0), "penalty_weight_base must be >= 0"),
        (ScheduledLateStage, dict(ramp_fraction=0.0), r"ramp_fraction must be in \(0, 1\]"),
        (ScheduledLateStage, dict(ramp_steps=0), "ramp_steps must be >= 1 or None"),
        (ScheduledLateStage, dict(cut_every_n_steps=0), "cut_every_n_steps must be >= 1"),
        (ScheduledLateStage, dict(max_cut_fraction=1.5), r"max_cut_fraction must be in \(0, 1\]"),
        (ScheduledLateStage, dict(loss_tolerance=-0.1), "loss_tolerance must be >= 0"),
        (
            ScheduledLateStage,
            dict(cut_every_n_steps=50, max_pause_steps=10),
            r"max_pause_steps \(10\) must be >= cut_every_n_steps",
        ),
        (ScheduledLateStage, dict(penalty_weight=float("nan")), "penalty_weight must be >= 0 and finite or None"),
    ],
)
def test_late_stage_policy_arguments(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_impossible_target_compression_fails_before_training(tmp_path):
    model = SequenceClassification(
        vocab_size=300,
        d_model=16,
        num_heads=2,
        d_ff=32,
        num_layers=1,
        max_len=16,
        layer_config=dict(rank=4, embedding_rank=4, min_features=16),
    )
    trainer = Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
        callbacks=[RankAdaptation(target_compression=1e6)],
    )
    with pytest.raises(
        ValueError,
        match=r"target size of .* is impossible: with every rank at 1 the model still "
        r"has .* parameters \(at most .*x\); lower target_compression",
    ):
        trainer.fit(model, torch.utils.data.DataLoader([]))
    assert trainer.global_step == 0


# ------------------------------------------------------------------------------------------------ data folders
def test_missing_or_empty_data_folders(tmp_path):
    empty, files = tmp_path / "empty", tmp_path / "empty_files"
    empty.mkdir()
    files.mkdir()
    for name in ("a.py", "b.py", "c.py"):
        (files / name).write_text("")
    cache = str(tmp_path / "cache")
    cases = [
        (
            lambda: CodeMLMDataModule(root=str(tmp_path / "missing"), cache_dir=cache),
            r"corpus root .*missing' does "
            r"not exist; pass root= an existing directory",
        ),
        (
            lambda: CodeMLMDataModule(root=str(empty), cache_dir=cache),
            r"no file matching pattern '\*\.py' under "
            r".*empty'.*point root= at a folder with source files",
        ),
        (
            lambda: CodeMLMDataModule(root=str(files), cache_dir=cache, val_fraction=0.0),
            r"training file\(s\) "
            r"matching '\*\.py' under .*empty_files' are all empty; point root= at a folder with non-empty",
        ),
        (
            lambda: MNLIDataModule(data_dir=str(tmp_path / "missing"), cache_dir=cache),
            r"MNLI data_dir .*missing' "
            r"is not a directory; pass data_dir= the folder with the MNLI files",
        ),
        (lambda: MNLIDataModule(data_dir=str(empty), cache_dir=cache), r"cannot tell the MNLI format of .*empty'"),
        (lambda: MNLIDataModule(data_dir=None), "MNLIDataModule needs data_dir="),
        (
            lambda: CriteoDataModule(data_dir=str(tmp_path / "missing")),
            r"Criteo data_dir .*missing' does not "
            r"exist; pass data_dir= a folder of Criteo-format TSV files",
        ),
        (lambda: CriteoDataModule(data_dir=str(empty)), r"no Criteo-format file .* in .*empty'"),
        (lambda: CriteoDataModule(), "no data: pass data_dir= .* or synthetic=True"),
    ]
    for build, message in cases:
        with pytest.raises(ValueError, match=message):
            build().setup("fit")
    assert sorted(p.name for p in files.iterdir()) == ["a.py", "b.py", "c.py"] and not any(empty.iterdir())


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny fitted SequenceClassification: (work dir, CLI args, checkpoint path)."""
    work = tmp_path_factory.mktemp("fitted")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        write_synthetic_mnli(work / "mnli", num_train=32, num_val=8, fmt="tsv", seed=0)
        args = [
            *TINY,
            f"--data.data_dir={work / 'mnli'}",
            f"--data.cache_dir={work / 'cache'}",
            f"--trainer.default_root_dir={work / 'runs'}",
        ]
        cli = ComeraCLI(args=["fit", *args])
        checkpoint = Path(cli.trainer.checkpoint_callback.best_model_path)
        assert checkpoint.is_file()
    finally:
        os.chdir(cwd)
    return work, args, checkpoint


def _bad_checkpoints(folder: Path, good: Path) -> dict[str, tuple[Path, type, str]]:
    """name -> (file, error, message) for every kind of bad checkpoint."""
    data = good.read_bytes()
    full = torch.load(good, weights_only=True)
    files = {
        "random_bytes": (
            os.urandom(4096),
            ValueError,
            r"cannot be read: it is not a zip archive as torch.save "
            r"writes: the file is truncated .*, corrupt, or not a PyTorch checkpoint",
        ),
        "truncated": (data[: len(data) // 2], ValueError, r"cannot be read: it is not a zip archive"),
        "empty": (b"", ValueError, r"is empty \(0 bytes\): the save or copy was interrupted"),
        "foreign_dict": (
            {"weights": torch.zeros(3)},
            ValueError,
            r"is a PyTorch file but not a Lightning "
            r"checkpoint: it holds a dict with keys \['weights'\]",
        ),
        "plain_tensor": (
            torch.zeros(3),
            ValueError,
            "is a PyTorch file but not a Lightning checkpoint: it holds a Tensor",
        ),
        "bare_state_dict": (full["state_dict"], ValueError, "not a Lightning checkpoint"),
    }
    out = {}
    for name, (content, error, message) in files.items():
        path = folder / f"{name}.ckpt"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            torch.save(content, path)
        out[name] = (path, error, message + r".*pass --ckpt_path a \.ckpt file written by `comera fit`")
    return out


def _fingerprint(path: Path) -> tuple[str, int]:
    return hashlib.sha1(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def test_bad_checkpoint_files_fail_clearly_and_stay_untouched(fitted, tmp_path, monkeypatch, capsys):
    work, args, good = fitted
    monkeypatch.chdir(work)
    bad = _bad_checkpoints(tmp_path, good)
    for path, error, message in bad.values():
        with pytest.raises(error, match=message):
            check_checkpoint_file(path)
    missing = tmp_path / "missing.ckpt"
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt' does not exist; pass --ckpt_path"):
        check_checkpoint_file(missing)
    check_checkpoint_file(good)  # a real one passes, and so do Lightning's keywords
    check_checkpoint_file("last")

    for name, (path, error, message) in bad.items():
        before, listing = _fingerprint(path), sorted(os.listdir(tmp_path))
        with pytest.raises(Exception) as info:
            ComeraCLI(args=["validate", *args, f"--ckpt_path={path}"])
        assert _fingerprint(path) == before and sorted(os.listdir(tmp_path)) == listing, name
        assert isinstance(info.value, error) and re.search(message, str(info.value)), (name, info.value)


def test_checkpoint_of_another_architecture(fitted, tmp_path, monkeypatch, capsys):
    work, args, good = fitted
    monkeypatch.chdir(work)
    content = torch.load(good, weights_only=True)
    content.pop("hyper_parameters")  # else LightningCLI rebuilds the model from the checkpoint's own options
    foreign = tmp_path / "other_architecture.ckpt"
    torch.save(content, foreign)
    before = _fingerprint(foreign)
    for override, message in [
        ("--model.d_model=32", r"with other shapes \(checkpoint vs model\), e.g. .*\(16,\) vs \(32,\)"),
        (
            "--model.layer_config.tt_linears=false",
            r"missing from the checkpoint, e.g. .*weight.*not in this model, e.g. .*cores",
        ),
    ]:
        with pytest.raises(
            ValueError,
            match=r"the checkpoint does not fit this SequenceClassification: it is from a "
            rf"different architecture \(.*{message}.*\)\. Build the model with the "
            r"options the checkpoint was trained with",
        ):
            ComeraCLI(args=["validate", *args, override, f"--ckpt_path={foreign}"])
    assert _fingerprint(foreign) == before
    # a Lightning checkpoint of some other LightningModule: LightningCLI refuses its hyper-parameters by name
    content["hyper_parameters"] = {"width": 64, "lr": 0.01}
    other = tmp_path / "other_module.ckpt"
    torch.save(content, other)
    before = _fingerprint(other)
    with pytest.raises(SystemExit):
        ComeraCLI(args=["validate", *args, f"--ckpt_path={other}"])
    err = capsys.readouterr().err
    assert "Parsing of ckpt_path hyperparameters failed" in err and "Option 'width' is not accepted" in err
    assert _fingerprint(other) == before
    # TT modes that differ while everything else fits: the layer names its cores
    source = TTLinear(64, 64, rank=4, in_modes=[4, 16], out_modes=[8, 8])
    with pytest.raises(
        ValueError,
        match=r"checkpoint core cores.0 has mode sizes \(4,\) but this layer has \(8,\): "
        r"the checkpoint is from a different architecture",
    ):
        TTLinear(64, 64, rank=4, in_modes=[8, 8], out_modes=[8, 8]).load_state_dict(source.state_dict())
    with pytest.raises(ValueError, match=r"checkpoint has 4 cores under cores but this layer has 3"):
        TTLinear(64, 64, rank=4, in_modes=[64], out_modes=[8, 8]).load_state_dict(source.state_dict())
    # a truncated checkpoint with the right modes still loads (ranks are adopted, not an architecture change)
    resumed = ComeraCLI(args=["validate", *args, "--model.layer_config.rank=2", f"--ckpt_path={good}"])
    assert resumed.trainer.callback_metrics


# ------------------------------------------------------------------------------------------------ config files
def _config(folder: Path, extra: str) -> Path:
    path = folder / "bad.yaml"
    path.write_text(
        "model:\n  class_path: SequenceClassification\n  init_args:\n    vocab_size: 300\n"
        "data:\n  class_path: MNLIDataModule\n  init_args:\n    data_dir: mnli\n" + extra
    )
    return path


@pytest.mark.parametrize(
    "extra, key",
    [
        ("trainer:\n  max_stepz: 3\n", "trainer.max_stepz"),
        ("trainer:\n  max_steps: many\n", "trainer.max_steps"),
        ("modle:\n  d_model: 16\n", "modle"),
        ("trainer:\n  callbacks:\n    - class_path: RankAdaptation\n      init_args:\n        gama: 0.1\n", "gama"),
        (
            "trainer:\n  callbacks:\n    - class_path: RankAdaptation\n      init_args:\n        threshold: low\n",
            "Given value: low",
        ),
    ],
)
def test_config_with_unknown_key_or_wrong_type_names_it(tmp_path, capsys, extra, key):
    with pytest.raises(SystemExit) as info:
        ComeraCLI(args=["fit", f"--config={_config(tmp_path, extra)}"])
    assert info.value.code == 2
    assert key in capsys.readouterr().err


def test_config_with_unknown_init_arg_names_it(tmp_path, capsys):
    path = _config(tmp_path, "")
    path.write_text(path.read_text().replace("vocab_size: 300", "vocab_size: 300\n    d_modle: 16"))
    with pytest.raises(SystemExit):
        ComeraCLI(args=["fit", f"--config={path}"])
    assert "Option 'd_modle' is not accepted" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ output folders
def _failed_in_setup(info) -> bool:
    frames = [frame.name for frame in traceback.extract_tb(info.tb)]
    return "check_output_dirs" in frames and "training_step" not in frames and "_run_stage" not in frames


def test_output_folder_under_a_file_fails_before_training(fitted, tmp_path, monkeypatch):
    work, args, _good = fitted
    monkeypatch.chdir(work)
    # a logger writing elsewhere: with --trainer.logger=false the CLI's ConfigArtifact writes config.yaml into
    # default_root_dir in its own setup, before this check, and fails there with a plain OSError
    args = [arg for arg in args if arg != "--trainer.logger=false"]
    args += ["--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={tmp_path / 'logs'}"]
    blocker = tmp_path / "blocker"  # a file where a folder should be created
    blocker.write_text("keep me")
    with pytest.raises(
        NotADirectoryError,
        match=r"trainer.default_root_dir .*blocker/runs' cannot be created: "
        r".*blocker' is a file, not a folder; point trainer.default_root"
        r"_dir at a writable folder",
    ) as info:
        ComeraCLI(args=["fit", *args, f"--trainer.default_root_dir={blocker / 'runs'}"])
    assert _failed_in_setup(info) and blocker.read_text() == "keep me"


class _Steps(Callback):
    def __init__(self):
        self.started = 0

    def on_train_batch_start(self, *args):
        self.started += 1


def test_read_only_output_folder_fails_before_training(tmp_path, monkeypatch):
    readonly = tmp_path / "readonly"
    (readonly / "runs").mkdir(parents=True)
    (readonly / "runs" / "earlier.ckpt").write_bytes(b"an earlier run's file")
    readonly.chmod(0o555)
    (readonly / "runs").chmod(0o555)
    if os.geteuid() == 0:  # permissions do not bind root: make the check see what a read-only file system says
        real_access = os.access

        def access(path, mode, *a, **kw):
            if Path(path).resolve().is_relative_to(readonly) and mode & os.W_OK:
                return False
            return real_access(path, mode, *a, **kw)

        monkeypatch.setattr(checks_module.os, "access", access)
    model = SequenceClassification(
        vocab_size=300,
        d_model=16,
        num_heads=2,
        d_ff=32,
        num_layers=1,
        max_len=16,
        layer_config=dict(rank=4, embedding_rank=4, min_features=16),
    )
    batches = [{"input_ids": torch.randint(0, 300, (4, 8)), "labels": torch.randint(0, 3, (4,))}] * 2
    cases = [
        (
            dict(default_root_dir=readonly / "runs"),
            r"trainer.default_root_dir .*readonly/runs' is not writable; point trainer.default_root_dir at a writable "
            r"folder .* nothing was written or deleted",
        ),
        (
            dict(default_root_dir=tmp_path, callbacks=[ModelCheckpoint(dirpath=readonly / "runs" / "checkpoints")]),
            r"the ModelCheckpoint dirpath .*checkpoints' is not writable \(it would be created in .*readonly/runs'\)",
        ),
    ]
    try:
        for options, message in cases:
            steps = _Steps()
            options = {"callbacks": [], **options}
            options["callbacks"] = [*options["callbacks"], steps]
            trainer = Trainer(
                max_steps=2,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                accelerator="cpu",
                **options,
            )
            with pytest.raises(PermissionError, match=message) as info:
                trainer.fit(model, batches)
            assert _failed_in_setup(info) and steps.started == 0
            assert [p.name for p in (readonly / "runs").iterdir()] == ["earlier.ckpt"]
            assert (readonly / "runs" / "earlier.ckpt").read_bytes() == b"an earlier run's file"
    finally:
        readonly.chmod(0o755)
        (readonly / "runs").chmod(0o755)
