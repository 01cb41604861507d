"""CodePairsDataModule: docstring/body pair classification built from a small generated tree of .py files."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
import torch
from helpers.cli import CONFIGS, TINY_ENCODER, TINY_TRAINER, _callbacks_config, _run
from helpers.code_tree import write_tree
from mlflow.tracking import MlflowClient

from comera_lightning.data import CODE_PAIR_LABELS, CodePairsDataModule, extract_documented_functions
from comera_lightning.data import code_pairs as code_pairs_mod
from comera_lightning.data import tokenizer as tokenizer_mod


@pytest.fixture
def tree(tmp_path) -> tuple[Path, dict]:
    root = tmp_path / "src"
    return root, write_tree(root)


def _dm(root: Path, cache: Path, **kw) -> CodePairsDataModule:
    args = dict(root=str(root), vocab_size=400, seq_len=64, batch_size=8, val_fraction=0.4, cache_dir=str(cache))
    return CodePairsDataModule(**{**args, **kw})


def test_extraction_keeps_documented_functions_and_strips_the_docstring():
    src = (
        'class A:\n    @property\n    def m(self):\n        """Return the value of the thing.\n\n'
        '        More text.\n        """\n\n        z = self.value\n        return z * 2\n\n'
        '    async def g(self): "Await the thing and return it."; return await self.thing()\n\n'
        '    def stub(self):\n        """An abstract stub method here."""\n        ...\n\n'
        'def outer():\n    """Outer function with a closure."""\n    def inner(a):\n'
        '        """Inner function adds numbers."""\n        return a + 1 + 2\n    return inner\n'
    )
    found = {fn.name: fn for fn in extract_documented_functions(src, "x.py")}
    assert list(found) == ["A.m", "A.g", "outer", "outer.<locals>.inner"]  # stub: too little code
    assert found["A.m"].docstring == "Return the value of the thing.\n\nMore text."
    assert found["A.m"].body == "def m(self):\n    z = self.value\n    return z * 2"
    assert found["A.g"].body == "async def g(self):  return await self.thing()"
    assert found["outer.<locals>.inner"].body == "def inner(a):\n    return a + 1 + 2"
    assert '"""Inner function adds numbers."""' in found["outer"].body  # only its own docstring goes
    assert found["A.m"].path == "x.py" and found["A.m"].lineno == 3
    assert extract_documented_functions("def f(:\n  pass\n") == []
    assert extract_documented_functions("x = 1\0\n") == []


def test_labels_balanced_and_correct(tree, tmp_path):
    root, expected = tree
    dm = _dm(root, tmp_path / "cache")
    for split in ("train", "val"):
        pairs = dm.examples(split)
        counts = collections.Counter(p.label for p in pairs)
        assert counts[0] == counts[1] == counts[2] > 0 and set(counts) == {0, 1, 2}
        for k in range(0, len(pairs), 3):  # one anchor's three examples, in label order
            assert [p.label for p in pairs[k : k + 3]] == [0, 1, 2]
            assert len({p.anchor for p in pairs[k : k + 3]}) == 1
        for p in pairs:
            assert (p.anchor.docstring, p.anchor.body) == expected[(p.anchor.path, p.anchor.name)]
            assert (p.source.docstring, p.source.body) == expected[(p.source.path, p.source.name)]
            assert p.text_a == p.anchor.docstring and p.text_b == p.source.body
            if p.label == 0:
                assert p.source == p.anchor
            elif p.label == 1:
                assert p.source.path == p.anchor.path and p.source.name != p.anchor.name
            else:
                assert p.source.path != p.anchor.path
            if p.label:  # a negative never repeats the anchor's docstring (the shared method docstring)
                assert p.source.docstring != p.anchor.docstring and p.source.body != p.anchor.body
                a, b = p.anchor.name, p.source.name  # nor is one nested in the other (wrapper_i and its inner)
                assert p.source.path != p.anchor.path or not (a.startswith(b + ".") or b.startswith(a + "."))
    # exactly the usable functions: not undocumented(), not tiny(), nothing from broken.py
    assert {(fn.path, fn.name) for fn in dm.functions("train") + dm.functions("val")} == set(expected)

    # the encoded rows are these examples, in this order: labels and segment A decode back
    dm.setup("fit")
    rows = dm.train_dataset.tensors
    pairs = dm.examples("train")
    assert rows["labels"].tolist() == [p.label for p in pairs]
    for r in (0, 1, 5):
        ids = rows["input_ids"][r].long().tolist()
        start, length = int(rows["type_start"][r]), int(rows["length"][r])
        assert dm.tokenizer.decode(ids[1 : start - 1]) == pairs[r].text_a
        assert dm.tokenizer.decode(ids[start : length - 1]) == pairs[r].text_b


def test_split_by_file_without_leakage(tree, tmp_path):
    root, _ = tree
    dm = _dm(root, tmp_path / "cache")
    train_files, val_files = map(set, dm.split_files())
    assert train_files and val_files and not train_files & val_files
    assert "pkg0/broken.py" in train_files | val_files  # discovered, then skipped as unparsable
    for split, files in (("train", train_files), ("val", val_files)):
        for p in dm.examples(split):
            assert p.anchor.path in files and p.source.path in files
    assert len({p.anchor.path for p in dm.examples("val")}) >= 2


def test_deterministic_for_a_seed_and_different_for_another(tree, tmp_path):
    root, _ = tree
    runs = []
    for seed, cache in ((0, "a"), (0, "b"), (1, "a")):
        dm = _dm(root, tmp_path / cache, seed=seed)
        dm.setup("fit")
        runs.append(
            (
                dm.train_dataset.tensors,
                dm.val_dataset.tensors,
                [(p.anchor.name, p.source.path, p.source.name) for p in dm.examples("train")],
            )
        )
    for name in ("input_ids", "length", "type_start", "labels"):
        assert torch.equal(runs[0][0][name], runs[1][0][name]) and torch.equal(runs[0][1][name], runs[1][1][name])
    assert runs[0][2] == runs[1][2] and runs[0][2] != runs[2][2]
    assert sorted(runs[0][2]) != sorted(runs[2][2])  # other negatives, not only another order


def test_cache_is_reused_on_a_second_setup(tree, tmp_path, monkeypatch):
    root, _ = tree
    first = _dm(root, tmp_path / "cache")
    first.prepare_data()
    first.setup("fit")
    assert first.tokenizer_trained
    assert len(list((tmp_path / "cache").glob("encoded/code-pairs-*.pt"))) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("rebuilt instead of loaded from the cache")

    monkeypatch.setattr(tokenizer_mod, "train_bpe_tokenizer", refuse)
    monkeypatch.setattr(code_pairs_mod, "encode_pair_rows", refuse)
    monkeypatch.setattr(code_pairs_mod, "extract_documented_functions", refuse)
    again = _dm(root, tmp_path / "cache")
    again.prepare_data()
    again.setup("fit")
    assert not again.tokenizer_trained
    assert torch.equal(again.train_dataset.tensors["input_ids"], first.train_dataset.tensors["input_ids"])

    monkeypatch.undo()
    monkeypatch.setattr(tokenizer_mod, "train_bpe_tokenizer", refuse)  # the tokenizer does not depend on seed
    _dm(root, tmp_path / "cache", seed=3).setup("fit")
    assert len(list((tmp_path / "cache").glob("encoded/code-pairs-*.pt"))) == 2
    (root / "pkg1" / "mod1.py").write_text((root / "pkg1" / "mod1.py").read_text() + "\n# changed\n")
    monkeypatch.undo()
    changed = _dm(root, tmp_path / "cache")
    changed.setup("fit")
    assert changed.tokenizer_trained or "mod1.py" in changed.split_files()[1]  # a changed corpus is a new key
    assert len(list((tmp_path / "cache").glob("encoded/code-pairs-*.pt"))) == 3


def test_max_examples_caps_both_splits(tree, tmp_path):
    root, _ = tree
    dm = _dm(root, tmp_path / "cache", max_examples=20)
    assert len(dm.examples("train")) == 18  # 6 anchors
    assert len(dm.examples("val")) == 3 * max(1, round(6 * 0.4 / 0.6))


def test_batches_have_the_mnli_layout(tree, tmp_path):
    root, _ = tree
    dm = _dm(root, tmp_path / "cache")
    dm.setup("fit")
    assert dm.num_classes == 3 and CODE_PAIR_LABELS == ("match", "same_module", "other_module")
    assert 261 <= dm.vocab_size_actual <= dm.vocab_size == 400
    ids = dm.special_ids
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader()):
        batch = next(iter(loader))
        assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
        assert all(t.dtype == torch.long for t in batch.values())
        assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["token_type_ids"].shape == (8, 64)
        assert batch["labels"].shape == (8,) and set(batch["labels"].tolist()) <= {0, 1, 2}
        assert (batch["input_ids"][:, 0] == ids.cls).all()
        assert ((batch["input_ids"] == ids.pad) == (batch["attention_mask"] == 0)).all()
    val = next(iter(dm.val_dataloader()))
    test = next(iter(dm.test_dataloader()))
    assert all(torch.equal(val[k], test[k]) for k in val)  # the test loader is the validation split


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(val_fraction=0.0), r"val_fraction must be in \(0, 1\) .*got 0.0"),
        (dict(val_fraction=1.0), r"val_fraction must be in \(0, 1\) .*got 1.0"),
        (dict(seq_len=4), r"seq_len must be >= 5 \(\[CLS\] docstring \[SEP\] body \[SEP\]\), got 4"),
        (dict(vocab_size=100), r"vocab_size must be >= 261 for a byte-level BPE .*got 100"),
        (dict(batch_size=0), "batch_size must be >= 1, got 0"),
        (dict(max_examples=2), r"max_examples must be >= 3 \(one example per class\) or None, got 2"),
        (dict(max_files=3), r"max_files must be >= 4 or None \(each split needs two files with documented functions\)"),
        (dict(num_workers=-1), "num_workers must be >= 0, got -1"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CodePairsDataModule(**kwargs)


def test_trees_without_usable_functions_fail_clearly(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        ValueError, match=r"no file matching .*; point root= at a folder with source files or change pattern="
    ):
        _dm(empty, tmp_path / "cache").prepare_data()

    plain = tmp_path / "plain"
    for i in range(6):
        (plain / f"m{i}.py").parent.mkdir(parents=True, exist_ok=True)
        (plain / f"m{i}.py").write_text("def f(x):\n    return x + 1 + 2\n")
    with pytest.raises(ValueError) as info:
        _dm(plain, tmp_path / "cache").prepare_data()
    message = str(info.value)
    assert str(plain) in message and "training split" in message and "root=" in message
    assert not list((tmp_path / "cache").rglob("*.json"))  # refused before a tokenizer was trained

    # documented functions, but only in one file: no other_module negatives anywhere
    lonely = tmp_path / "lonely"
    write_tree(lonely, n_files=1)
    with pytest.raises(
        ValueError, match=r"no code-pair examples .*every split needs at least two files with documented functions"
    ):
        _dm(lonely, tmp_path / "cache2").prepare_data()


def test_binary_files_are_skipped_like_in_the_mlm_corpus(tree, tmp_path):
    root, _ = tree
    (root / "pkg1" / "frozen.py").write_bytes(b"\x00\xff" * 200)
    dm = _dm(root, tmp_path / "cache")
    with pytest.warns(UserWarning, match=r"skipping 1 of 12 file\(s\).*pkg1/frozen\.py"):
        train, val = dm.split_files()
    assert "pkg1/frozen.py" not in train + val
    assert dm.examples("train") and dm.examples("val")


@pytest.mark.slow
def test_cli_fits_on_a_small_tree(workdir):
    """The shipped config through the real `comera fit` entry point, at tiny sizes, validating by step."""
    root = workdir / "src"
    write_tree(root, n_files=12)
    cli = _run(
        "fit",
        f"--config={CONFIGS / 'code_pairs.yaml'}",
        *TINY_ENCODER,
        f"--config={_callbacks_config(workdir, target_compression=3.0)}",
        *TINY_TRAINER,
        f"--data.root={root}",
        "--data.val_fraction=0.4",
        "--trainer.val_check_interval=3",
    )
    assert isinstance(cli.datamodule, CodePairsDataModule)
    assert cli.trainer.global_step == 6
    assert 0.0 <= float(cli.trainer.callback_metrics["val/accuracy"]) <= 1.0
    history = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"]).get_metric_history(
        cli.trainer.logger.run_id, "val/accuracy"
    )
    assert len(history) == 2  # after steps 3 and 6: by global step, not once per epoch
