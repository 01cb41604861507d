"""TextLMDataModule: every corpus format tokenised to the reference stream, a pretrained tokenizer's own
end-of-document token, the split, streamed rows equal to pack_stream, the constant-memory shuffle and its DDP
shares, resume mid-stream bit for bit, and a clear error (with nothing overwritten) for every bad input."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from comera_lightning.data import TextLMDataModule, pack_stream
from comera_lightning.data.text_sources import TextSource, iter_pieces
from comera_lightning.data.token_store import ShardedShuffleSampler, TokenRows, keyed_permutation

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "tensor",
    "train",
    "rank",
    "gate",
    "core",
    "layer",
    "the",
    "of",
    "and",
    "model",
    "data",
    "loss",
    "token",
    "stream",
    "shard",
    "epoch",
]


def _documents(n: int, seed: int = 0, words: int = 60) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(words // 6)]
        docs.append(f"Document {i}.\n" + "\n".join(lines) + "\n")
    return docs


def _gpt2_style_tokenizer(path: Path, texts: list[str], vocab: int = 300, eos: str = "<|endoftext|>") -> Path:
    """A byte-level BPE whose only special token is GPT-2's end of text (the shape of a downloaded one)."""
    import tokenizers as tk

    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[eos],
        show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return _documents(40)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory, docs) -> Path:
    return _gpt2_style_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", docs)


def _dm(tmp_path: Path, **kw) -> TextLMDataModule:
    settings = dict(vocab_size=512, seq_len=16, batch_size=4, cache_dir=str(tmp_path / "cache"), val_fraction=0.0)
    settings.update(kw)
    return TextLMDataModule(**settings)


def _reference_stream(tokenizer_file: Path, docs: list[str]) -> np.ndarray:
    import tokenizers as tk

    tokenizer = tk.Tokenizer.from_file(str(tokenizer_file))
    eos = tokenizer.token_to_id("<|endoftext|>")
    return np.concatenate([np.r_[tokenizer.encode(d, add_special_tokens=False).ids, eos] for d in docs])


def _stored(dm: TextLMDataModule, split: str = "train") -> np.ndarray:
    dm.prepare_data()
    dm.setup("fit")
    rows = dm.train_dataset if split == "train" else dm.val_dataset
    return rows.tokens(0, rows.num_tokens)


def _write_corpus(folder: Path, docs: list[str], fmt: str) -> str:
    """The documents in one format; returns the glob (or dataset folder) to read them back."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "txt":
        for i, doc in enumerate(docs):
            (folder / f"doc{i:03d}.txt").write_text(doc)
        return str(folder / "*.txt")
    if fmt in ("jsonl", "jsonl.gz"):
        lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)).encode()
        half = len(docs) // 2  # two shards, to check the order
        blobs = [b"".join(lines.splitlines(keepends=True)[:half]), b"".join(lines.splitlines(keepends=True)[half:])]
        for k, blob in enumerate(blobs):
            path = folder / f"part{k}.{fmt}"
            path.write_bytes(gzip.compress(blob) if fmt.endswith(".gz") else blob)
        return str(folder / f"part*.{fmt}")
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), folder / "c.parquet", row_group_size=7)
        return str(folder / "*.parquet")
    raise AssertionError(fmt)


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "jsonl.gz", "parquet"])
def test_each_file_format_tokenises_to_the_reference_stream_with_the_tokenizers_own_eos(
    tmp_path, docs, tokenizer_file, fmt
):
    files = _write_corpus(tmp_path / "corpus", docs, fmt)
    dm = _dm(tmp_path, files=files, tokenizer_path=str(tokenizer_file))
    assert dm.eos_id == dm.tokenizer.token_to_id("<|endoftext|>")
    np.testing.assert_array_equal(_stored(dm), _reference_stream(tokenizer_file, docs))
    meta = json.loads((dm.token_folder() / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["tokens"]["val"] == 0


def test_a_saved_dataset_and_a_dataset_dicts_validation_split(tmp_path, docs, tokenizer_file):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"content": docs}).save_to_disk(str(tmp_path / "one"))
    dm = _dm(tmp_path, dataset_path=str(tmp_path / "one"), text_field="content", tokenizer_path=str(tokenizer_file))
    np.testing.assert_array_equal(_stored(dm), _reference_stream(tokenizer_file, docs))

    both = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": docs[:30]}),
            "validation": datasets.Dataset.from_dict({"text": docs[30:]}),
        }
    )
    both.save_to_disk(str(tmp_path / "dict"))
    dm = _dm(tmp_path, dataset_path=str(tmp_path / "dict"), tokenizer_path=str(tokenizer_file), val_fraction=0.5)
    np.testing.assert_array_equal(_stored(dm, "train"), _reference_stream(tokenizer_file, docs[:30]))
    np.testing.assert_array_equal(_stored(dm, "val"), _reference_stream(tokenizer_file, docs[30:]))


def test_cut_pieces_of_a_large_text_file_encode_like_the_whole_file(tmp_path, tokenizer_file):
    import tokenizers as tk

    text = "".join(_documents(30, seed=3, words=300)) + "  indented\n\n\n" + "x" * 3000 + " tail é\n"
    path = tmp_path / "big.txt"
    path.write_text(text)
    pieces = list(iter_pieces(TextSource(path, "big.txt", "text"), piece_bytes=256))
    assert len(pieces) > 20 and [p.doc_end for p in pieces].count(True) == 1 and pieces[-1].doc_end
    assert "".join(p.text for p in pieces) == text
    tokenizer = tk.Tokenizer.from_file(str(tokenizer_file))
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    cut = [i for p in pieces for i in tokenizer.encode(p.text, add_special_tokens=False).ids]
    assert cut == whole


def test_validation_split_by_document_is_deterministic_under_the_seed(tmp_path, docs, tokenizer_file):
    files = _write_corpus(tmp_path / "corpus", docs, "jsonl")
    splits = {}
    for seed in (0, 0, 1):
        dm = _dm(tmp_path / f"s{seed}", files=files, tokenizer_path=str(tokenizer_file), val_fraction=0.3, seed=seed)
        splits.setdefault(seed, []).append((_stored(dm, "train").tolist(), _stored(dm, "val").tolist()))
    assert splits[0][0] == splits[0][1] and splits[0][0] != splits[1][0]
    train, val = splits[0][0]
    assert 0.1 < len(val) / (len(train) + len(val)) < 0.5
    # every document lands whole on one side: the union is the corpus, reordered by document
    assert sorted(train + val) == sorted(_reference_stream(tokenizer_file, docs).tolist())


def test_separate_validation_files(tmp_path, docs, tokenizer_file):
    train = _write_corpus(tmp_path / "train", docs[:30], "txt")
    val = _write_corpus(tmp_path / "val", docs[30:], "txt")
    dm = _dm(tmp_path, files=train, val_files=val, tokenizer_path=str(tokenizer_file), val_fraction=0.5)
    np.testing.assert_array_equal(_stored(dm, "val"), _reference_stream(tokenizer_file, docs[30:]))
    assert len(dm.val_dataloader()) > 0 and dm.prompts().shape[1] == dm.prompt_len


def test_a_trained_bpe_ends_documents_with_sep_and_is_cached(tmp_path, docs):
    files = _write_corpus(tmp_path / "corpus", docs, "txt")
    dm = _dm(tmp_path, files=files, vocab_size=300)
    stream = _stored(dm)
    assert dm.eos_id == dm.tokenizer.token_to_id("[SEP]") and (stream == dm.eos_id).sum() == len(docs)
    again = _dm(tmp_path, files=files, vocab_size=300)
    assert again.token_folder() == dm.token_folder()
    assert "hello world" in dm.decode(dm.tokenizer.encode("hello world").ids)


def test_streamed_rows_equal_pack_stream(tmp_path):
    stream = np.random.default_rng(0).integers(0, 70000, size=1003)
    path = tmp_path / "s.bin"
    stream.astype("<u4").tofile(path)
    rows = TokenRows(path, "uint32", seq_len=10, pad_id=5)
    inputs, labels = pack_stream(torch.from_numpy(stream), 10, pad_id=5)
    batch = rows.__getitems__(list(range(len(rows))))
    assert len(rows) == len(inputs) == 101
    torch.testing.assert_close(batch["input_ids"], inputs, rtol=0, atol=0)
    torch.testing.assert_close(batch["labels"], labels, rtol=0, atol=0)
    with pytest.raises(IndexError, match="row 101 out of range for 101 rows"):
        rows.__getitems__([101])


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_keyed_permutation_is_a_bijection_that_depends_on_the_key(n):
    first = keyed_permutation(np.arange(n), n, key=1)
    assert sorted(first.tolist()) == list(range(n))
    if n >= 64:
        assert first.tolist() != list(range(n)) and first.tolist() != keyed_permutation(np.arange(n), n, 2).tolist()


@pytest.mark.parametrize("rows,world", [(100, 1), (100, 2), (101, 3), (5, 4)])
def test_sharded_shuffle_shares_are_disjoint_and_cover_the_epoch(rows, world):
    shares = [list(ShardedShuffleSampler(rows, seed=3, num_replicas=world, rank=r)) for r in range(world)]
    assert all(len(s) == -(-rows // world) for s in shares)
    taken = [i for s in shares for i in s]
    assert set(taken) == set(range(rows)) and len(taken) - rows < world  # padding: fewer than `world` repeats
    sampler = ShardedShuffleSampler(rows, seed=3, num_replicas=world, rank=0)
    sampler.set_epoch(1)
    assert rows < 16 or list(sampler) != shares[0]


# --------------------------------------------------------------------------- resume and DDP
class _TinyLM(LightningModule):
    """A bigram model: enough to make weights depend on the exact order of the batches."""

    def __init__(self, vocab: int = 512) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())
        logits = self.table(batch["input_ids"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _trainer(root: Path, steps: int, **kw) -> Trainer:
    return Trainer(
        default_root_dir=root,
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kw,
    )


@pytest.mark.parametrize("workers", [0, 1])
def test_resume_mid_epoch_continues_the_token_stream_bit_for_bit(tmp_path, docs, tokenizer_file, workers):
    files = _write_corpus(tmp_path / "corpus", docs, "jsonl")

    def make():
        return _dm(tmp_path, files=files, tokenizer_path=str(tokenizer_file), batch_size=16, num_workers=workers)

    steps, cut = 40, 13  # ~30 batches an epoch: the runs cross an epoch boundary, the cut is mid-epoch
    torch.manual_seed(0)
    reference = _TinyLM()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=cut, save_top_k=-1)
    _trainer(tmp_path / "a", steps, callbacks=[saver]).fit(reference, datamodule=make())
    batches_per_epoch = len(make().train_dataloader())
    assert cut < batches_per_epoch < steps

    torch.manual_seed(1)  # a different init: the checkpoint must bring everything back
    resumed = _TinyLM()
    _trainer(tmp_path / "b", steps).fit(
        resumed, datamodule=make(), ckpt_path=str(tmp_path / "ckpt" / f"epoch=0-step={cut}.ckpt")
    )
    assert len(resumed.seen) == steps - cut
    for a, b in zip(reference.seen[cut:], resumed.seen, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(reference.table.weight, resumed.table.weight, rtol=0, atol=0)


class _RecordRows(Callback):
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        path = self.folder / f"rank{trainer.global_rank}.txt"
        with open(path, "a") as fh:
            for row in batch["input_ids"].tolist():
                fh.write(" ".join(map(str, row)) + "\n")


@pytest.mark.slow
def test_two_process_ddp_ranks_see_disjoint_rows_covering_the_epoch(tmp_path, tokenizer_file):
    unique = _documents(60, seed=11, words=120)
    files = _write_corpus(tmp_path / "corpus", unique, "txt")
    dm = _dm(tmp_path, files=files, tokenizer_path=str(tokenizer_file), batch_size=8)
    dm.prepare_data()
    dm.setup("fit")
    all_rows = {
        " ".join(map(str, r)) for r in dm.train_dataset.__getitems__(range(len(dm.train_dataset)))["input_ids"].tolist()
    }
    rows = len(dm.train_dataset)
    out = tmp_path / "seen"
    out.mkdir()
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_checkpointing=False,
        callbacks=[_RecordRows(out)],
    )
    trainer.fit(_TinyLM(), datamodule=_dm(tmp_path, files=files, tokenizer_path=str(tokenizer_file), batch_size=8))
    shares = [(out / f"rank{r}.txt").read_text().splitlines() for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == -(-rows // 2)
    assert set(shares[0]) | set(shares[1]) == all_rows
    assert len(set(shares[0]) & set(shares[1])) <= rows % 2  # disjoint but for the one padded repeat


# --------------------------------------------------------------------------- bad input
def test_exactly_one_corpus_and_an_empty_glob_are_refused_with_the_fix(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"pass exactly one corpus: data.files \(globs of .txt/.jsonl/.parquet files\) or data.dataset_path",
    ):
        TextLMDataModule()
    with pytest.raises(
        ValueError,
        match=r"pass exactly one corpus: data.files \(globs of .txt/.jsonl/.parquet files\) or data.dataset_path",
    ):
        TextLMDataModule(files="a/*.txt", dataset_path="d")
    dm = _dm(tmp_path, files=str(tmp_path / "nothing" / "*.jsonl"))
    with pytest.raises(ValueError, match=r"files='.*nothing/\*\.jsonl' matches no file .*check the path"):
        dm.prepare_data()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "dataset"])
def test_a_missing_text_field_names_the_fields_there(tmp_path, docs, tokenizer_file, fmt):
    if fmt == "dataset":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "ds"))
        dm = _dm(tmp_path, dataset_path=str(tmp_path / "ds"), tokenizer_path=str(tokenizer_file))
    else:
        dm = _dm(
            tmp_path,
            files=_write_corpus(tmp_path / "c", docs, fmt),
            text_field="body",
            tokenizer_path=str(tokenizer_file),
        )
    with pytest.raises(ValueError, match=r"has no text field '(body|text)' \(it has .*\); set data.text_field"):
        dm.prepare_data()
    stores = tmp_path / "cache" / "text-lm"  # nothing but the builders' lock file
    assert not stores.exists() or all(p.name.endswith(".lock") for p in stores.iterdir())


def test_a_tokenizer_larger_than_vocab_size_is_refused(tmp_path, docs, tokenizer_file):
    dm = _dm(
        tmp_path, files=_write_corpus(tmp_path / "c", docs, "txt"), tokenizer_path=str(tokenizer_file), vocab_size=100
    )
    with pytest.raises(ValueError, match=r"has 300 tokens but vocab_size=100; .*set vocab_size >= 300"):
        dm.prepare_data()


def test_a_tokenizer_without_an_end_of_document_token_needs_eos_token(tmp_path, docs):
    odd = _gpt2_style_tokenizer(tmp_path / "odd" / "tokenizer.json", docs, eos="<doc-end>")
    dm = _dm(tmp_path, files=_write_corpus(tmp_path / "c", docs, "txt"), tokenizer_path=str(odd))
    with pytest.raises(ValueError, match=r"has no end-of-document token .*set data.eos_token"):
        dm.prepare_data()
    dm = _dm(tmp_path, files=_write_corpus(tmp_path / "c", docs, "txt"), tokenizer_path=str(odd), eos_token="<doc-end>")
    assert (_stored(dm) == dm.tokenizer.token_to_id("<doc-end>")).sum() == len(docs)


@pytest.mark.parametrize("content", [b"text\0with a NUL byte\n", "caf\u00e9 in latin-1\n".encode("latin-1")])
def test_binary_or_non_utf8_files_are_refused_with_the_fix(tmp_path, docs, tokenizer_file, content):
    folder = tmp_path / "c"
    _write_corpus(folder, docs, "txt")
    (folder / "doc999.txt").write_bytes(content)
    dm = _dm(tmp_path, files=str(folder / "*.txt"), tokenizer_path=str(tokenizer_file))
    with pytest.raises(ValueError, match=r"doc999\.txt' is binary or not UTF-8 text .*convert it to UTF-8"):
        dm.prepare_data()


def test_a_token_dir_written_by_another_tokenizer_is_refused_and_kept(tmp_path, docs, tokenizer_file):
    files = _write_corpus(tmp_path / "c", docs, "txt")
    store = tmp_path / "tokens"
    _stored(_dm(tmp_path, files=files, tokenizer_path=str(tokenizer_file), token_dir=str(store)))
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    other = _gpt2_style_tokenizer(tmp_path / "other" / "tokenizer.json", docs[:10], vocab=280)
    dm = _dm(tmp_path, files=files, tokenizer_path=str(other), token_dir=str(store))
    with pytest.raises(
        ValueError,
        match=r"was written by another tokenizer .*nothing was overwritten: pass a new "
        r"data.token_dir",
    ):
        dm.prepare_data()
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before

    stranger = tmp_path / "mine"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("keep me")
    dm = _dm(tmp_path, files=files, tokenizer_path=str(tokenizer_file), token_dir=str(stranger))
    with pytest.raises(
        ValueError,
        match=r"exists and is not a token store \(no meta.json\); nothing was overwritten: pass an empty or new folder",
    ):
        dm.prepare_data()
    assert [p.name for p in stranger.iterdir()] == ["notes.txt"]


def test_a_json_file_that_is_not_json_lines_names_the_line(tmp_path, tokenizer_file):
    (tmp_path / "array.json").write_text('[{"text": "a"},\n {"text": "b"}]\n')
    dm = _dm(tmp_path, files=str(tmp_path / "array.json"), tokenizer_path=str(tokenizer_file))
    with pytest.raises(ValueError, match=r"line 1 is not JSON .*write it as JSON lines"):
        dm.prepare_data()


def test_an_empty_validation_split_is_said(tmp_path, docs, tokenizer_file):
    dm = _dm(
        tmp_path,
        files=_write_corpus(tmp_path / "c", docs[:2], "txt"),
        tokenizer_path=str(tokenizer_file),
        val_fraction=0.01,
    )
    with pytest.warns(
        UserWarning, match=r"validation split .* is empty .*raise data.val_fraction or pass data.val_files"
    ):
        dm.setup("fit")
    assert dm.val_dataloader() == []
