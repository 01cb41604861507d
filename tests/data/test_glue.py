"""MNLIDataModule from GLUE TSV, JSONL and datasets.save_to_disk folders."""

from __future__ import annotations

import csv
import itertools
import json
import sys

import pytest
import torch

from comera_lightning.data import (
    MNLI_LABELS,
    MNLIDataModule,
    read_mnli_split,
    write_synthetic_mnli,
)
from comera_lightning.data import tokenizer as tokenizer_mod
from comera_lightning.data.glue import (
    detect_mnli_format,
    encode_pairs,
    truncate_longest_first,
)
from comera_lightning.data.tokenizer import SpecialTokenIds

KW = dict(vocab_size=600, seq_len=32, batch_size=16)


def _file_labels(path):
    with open(path, newline="") as fh:
        return [MNLI_LABELS[r["gold_label"]] for r in csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)]


@pytest.fixture(scope="module")
def tsv_dir(tmp_path_factory):
    return write_synthetic_mnli(tmp_path_factory.mktemp("mnli-tsv"), 600, 90, fmt="tsv", seed=3)


def test_tsv_batches_labels_and_segments(tsv_dir, tmp_path):
    dm = MNLIDataModule(str(tsv_dir), cache_dir=str(tmp_path), **KW)
    assert dm.resolved_format == "tsv"
    dm.prepare_data()
    dm.setup("fit")
    assert dm.tokenizer_trained and dm.vocab_size_actual <= 600
    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert batch[key].shape == (16, 32) and batch[key].dtype == torch.long
    assert batch["labels"].shape == (16,) and batch["labels"].dtype == torch.long
    # labels in file order for validation, mapped entailment=0, neutral=1, contradiction=2
    assert batch["labels"].tolist() == _file_labels(tsv_dir / "dev_matched.tsv")[:16]
    sp = dm.special_ids
    for ids, att, tt in zip(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], strict=True):
        n = int(att.sum())
        seps = (ids == sp.sep).nonzero().flatten().tolist()
        assert ids[0] == sp.cls and len(seps) == 2 and seps[1] == n - 1
        assert att[:n].all() and not att[n:].any() and (ids[n:] == sp.pad).all()
        assert tt[: seps[0] + 1].eq(0).all() and tt[seps[0] + 1 : n].eq(1).all() and tt[n:].eq(0).all()
    text = dm.tokenizer.decode(batch["input_ids"][0].tolist(), skip_special_tokens=False)
    assert text.startswith("[CLS]") and text.count("[SEP]") == 2
    # the second instance loads the cached tokenizer
    again = MNLIDataModule(str(tsv_dir), cache_dir=str(tmp_path), **KW)
    again.setup("fit")
    assert not again.tokenizer_trained and again.vocab_size_actual == dm.vocab_size_actual


def test_validation_split_choice(tsv_dir, tmp_path):
    dm = MNLIDataModule(str(tsv_dir), cache_dir=str(tmp_path), validation_split="validation_mismatched", **KW)
    dm.setup("fit")
    labels = torch.cat([b["labels"] for b in dm.val_dataloader()]).tolist()
    assert labels == _file_labels(tsv_dir / "dev_mismatched.tsv")
    assert labels != _file_labels(tsv_dir / "dev_matched.tsv")
    with pytest.raises(
        ValueError, match="validation_split must be 'validation_matched' or 'validation_mismatched', got 'test'"
    ):
        MNLIDataModule(str(tsv_dir), validation_split="test")


def test_glue_tsv_quirks(tmp_path):
    # GLUE's files: extra columns, unbalanced quotes, "label" instead of "gold_label", unlabelled rows
    rows = [
        ("index", "genre", "sentence1", "sentence2", "label"),
        ("0", "fiction", 'He said "hi to me.', "He spoke.", "entailment"),
        ("1", "fiction", "It rains.", 'It is "dry".', "contradiction"),
        ("2", "fiction", "No label here.", "Skipped.", "-"),
        ("3", "fiction", "A b.", "C d.", "neutral"),
        ("4", "fiction", "E f.", "G h.", "2"),
    ]
    text = "\n".join("\t".join(r) for r in rows) + "\n"
    for name in ("train.tsv", "dev_matched.tsv"):
        (tmp_path / name).write_text(text)
    a, b, y = read_mnli_split(tmp_path, "train")
    assert y == [0, 2, 1, 2]
    assert a[0] == 'He said "hi to me.' and b[1] == 'It is "dry".'
    (tmp_path / "train.tsv").write_text(text.replace("neutral", "maybe"))
    with pytest.raises(
        ValueError,
        match=r"unknown label 'maybe'; expected one of \['entailment', 'neutral', 'contradiction'\] or 0/1/2",
    ):
        read_mnli_split(tmp_path, "train")


def test_jsonl_int_and_string_labels_and_aliases(tmp_path):
    write_synthetic_mnli(tmp_path, 200, 30, fmt="jsonl", seed=1)
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    for i, r in enumerate(recs):  # mix int and string labels and one unlabelled row
        if i % 2:
            r["label"] = MNLI_LABELS[r["label"]]
    recs[5]["label"] = -1
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    assert detect_mnli_format(tmp_path) == "jsonl"
    _a, _b, y = read_mnli_split(tmp_path, "train")
    expected = [MNLI_LABELS[r["label"]] if isinstance(r["label"], str) else r["label"] for r in recs]
    assert y == [e for e in expected if e != -1] and len(y) == 199
    dm = MNLIDataModule(str(tmp_path), cache_dir=str(tmp_path / "cache"), **KW)
    dm.setup("fit")
    assert len(dm.train_dataset) == 199 and len(dm.val_dataset) == 30
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (16, 32)
    # MultiNLI's original field names and file names
    orig = tmp_path / "orig"
    orig.mkdir()
    with open(orig / "multinli_1.0_train.jsonl", "w") as fh:
        fh.write(json.dumps({"sentence1": "A.", "sentence2": "B.", "gold_label": "neutral"}) + "\n")
        fh.write(json.dumps({"sentence1": "C.", "sentence2": "D.", "gold_label": "-"}) + "\n")
    assert read_mnli_split(orig, "train") == (["A."], ["B."], [1])


def test_max_train_samples(tsv_dir, tmp_path):
    dm = MNLIDataModule(str(tsv_dir), cache_dir=str(tmp_path), max_train_samples=50, **KW)
    dm.setup("fit")
    assert len(dm.train_dataset) == 50
    assert dm.train_dataset.tensors["labels"].tolist() == _file_labels(tsv_dir / "train.tsv")[:50]


def test_truncate_longest_first_matches_reference_loop():
    def reference(la, lb, budget):
        while la + lb > budget:
            if la > lb:
                la -= 1
            else:
                lb -= 1
        return la, lb

    for la, lb, budget in itertools.product(range(12), range(12), range(0, 14)):
        assert truncate_longest_first(la, lb, budget) == reference(la, lb, budget), (la, lb, budget)


def test_encode_pairs_truncates_to_seq_len(tsv_dir, tmp_path):
    dm = MNLIDataModule(str(tsv_dir), cache_dir=str(tmp_path), **KW)
    tok, sp = dm.tokenizer, dm.special_ids
    long_a = " ".join(["the cat sees a dog"] * 20)
    enc = encode_pairs(tok, [long_a, "short.", long_a], ["tiny.", long_a, long_a], 24, sp)
    assert enc["input_ids"].shape == (3, 24) and enc["length"].tolist() == [24, 24, 24]
    n_short = len(tok.encode("short.", add_special_tokens=False).ids)
    assert enc["type_start"][1] == n_short + 2  # the short side is kept whole, the long one is cut
    n_tiny = len(tok.encode("tiny.", add_special_tokens=False).ids)
    assert enc["type_start"][0] == 24 - 1 - n_tiny  # [CLS] a [SEP] | tiny [SEP]
    assert (enc["input_ids"][:, -1] == sp.sep).all()
    assert enc["type_start"][2] in (12, 13)  # equal lengths: split evenly
    short_dm = MNLIDataModule(str(tsv_dir), cache_dir=str(tmp_path), vocab_size=600, seq_len=8, batch_size=4)
    short_dm.setup("fit")
    batch = next(iter(short_dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 8) and (batch["attention_mask"].sum(1) == 8).all()


def test_user_tokenizer_with_other_special_ids(tsv_dir, tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for w in (tsv_dir / "train.tsv").read_text().lower().replace(".", " .").split()})
    vocab = {w: i + 10 for i, w in enumerate(words)}
    vocab.update({"[PAD]": 3, "[UNK]": 4, "[CLS]": 7, "[SEP]": 8, "[MASK]": 9})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    monkeypatch.setattr(tokenizer_mod, "train_bpe_tokenizer", None)  # must not train
    dm = MNLIDataModule(str(tsv_dir), tokenizer_path=str(path), cache_dir=str(tmp_path), vocab_size=5000, seq_len=32)
    dm.setup("fit")
    assert dm.special_ids == SpecialTokenIds(pad=3, cls=7, sep=8, mask=9, unk=4)
    batch = next(iter(dm.val_dataloader()))
    assert (batch["input_ids"][:, 0] == 7).all() and ((batch["input_ids"] == 8).sum(1) == 2).all()
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 3).all()
    with pytest.raises(ValueError, match=r"has 1268 tokens but vocab_size=50; .*so set vocab_size >= 1268"):
        MNLIDataModule(str(tsv_dir), tokenizer_path=str(path), cache_dir=str(tmp_path), vocab_size=50).setup("fit")


def test_format_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot tell the MNLI format") as info:
        MNLIDataModule(str(tmp_path)).setup("fit")
    assert str(tmp_path) in str(info.value)
    with pytest.raises(ValueError, match="is not a directory; pass data_dir= the folder with the MNLI files"):
        MNLIDataModule(str(tmp_path / "missing")).setup("fit")
    with pytest.raises(ValueError, match=r"format must be one of \['auto', 'disk', 'tsv', 'jsonl'\], got 'csv'"):
        MNLIDataModule(str(tmp_path), format="csv")
    (tmp_path / "train.tsv").write_text("sentence1\tsentence2\tgold_label\na\tb\tneutral\n")
    with pytest.raises(
        ValueError,
        match=r"no file for MNLI split 'validation_matched' .*: expected one of .*dev_matched.tsv",
    ):
        MNLIDataModule(str(tmp_path), cache_dir=str(tmp_path / "c"), vocab_size=300).setup("fit")


def test_missing_datasets_library_gives_pip_command(tmp_path, monkeypatch):
    (tmp_path / "dataset_dict.json").write_text('{"splits": ["train"]}')
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(
        ImportError,
        match=r"needs the HuggingFace `datasets` library: pip install 'datasets>=2.14' \(or use the GLUE TSV / JSONL",
    ):
        read_mnli_split(tmp_path, "train")


def test_save_to_disk_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    # a ClassLabel in another order than ours: labels must go through the names
    names = ["contradiction", "entailment", "neutral"]
    features = datasets.Features(
        {
            "premise": datasets.Value("string"),
            "hypothesis": datasets.Value("string"),
            "label": datasets.ClassLabel(names=names),
            "idx": datasets.Value("int32"),
        }
    )

    def split(n, offset):
        return datasets.Dataset.from_dict(
            {
                "premise": [f"the cat sees a dog {i}." for i in range(n)],
                "hypothesis": [f"a dog sees the cat {i}." for i in range(n)],
                "label": [(i + offset) % 3 for i in range(n)],
                "idx": list(range(n)),
            },
            features=features,
        )

    dd = datasets.DatasetDict(
        {"train": split(60, 0), "validation_matched": split(12, 1), "validation_mismatched": split(9, 2)}
    )
    dd.save_to_disk(str(tmp_path / "mnli"))
    dm = MNLIDataModule(
        str(tmp_path / "mnli"), cache_dir=str(tmp_path / "cache"), vocab_size=400, seq_len=24, batch_size=8
    )
    assert dm.resolved_format == "disk"
    dm.setup("fit")
    assert len(dm.train_dataset) == 60 and len(dm.val_dataset) == 12
    expected = [MNLI_LABELS[names[(i + 1) % 3]] for i in range(12)]
    assert torch.cat([b["labels"] for b in dm.val_dataloader()]).tolist() == expected
    batch = next(iter(dm.train_dataloader()))
    assert batch["token_type_ids"].shape == (8, 24) and batch["token_type_ids"].sum() > 0


def test_synthetic_mnli_is_learnable(tmp_path):
    d = write_synthetic_mnli(tmp_path / "d", 1500, 300, fmt="tsv", seed=0)
    dm = MNLIDataModule(str(d), cache_dir=str(tmp_path / "c"), vocab_size=400, seq_len=32, batch_size=64)
    dm.setup("fit")
    counts = torch.bincount(dm.train_dataset.tensors["labels"], minlength=3)
    assert (counts > 400).all()  # balanced classes
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(dm.vocab_size_actual, 3, mode="sum")
    opt = torch.optim.Adam(bag.parameters(), 0.05)
    for _ in range(3):
        for batch in dm.train_dataloader():
            loss = torch.nn.functional.cross_entropy(bag(batch["input_ids"] * batch["attention_mask"]), batch["labels"])
            opt.zero_grad()
            loss.backward()
            opt.step()
    correct = total = 0
    with torch.no_grad():
        for batch in dm.val_dataloader():
            pred = bag(batch["input_ids"] * batch["attention_mask"]).argmax(1)
            correct += (pred == batch["labels"]).sum().item()
            total += len(pred)
    assert correct / total > 0.9
