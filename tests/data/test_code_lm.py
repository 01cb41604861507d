"""CodeLMDataModule: packed next-token rows, the split and tokenizer shared with the MLM module, caches, loaders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.code_tree import small_source_tree

from comera_lightning.data import CodeLMDataModule, CodeMLMDataModule, pack_stream
from comera_lightning.data import corpus as corpus_mod


@pytest.fixture
def tree(tmp_path) -> Path:
    return small_source_tree(tmp_path / "src")


def _dm(tree: Path, tmp_path: Path, **kw) -> CodeLMDataModule:
    settings = dict(
        root=str(tree),
        vocab_size=400,
        seq_len=32,
        batch_size=4,
        val_fraction=0.25,
        cache_dir=str(tmp_path / "cache"),
        num_prompts=3,
        prompt_len=5,
    )
    settings.update(kw)
    return CodeLMDataModule(**settings)


def test_pack_stream_every_token_is_a_target_once():
    stream = torch.arange(10, 21)  # 11 tokens -> 10 targets -> rows of 4: 4, 4, 2 (+2 padded)
    inputs, labels = pack_stream(stream, 4, pad_id=0)
    assert inputs.shape == labels.shape == (3, 4)
    assert inputs.flatten()[:10].tolist() == list(range(10, 20))
    assert labels.flatten()[:10].tolist() == list(range(11, 21))
    assert inputs[-1, 2:].tolist() == [0, 0] and labels[-1, 2:].tolist() == [-100, -100]
    empty_inputs, _ = pack_stream(torch.tensor([5]), 4, pad_id=0)
    assert empty_inputs.shape == (0, 4)
    exact_inputs, exact_labels = pack_stream(torch.arange(9), 4, pad_id=0)
    assert exact_inputs.shape == (2, 4) and (exact_labels != -100).all()


def test_rows_are_packed_next_token_pairs_and_split_by_file(tree, tmp_path):
    dm = _dm(tree, tmp_path)
    dm.setup("fit")
    inputs, labels = dm.train_dataset.tensors["input_ids"].long(), dm.train_dataset.tensors["labels"].long()
    assert inputs.shape[1] == 32 and len(inputs) > 4
    stream = dm.streams()["train"].long()
    n = len(stream) - 1  # targets; the rest of the last row is padding
    assert torch.equal(inputs.flatten()[:n], stream[:-1]) and torch.equal(labels.flatten()[:n], stream[1:])
    assert (labels.flatten()[n:] == -100).all() and (inputs.flatten()[n:] == dm.special_ids.pad).all()
    assert torch.equal(labels[:-1, -1], inputs[1:, 0])  # rows follow each other in the stream
    assert (stream == dm.eos_id).sum() == len(dm.split_files()[0]) and stream[-1] == dm.eos_id  # one per file
    # the split is CodeMLMDataModule's: same files, same tokenizer file (one cache key per corpus)
    mlm = CodeMLMDataModule(
        root=str(tree), vocab_size=400, seq_len=32, val_fraction=0.25, cache_dir=str(tmp_path / "cache")
    )
    assert mlm.split_files() == dm.split_files()
    train, val = dm.split_files()
    assert train and val and not set(train) & set(val)
    assert mlm._ensure_tokenizer_file() == dm._ensure_tokenizer_file() and not mlm.tokenizer_trained


def test_second_instance_reads_the_cache_and_seq_len_needs_no_reencoding(tree, tmp_path, monkeypatch):
    first = _dm(tree, tmp_path)
    first.prepare_data()
    first.setup("fit")

    def refuse(*args, **kwargs):
        raise AssertionError("encoded again")

    monkeypatch.setattr(corpus_mod, "encode_texts", refuse)
    again = _dm(tree, tmp_path, seq_len=16)
    again.setup("fit")
    assert again.train_dataset.tensors["input_ids"].shape[1] == 16
    stream = first.streams()["train"].long()
    assert torch.equal(again.train_dataset.tensors["input_ids"].long().flatten()[:100], stream[:100])


def test_loaders_prompts_and_decode(tree, tmp_path):
    dm = _dm(tree, tmp_path, max_sequences=6)
    dm.setup("fit")
    assert len(dm.train_dataset) == 6 and len(dm.val_dataset) == 2
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].dtype == torch.long
    assert batch["input_ids"].shape == (4, 32)
    val = next(iter(dm.val_dataloader()))
    test = next(iter(dm.test_dataloader()))
    assert torch.equal(val["input_ids"], test["input_ids"])
    prompts = next(iter(dm.predict_dataloader()))
    assert prompts["input_ids"].shape == (2, 5) and prompts["index"].tolist() == [0, 1]
    assert torch.equal(prompts["input_ids"], dm.val_dataset.tensors["input_ids"][:2, :5].long())
    text = "def func(value):\n    return value\n"
    assert dm.decode(dm.tokenizer.encode(text, add_special_tokens=False).ids) == text


def test_max_val_sequences_caps_validation_alone_with_rows_from_the_whole_split(tree, tmp_path):
    every = _dm(tree, tmp_path)
    every.setup("fit")
    all_val = every.val_dataset.tensors["input_ids"]
    assert len(all_val) >= 6
    capped = _dm(tree, tmp_path, max_val_sequences=4, seed=1)
    capped.setup("fit")
    kept = capped.val_dataset.tensors["input_ids"]
    assert len(kept) == 4 and len(capped.train_dataset) == len(every.train_dataset)  # training rows untouched
    rows = [next(i for i, row in enumerate(all_val) if torch.equal(row, k)) for k in kept]
    assert rows == sorted(rows)  # stream order kept: a loader's first batches are not a shuffled sample
    # it wins over the share that max_sequences implies, and a cap above the split keeps every row
    both = _dm(tree, tmp_path, max_sequences=6, max_val_sequences=3)
    both.setup("fit")
    assert (len(both.train_dataset), len(both.val_dataset)) == (6, 3)
    loose = _dm(tree, tmp_path, max_val_sequences=10_000)
    loose.setup("fit")
    assert torch.equal(loose.val_dataset.tensors["input_ids"], all_val)


def test_bad_settings_are_refused(tree, tmp_path):
    with pytest.raises(ValueError, match="seq_len must be >= 2, got 1"):
        _dm(tree, tmp_path, seq_len=1)
    with pytest.raises(ValueError, match="max_sequences must be >= 1 or None, got 0"):
        _dm(tree, tmp_path, max_sequences=0)
    with pytest.raises(ValueError, match="max_val_sequences must be >= 1 or None, got 0"):
        _dm(tree, tmp_path, max_val_sequences=0)
    with pytest.raises(ValueError, match="prompt_len and num_prompts must be >= 1, got 0, 3"):
        _dm(tree, tmp_path, prompt_len=0)
