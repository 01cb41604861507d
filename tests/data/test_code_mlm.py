"""CodeMLMDataModule on the standard library and on a small generated corpus."""

from __future__ import annotations

import functools
import operator
from pathlib import Path

import pytest
import torch

from comera_lightning.data import (
    CodeMLMDataModule,
    MLMCollator,
    mask_tokens,
    stdlib_root,
)
from comera_lightning.data import tokenizer as tokenizer_mod
from comera_lightning.data.code_mlm import chunk_stream
from comera_lightning.data.tokenizer import (
    CLS_ID,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_TOKENS,
    UNK_ID,
)


def _tokenizer_json(cache: Path) -> Path:
    (path,) = cache.glob("tokenizers/code-*/tokenizer.json")
    return path


def _refuse_training(*args, **kwargs):
    raise AssertionError("the tokenizer was trained again instead of loaded from the cache")


def test_first_instance_trains_and_caches(stdlib_dm, stdlib_cache):
    assert stdlib_dm.tokenizer_trained
    assert _tokenizer_json(stdlib_cache).is_file()
    assert len(list(stdlib_cache.glob("encoded/code-mlm-*.pt"))) == 1
    tok = stdlib_dm.tokenizer
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID] == [0, 1, 2, 3, 4]
    assert 261 <= stdlib_dm.vocab_size_actual <= stdlib_dm.vocab_size == 1000
    # byte-level BPE round-trips source code exactly
    src = "def f(x):\n    return {'é': x ** 2}  # ünïcode\n"
    assert tok.decode(tok.encode(src, add_special_tokens=False).ids) == src


def test_second_instance_loads_tokenizer_and_tensors_from_cache(stdlib_dm, stdlib_cache, monkeypatch, stdlib_kw):
    path = _tokenizer_json(stdlib_cache)
    mtime = path.stat().st_mtime_ns
    monkeypatch.setattr(tokenizer_mod, "train_bpe_tokenizer", _refuse_training)
    monkeypatch.setattr("comera_lightning.data.code_mlm.chunk_stream", _refuse_training)  # no re-encoding
    again = CodeMLMDataModule(cache_dir=str(stdlib_cache), **stdlib_kw)
    again.prepare_data()
    again.setup("fit")
    assert not again.tokenizer_trained
    assert path.stat().st_mtime_ns == mtime
    assert again.vocab_size_actual == stdlib_dm.vocab_size_actual
    assert torch.equal(again.train_dataset.tensors["input_ids"], stdlib_dm.train_dataset.tensors["input_ids"])
    # a different vocabulary size is a different tokenizer
    other = CodeMLMDataModule(cache_dir=str(stdlib_cache), **{**stdlib_kw, "vocab_size": 900})
    with pytest.raises(AssertionError, match="trained again"):
        other.prepare_data()


def test_split_is_by_file_disjoint_deterministic_and_from_the_stdlib(stdlib_dm, stdlib_cache, stdlib_kw):
    train, val = stdlib_dm.split_files()
    assert len(train) + len(val) == 30 and len(val) >= 1 and len(train) >= 20
    assert set(train).isdisjoint(val)
    again = CodeMLMDataModule(cache_dir=str(stdlib_cache), **stdlib_kw)
    assert again.split_files() == (train, val)
    assert Path(stdlib_dm.corpus_root) == Path(stdlib_root())
    for rel in train + val:
        parts = rel.split("/")
        assert rel.endswith(".py") and "site-packages" not in parts and "test" not in parts[:-1]
        assert (Path(stdlib_root()) / rel).is_file()
    # more files: the files already in validation stay there (hash of the path, not a shuffle)
    bigger = CodeMLMDataModule(cache_dir=str(stdlib_cache), **{**stdlib_kw, "max_files": 60})
    _train2, val2 = bigger.split_files()
    assert set(val2) & set(train) == set() and set(val) <= set(val2)


def test_batch_shapes_dtypes_and_rows(stdlib_dm):
    batch = next(iter(stdlib_dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    for key in batch:
        assert batch[key].shape == (16, 64) and batch[key].dtype == torch.long
    raw = stdlib_dm.train_dataset.tensors["input_ids"].long()
    assert (raw[:, 0] == CLS_ID).all()
    assert ((raw == SEP_ID).sum(1) >= 1).all()
    assert (raw[:-1, -1] == SEP_ID).all()  # full rows end with [SEP]; only the last row is padded
    assert raw.max() < stdlib_dm.vocab_size_actual and raw.min() >= 0
    masked = batch["labels"] != -100
    assert masked.any()
    assert ((batch["input_ids"] != 0) | ~batch["attention_mask"].bool()).all()
    assert (batch["attention_mask"][:, 0] == 1).all()
    # labels hold the original id wherever something is to be predicted
    assert (batch["labels"][masked] >= len(SPECIAL_TOKENS)).all()


def test_masking_rates_follow_bert():
    gen = torch.Generator().manual_seed(0)
    vocab = 500
    ids = torch.randint(5, vocab, (400, 128), generator=gen)
    ids[:, 0], ids[:, -1], ids[:, 100:110] = CLS_ID, SEP_ID, PAD_ID
    out, labels = mask_tokens(
        ids,
        mask_id=MASK_ID,
        special_ids=[0, 1, 2, 3, 4],
        vocab_size=vocab,
        mlm_probability=0.15,
        generator=torch.Generator().manual_seed(1),
    )
    maskable = ids >= 5
    selected = labels != -100
    assert not (selected & ~maskable).any()  # special tokens are never selected
    assert torch.equal(labels[selected], ids[selected])
    rate = selected.sum() / maskable.sum()
    assert abs(rate - 0.15) < 0.01
    n = selected.sum()
    to_mask = (out[selected] == MASK_ID).sum() / n
    kept = (out[selected] == ids[selected]).sum() / n
    replaced = 1 - to_mask - kept
    assert abs(to_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.015 and abs(replaced - 0.1) < 0.015
    assert (out[selected & (out != MASK_ID)] >= 5).all()  # random replacements are never special tokens
    assert torch.equal(out[~selected], ids[~selected])


def test_validation_masks_identical_across_epochs_and_batch_sizes(stdlib_dm, stdlib_cache, stdlib_kw):
    loader = stdlib_dm.val_dataloader()
    first, second = list(loader), list(stdlib_dm.val_dataloader())
    assert len(first) == len(second) >= 1
    for a, b in zip(first, second, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    other = CodeMLMDataModule(cache_dir=str(stdlib_cache), **{**stdlib_kw, "batch_size": 3})
    other.setup("validate")
    third = list(other.val_dataloader())
    assert torch.equal(torch.cat([b["labels"] for b in first]), torch.cat([b["labels"] for b in third]))
    # the training masks, in contrast, are redrawn each epoch
    coll = stdlib_dm._collate_fn(train=True)
    rows = stdlib_dm.train_dataset.__getitems__(list(range(16)))
    assert not torch.equal(coll(rows)["labels"], coll(rows)["labels"])


def test_max_sequences_caps_rows(stdlib_dm, stdlib_cache, stdlib_kw):
    capped = CodeMLMDataModule(cache_dir=str(stdlib_cache), **{**stdlib_kw, "max_sequences": 50})
    capped.setup("fit")
    assert len(capped.train_dataset) == 50
    assert 1 <= len(capped.val_dataset) <= min(10, len(stdlib_dm.val_dataset))


def test_user_tokenizer_path_and_vocab_bound(stdlib_dm, stdlib_cache, tmp_path, monkeypatch, stdlib_kw):
    monkeypatch.setattr(tokenizer_mod, "train_bpe_tokenizer", _refuse_training)
    path = str(_tokenizer_json(stdlib_cache))
    dm = CodeMLMDataModule(cache_dir=str(tmp_path), tokenizer_path=path, **stdlib_kw)
    dm.setup("fit")
    assert dm.vocab_size_actual == stdlib_dm.vocab_size_actual
    small = CodeMLMDataModule(cache_dir=str(tmp_path), tokenizer_path=path, **{**stdlib_kw, "vocab_size": 300})
    with pytest.raises(ValueError, match="set vocab_size >="):
        small.setup("fit")
    with pytest.raises(
        ValueError,
        match=r"does not exist; pass tokenizer_path= a local tokenizer.json .*or tokenizer_path=None to train one",
    ):
        CodeMLMDataModule(cache_dir=str(tmp_path), tokenizer_path=str(tmp_path / "nope.json")).setup("fit")


def _write_corpus(root: Path) -> None:
    for i in range(8):
        body = "\n".join(f"def func_{i}_{j}(value):\n    return value * {j} + {i}\n" for j in range(40))
        (root / "pkg" / f"mod{i}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / "pkg" / f"mod{i}.py").write_text(f'"""Module {i}."""\n\n{body}')
    (root / "README.md").write_text("not python")
    (root / "tests").mkdir()
    (root / "tests" / "test_mod.py").write_text("def test_x():\n    assert True\n")


def test_custom_root_directory(tmp_path):
    root = tmp_path / "corpus"
    _write_corpus(root)
    dm = CodeMLMDataModule(
        root=str(root), vocab_size=400, seq_len=32, batch_size=4, val_fraction=0.2, cache_dir=str(tmp_path / "cache")
    )
    dm.prepare_data()
    dm.setup("fit")
    train, val = dm.split_files()
    assert sorted(train + val) == [f"pkg/mod{i}.py" for i in range(8)] and val
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 32)
    assert dm.vocab_size_actual <= 400
    text = dm.tokenizer.decode(dm.train_dataset.tensors["input_ids"][0].long().tolist())
    assert "def func_" in text
    with_tests = CodeMLMDataModule(root=str(root), include_tests=True, cache_dir=str(tmp_path / "cache"))
    assert "tests/test_mod.py" in functools.reduce(operator.iadd, with_tests.split_files(), [])


@pytest.mark.parametrize("case", ["missing", "empty", "nomatch"])
def test_missing_or_empty_root_raises(tmp_path, case):
    root = tmp_path / "src"
    if case != "missing":
        root.mkdir()
    if case == "nomatch":
        (root / "a.txt").write_text("hello")
    dm = CodeMLMDataModule(root=str(root), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError) as info:
        dm.prepare_data()
    assert str(root) in str(info.value) and "root=" in str(info.value)


def test_only_empty_files_raise(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    (root / "a.py").write_text("")
    (root / "b.py").write_text("")
    dm = CodeMLMDataModule(root=str(root), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="are all empty; point root= at a folder with non-empty source files"):
        dm.prepare_data()


def test_corpus_of_binary_files_is_refused_before_training(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(3):
        (root / f"blob{i}.py").write_bytes(bytes(range(256)) * 8)  # NULs and invalid UTF-8
    dm = CodeMLMDataModule(root=str(root), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError) as info:
        dm.prepare_data()
    message = str(info.value)
    assert "3 of the 3 file(s)" in message and "binary" in message and "blob0.py, blob1.py, blob2.py" in message
    assert str(root) in message and "root=" in message
    assert not (tmp_path / "cache").exists()  # refused before any tokenizer was trained


def test_stray_binary_file_is_skipped_with_a_warning(tmp_path):
    root = tmp_path / "corpus"
    _write_corpus(root)
    (root / "pkg" / "frozen.py").write_bytes(b"\x00\xff" * 500)
    dm = CodeMLMDataModule(
        root=str(root), vocab_size=400, seq_len=32, batch_size=4, val_fraction=0.2, cache_dir=str(tmp_path / "cache")
    )
    with pytest.warns(UserWarning, match=r"skipping 1 of 9 file\(s\).*pkg/frozen\.py"):
        dm.prepare_data()
    dm.setup("fit")
    train, val = dm.split_files()
    assert sorted(train + val) == [f"pkg/mod{i}.py" for i in range(8)]
    text = dm.tokenizer.decode(dm.train_dataset.tensors["input_ids"][0].long().tolist())
    assert "def func_" in text and "\ufffd" not in text


def test_chunk_stream_layout():
    docs = [torch.arange(10, 17).numpy(), torch.arange(20, 23).numpy()]
    rows = chunk_stream(docs, 6, cls_id=2, sep_id=3, pad_id=0)
    assert rows.tolist() == [
        [2, 10, 11, 12, 13, 3],
        [2, 14, 15, 16, 3, 3],  # the [SEP] between documents, then the row's own [SEP]
        [2, 20, 21, 22, 3, 0],
    ]
    assert chunk_stream([], 6, cls_id=2, sep_id=3, pad_id=0).shape == (0, 6)


def test_collator_never_returns_a_batch_without_targets():
    ids = torch.tensor([[CLS_ID, 7, SEP_ID, PAD_ID]])
    coll = MLMCollator(
        mask_id=MASK_ID,
        special_ids=[0, 1, 2, 3, 4],
        vocab_size=10,
        mlm_probability=0.01,
        pad_id=PAD_ID,
        seed=0,
        deterministic=True,
    )
    out = coll({"input_ids": ids, "index": torch.tensor([0])})
    assert out["labels"].tolist() == [[-100, 7, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0]]


def test_fit_with_trainer(stdlib_cache, tmp_path, stdlib_kw):
    import lightning.pytorch as pl

    class TinyMLM(pl.LightningModule):
        def __init__(self, vocab: int):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, 16)
            self.out = torch.nn.Linear(16, vocab)

        def _loss(self, batch):
            logits = self.out(self.emb(batch["input_ids"]))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

        def training_step(self, batch, _):
            return self._loss(batch)

        def validation_step(self, batch, _):
            self.log("val_loss", self._loss(batch))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), 1e-2)

    dm = CodeMLMDataModule(cache_dir=str(stdlib_cache), **stdlib_kw)
    model = TinyMLM(dm.vocab_size)  # the configured size is a safe upper bound, known before setup
    trainer = pl.Trainer(
        max_steps=3,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 3
    (metrics,) = trainer.validate(model, datamodule=dm, verbose=False)
    assert torch.isfinite(torch.tensor(metrics["val_loss"]))
