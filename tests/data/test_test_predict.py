"""test_dataloader / predict_dataloader of every data module: which rows, in which order, with what."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from helpers.code_tree import write_tree

from comera_lightning.data import (
    CODE_PAIR_LABELS,
    MNLI_LABELS,
    CodePairsDataModule,
    CriteoDataModule,
    MNLIDataModule,
    synthetic_criteo,
    write_synthetic_mnli,
)
from comera_lightning.data import common as common_mod

MNLI_KW = dict(vocab_size=600, seq_len=32, batch_size=16)
SMALL_TABLES = [100] * 26


@pytest.fixture
def notices(monkeypatch) -> list[str]:
    """The info messages saying that test/predict run on validation rows."""
    said: list[str] = []
    monkeypatch.setattr(common_mod, "rank_zero_info", said.append)
    return said


def _cat(loader, key: str) -> torch.Tensor:
    return torch.cat([batch[key] for batch in loader])


def _file_labels(path: Path) -> list[int]:
    with open(path, newline="") as fh:
        return [MNLI_LABELS[r["gold_label"]] for r in csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)]


# ------------------------------------------------------------------------------------------------ MLM
def test_mlm_test_and_predict_are_the_validation_rows_with_the_same_masks(stdlib_dm, notices):
    val = list(stdlib_dm.val_dataloader())
    test = list(stdlib_dm.test_dataloader())
    predict = list(stdlib_dm.predict_dataloader())
    assert len(val) == len(test) == len(predict) > 0
    for v, t, p in zip(val, test, predict, strict=True):
        assert set(t) == {"input_ids", "attention_mask", "labels"}
        assert set(p) == {"input_ids", "attention_mask", "labels", "index"}
        for key in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(v[key], t[key]) and torch.equal(v[key], p[key])
    index = torch.cat([p["index"] for p in predict])
    assert index.dtype == torch.long and index.tolist() == list(range(len(stdlib_dm.val_dataset)))
    # deterministic: a second predict pass masks the same positions
    again = list(stdlib_dm.predict_dataloader())
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(predict, again, strict=True))
    # said once per stage, naming the module and why
    assert len(notices) == 2 and all("CodeMLMDataModule" in n and "validation" in n for n in notices)
    assert "test" in notices[0] and "predict" in notices[1]


def test_mlm_setup_for_test_and_predict_stages(stdlib_cache, stdlib_kw):
    from comera_lightning.data import CodeMLMDataModule

    for stage in ("test", "predict"):
        dm = CodeMLMDataModule(cache_dir=str(stdlib_cache), **stdlib_kw)
        dm.setup(stage)
        assert dm.val_dataset is not None and len(dm.val_dataset) > 0
        loader = dm.test_dataloader() if stage == "test" else dm.predict_dataloader()
        assert next(iter(loader))["input_ids"].shape[1] == stdlib_kw["seq_len"]


# ------------------------------------------------------------------------------------------------ MNLI
@pytest.fixture(scope="module")
def mnli_dir(tmp_path_factory) -> Path:
    return write_synthetic_mnli(tmp_path_factory.mktemp("mnli"), 300, 40, fmt="tsv", seed=5)


def test_mnli_tests_on_the_other_validation_split(mnli_dir, tmp_path, notices):
    dm = MNLIDataModule(str(mnli_dir), cache_dir=str(tmp_path), **MNLI_KW)
    dm.setup("test")
    assert dm.resolved_test_split == "validation_mismatched"
    assert dm.train_dataset is None and dm.val_dataset is None  # test needs only its own split
    labels = _cat(dm.test_dataloader(), "labels").tolist()
    assert labels == _file_labels(mnli_dir / "dev_mismatched.tsv")
    assert labels != _file_labels(mnli_dir / "dev_matched.tsv")
    predict = list(dm.predict_dataloader())
    assert set(predict[0]) == {"input_ids", "attention_mask", "token_type_ids", "labels", "index"}
    assert torch.cat([b["index"] for b in predict]).tolist() == list(range(len(labels)))
    assert torch.cat([b["labels"] for b in predict]).tolist() == labels
    assert notices == [], "a held-out split is not the validation split"
    assert dm.class_names == ["entailment", "neutral", "contradiction"]
    # validating on the mismatched split tests on the matched one
    other = MNLIDataModule(str(mnli_dir), cache_dir=str(tmp_path), validation_split="validation_mismatched", **MNLI_KW)
    assert other.resolved_test_split == "validation_matched"


def test_mnli_falls_back_to_the_validation_split_and_says_so(mnli_dir, tmp_path, notices):
    data = tmp_path / "only_matched"
    data.mkdir()
    for name in ("train.tsv", "dev_matched.tsv"):
        (data / name).write_text((mnli_dir / name).read_text())
    dm = MNLIDataModule(str(data), cache_dir=str(tmp_path / "cache"), **MNLI_KW)
    dm.setup("fit")
    assert dm.resolved_test_split == "validation_matched"
    test_labels = _cat(dm.test_dataloader(), "labels")
    assert torch.equal(test_labels, _cat(dm.val_dataloader(), "labels"))
    dm.test_dataloader(), dm.predict_dataloader()
    assert len(notices) == 2 and "MNLIDataModule" in notices[0] and "test_split" in notices[0]


def test_mnli_labelled_test_file_is_preferred_and_unlabelled_ones_are_skipped(mnli_dir, tmp_path):
    data = tmp_path / "with_test"
    data.mkdir()
    for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
        (data / name).write_text((mnli_dir / name).read_text())
    # GLUE's test files have no label column at all: not testable, skipped when choosing
    rows = (mnli_dir / "dev_matched.tsv").read_text().splitlines()
    unlabelled = ["\t".join(r.split("\t")[:6]) for r in rows]
    (data / "test_matched.tsv").write_text("\n".join(unlabelled) + "\n")
    dm = MNLIDataModule(str(data), cache_dir=str(tmp_path / "c"), **MNLI_KW)
    assert dm.resolved_test_split == "validation_mismatched"
    with pytest.raises(ValueError, match=r"'test_matched'.*no labelled pairs.*test_split="):
        MNLIDataModule(str(data), cache_dir=str(tmp_path / "c"), test_split="test_matched", **MNLI_KW).setup("test")
    # a labelled test file is held out better than the other validation split
    (data / "test_matched.tsv").write_text((mnli_dir / "dev_matched.tsv").read_text().replace("synthetic", "held"))
    dm = MNLIDataModule(str(data), cache_dir=str(tmp_path / "c"), **MNLI_KW)
    assert dm.resolved_test_split == "test_matched"
    assert _cat(dm.test_dataloader(), "labels").tolist() == _file_labels(mnli_dir / "dev_matched.tsv")
    explicit = MNLIDataModule(str(data), cache_dir=str(tmp_path / "c"), test_split="validation_matched", **MNLI_KW)
    assert explicit.resolved_test_split == "validation_matched"
    with pytest.raises(ValueError, match=r"test_split must be one of \[.*\] or None \(choose\), got 'train'"):
        MNLIDataModule(str(data), test_split="train")


# ------------------------------------------------------------------------------------------------ code pairs
def test_code_pairs_test_and_predict_are_the_validation_examples(tmp_path, notices):
    root = tmp_path / "src"
    write_tree(root)
    dm = CodePairsDataModule(
        root=str(root), vocab_size=400, seq_len=64, batch_size=8, val_fraction=0.4, cache_dir=str(tmp_path / "cache")
    )
    dm.setup("predict")
    val, test, predict = list(dm.val_dataloader()), list(dm.test_dataloader()), list(dm.predict_dataloader())
    assert len(val) == len(test) == len(predict) > 0
    for v, t, p in zip(val, test, predict, strict=True):
        assert set(p) == set(v) | {"index"}
        assert all(torch.equal(v[k], t[k]) and torch.equal(v[k], p[k]) for k in v)
    index = torch.cat([p["index"] for p in predict]).tolist()
    assert index == list(range(len(dm.examples("val"))))
    assert torch.cat([p["labels"] for p in predict]).tolist() == [e.label for e in dm.examples("val")]
    assert dm.class_names == list(CODE_PAIR_LABELS)
    assert len(notices) == 2 and all("CodePairsDataModule" in n for n in notices)


# ------------------------------------------------------------------------------------------------ Criteo
def test_criteo_test_fraction_holds_out_the_last_rows():
    dm = CriteoDataModule(
        synthetic=True, num_samples=1000, table_sizes=SMALL_TABLES, batch_size=64, val_fraction=0.1, test_fraction=0.2
    )
    dm.setup("test")
    full = synthetic_criteo(1000, SMALL_TABLES, seed=0)
    assert (len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)) == (700, 100, 200)
    assert torch.equal(dm.val_dataset.tensors["labels"], full["labels"][700:800])
    assert torch.equal(_cat(dm.test_dataloader(), "labels"), full["labels"][800:])
    predict = list(dm.predict_dataloader())
    assert set(predict[0]) == {"dense", "sparse", "labels", "index"}
    assert torch.cat([b["index"] for b in predict]).tolist() == list(range(200))
    assert torch.equal(torch.cat([b["sparse"] for b in predict]), full["sparse"][800:])


def test_criteo_without_test_fraction_tests_on_validation_rows(notices):
    dm = CriteoDataModule(synthetic=True, num_samples=500, table_sizes=SMALL_TABLES, batch_size=64, val_fraction=0.1)
    dm.setup("predict")
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (450, 50)  # the split of earlier versions
    assert dm.test_dataset is dm.val_dataset
    assert torch.equal(_cat(dm.test_dataloader(), "labels"), _cat(dm.val_dataloader(), "labels"))
    assert len(list(dm.predict_dataloader())) == 1
    assert len(notices) == 2 and "test_fraction" in notices[0]
    for bad in (dict(test_fraction=1.0), dict(test_fraction=-0.1), dict(val_fraction=0.5, test_fraction=0.5)):
        with pytest.raises(
            ValueError,
            match=r"test_fraction must be in \[0, 1\) and val_fraction \+ test_fraction < 1 \(rows must be left to",
        ):
            CriteoDataModule(synthetic=True, **bad)
