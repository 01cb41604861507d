"""Stable hashing, file discovery, the by-file split, seeded row subsets and the loaders' samplers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from comera_lightning.data import common
from comera_lightning.data.common import (
    ResumableDataLoader,
    TensorDictDataset,
    check_limit,
    discover_files,
    identity_collate,
    is_binary_bytes,
    read_source_text,
    rows_loader,
    seeded_subsets,
    split_by_hash,
    stable_hash,
    stable_hash_many,
    stable_unit,
)
from comera_lightning.data.ctr import hash_categorical

_VALUES = ["68fd1e64", "80e26c9b", "hello", "é", "0"]


def _touch(path, text="x = 1\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_stable_hash_is_not_salted_per_process():
    # a child with another PYTHONHASHSEED (common.py alone: no Lightning import, a fast process)
    code = textwrap.dedent(
        f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("common_alone", {str(Path(common.__file__))!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        print(hash("abc"), mod.stable_hash("asyncio/tasks.py", "split"), mod.stable_hash_many(VALUES, "c4").tolist())
        """
    ).replace("VALUES", repr(_VALUES))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    child_builtin, child_hash, child_many = out.split(" ", 2)
    if os.environ.get("PYTHONHASHSEED") != "12345":
        assert int(child_builtin) != hash("abc")  # the builtin hash IS salted per process ...
    assert int(child_hash) == stable_hash("asyncio/tasks.py", "split")  # ... ours is not
    assert eval(child_many) == stable_hash_many(_VALUES, "c4").tolist()
    # pinned values: a changed hash would silently move files between splits and categories between rows
    assert stable_hash("Lib/os.py") == 18178099887625071082
    assert stable_hash("abc", "split") == 7574370118008991040
    ids = hash_categorical(["68fd1e64", "80e26c9b", "fb936136", "7b4723c4", "hello", None], 0, 10_000_000)
    assert ids.tolist() == [1523606, 6339845, 9117536, 7566095, 7317062, 0]
    assert stable_hash("abc", "split") != stable_hash("abc", "other")
    assert 0.0 <= stable_unit("abc") < 1.0


def test_stable_hash_many_hex_fast_path_and_fallback():
    values = ["c81ab21c", "C81AB21C", "00c81ab21c", "zz", "é", "0123456789abcdef0", "0"]
    h = stable_hash_many(values, "s")
    assert h.dtype == np.uint64
    assert h[0] == h[1] == h[2]  # hex values: case and leading zeros do not matter
    assert h[3] == stable_hash("zz", "s") and h[4] == stable_hash("é", "s") and h[5] == stable_hash(values[5], "s")
    assert h[0] != stable_hash_many(["c81ab21c"], "t")[0]  # keyed by the salt
    assert len(set(stable_hash_many([f"{i:08x}" for i in range(10000)]).tolist())) == 10000


def test_discover_files_skips_packages_tests_hidden_and_caches(tmp_path):
    for rel in [
        "a.py",
        "pkg/b.py",
        "pkg/c.txt",
        "site-packages/d.py",
        "pkg/__pycache__/e.py",
        "tests/f.py",
        "pkg/test/g.py",
        "idle_test/h.py",
        ".hidden/i.py",
        "sub/dist-packages/j.py",
    ]:
        _touch(tmp_path / rel)
    assert discover_files(tmp_path) == ["a.py", "pkg/b.py"]
    assert discover_files(tmp_path, include_tests=True) == [
        "a.py",
        "idle_test/h.py",
        "pkg/b.py",
        "pkg/test/g.py",
        "tests/f.py",
    ]
    assert discover_files(tmp_path, "*.txt") == ["pkg/c.txt"]


def test_discover_files_max_files_is_a_deterministic_spread_subset(tmp_path):
    for i in range(40):
        _touch(tmp_path / f"d{i % 4}" / f"m{i:02d}.py")
    every = discover_files(tmp_path)
    some = discover_files(tmp_path, max_files=10)
    assert len(some) == 10 and set(some) <= set(every) and some == sorted(some)
    assert some == discover_files(tmp_path, max_files=10)
    assert some != every[:10]  # not simply the alphabetically first ones
    assert len({p.split("/")[0] for p in some}) > 1


@pytest.mark.parametrize("make", ["missing", "file", "empty", "nomatch"])
def test_discover_files_errors_name_the_path_and_the_fix(tmp_path, make):
    root = tmp_path / "corpus"
    if make == "file":
        root.write_text("x")
    elif make == "empty":
        root.mkdir()
    elif make == "nomatch":
        _touch(root / "notes.txt")
    with pytest.raises(ValueError, match="corpus") as info:
        discover_files(root)
    assert str(root) in str(info.value)
    assert "root=" in str(info.value) or "pattern=" in str(info.value)


#: bytes a source corpus must not hold: NULs and invalid UTF-8 (e.g. a compiled or encrypted file named .py)
BINARY = bytes(range(256)) * 4


def test_binary_means_not_utf8_or_containing_nul():
    assert not is_binary_bytes("x = 'é'  # ünïcode\n".encode()) and not is_binary_bytes(b"")
    assert is_binary_bytes(b"x = 1\0\n")  # valid UTF-8, but a NUL byte
    assert is_binary_bytes("x = 'é'\n".encode("latin-1"))  # no NUL, but not UTF-8
    assert is_binary_bytes(BINARY)


def test_discover_files_refuses_a_corpus_of_binary_files_naming_them(tmp_path):
    root = tmp_path / "corpus"
    for i in range(8):
        _touch(root / f"blob{i}.py")
        (root / f"blob{i}.py").write_bytes(BINARY)
    with pytest.raises(ValueError) as info:
        discover_files(root)
    message = str(info.value)
    assert str(root) in message and "8 of the 8 file(s)" in message and "binary" in message
    assert "blob0.py, blob1.py, blob2.py, blob3.py, blob4.py and 3 more" in message
    assert "root=" in message and "exclude" in message
    # a majority of binary files is refused too: root most likely points at the wrong folder
    _touch(root / "real.py")
    with pytest.raises(
        ValueError, match=r"8 of the 9 file\(s\) .* are binary, .*; point root= at a folder of source text files"
    ):
        discover_files(root)
    assert discover_files(root, text_only=False) == [f"blob{i}.py" for i in range(8)] + ["real.py"]


def test_discover_files_skips_a_stray_binary_file_with_a_warning_naming_it(tmp_path):
    for i in range(6):
        _touch(tmp_path / "pkg" / f"m{i}.py")
    (tmp_path / "pkg" / "compiled.py").write_bytes(BINARY)
    (tmp_path / "pkg" / "nul.py").write_bytes(b"x = 1\0\n")
    with pytest.warns(UserWarning, match=r"skipping 2 of 8 file\(s\).*binary.*pkg/compiled.py, pkg/nul.py") as rec:
        found = discover_files(tmp_path)
    assert found == [f"pkg/m{i}.py" for i in range(6)]
    assert str(tmp_path) in str(rec[0].message) and "exclude" in str(rec[0].message)
    with pytest.warns(UserWarning, match="pkg/compiled.py"):  # with max_files: among the selected files only
        assert set(discover_files(tmp_path, max_files=8)) == {f"pkg/m{i}.py" for i in range(6)}


def test_read_source_text_refuses_binary_bytes_naming_the_file(tmp_path):
    _touch(tmp_path / "ok.py", "s = 'é'\n")
    assert read_source_text(tmp_path / "ok.py") == "s = 'é'\n"
    (tmp_path / "bad.py").write_bytes(BINARY)
    with pytest.raises(
        ValueError,
        match=r"bad\.py' is binary, .*; exclude it from the corpus or point root= at a folder of source text files",
    ):
        read_source_text(tmp_path / "bad.py")


def test_split_by_hash_disjoint_stable_and_insensitive_to_other_files():
    files = [f"pkg{i % 7}/mod{i}.py" for i in range(200)]
    train, val = split_by_hash(files, 0.1)
    assert set(train).isdisjoint(val) and sorted(train + val) == sorted(files)
    assert 8 <= len(val) <= 35
    # pinned: the same files are held out in every process, on every machine, in every version
    assert val[:6] == [
        "pkg3/mod17.py",
        "pkg4/mod25.py",
        "pkg6/mod48.py",
        "pkg1/mod57.py",
        "pkg0/mod84.py",
        "pkg6/mod104.py",
    ]
    assert len(val) == 21
    train_r, val_r = split_by_hash(list(reversed(files)), 0.1)  # order of the input does not matter
    assert set(train_r) == set(train) and set(val_r) == set(val)
    more = files + [f"new/extra{i}.py" for i in range(100)]
    train2, val2 = split_by_hash(more, 0.1)
    assert set(val) <= set(val2) and set(train) <= set(train2)
    # tiny corpora still get one validation file and keep a training file
    assert [len(s) for s in split_by_hash(["a.py", "b.py"], 0.01)] == [1, 1]
    assert split_by_hash(["a.py"], 0.5) == (["a.py"], [])
    assert split_by_hash(files, 0.0)[1] == []
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\), got 1.0"):
        split_by_hash(files, 1.0)


def test_seeded_subsets_keep_rows_in_order_and_draw_split_after_split():
    splits = {"train": {"x": torch.arange(10), "y": -torch.arange(10)}, "val": {"x": torch.arange(6)}}
    out = seeded_subsets(splits, {"train": 4, "val": 2}, seed=3)
    g = torch.Generator().manual_seed(3)  # one generator, training first
    train_rows = torch.randperm(10, generator=g)[:4].sort().values
    val_rows = torch.randperm(6, generator=g)[:2].sort().values
    assert torch.equal(out["train"]["x"], train_rows) and torch.equal(out["train"]["y"], -train_rows)
    assert torch.equal(out["val"]["x"], val_rows)
    # a split that fits (or has no cap) is kept whole and draws nothing
    fits = seeded_subsets(splits, {"train": 10, "val": 2}, seed=3)
    assert torch.equal(fits["train"]["x"], torch.arange(10))
    first_draw = torch.randperm(6, generator=torch.Generator().manual_seed(3))[:2].sort().values
    assert torch.equal(fits["val"]["x"], first_draw)
    assert torch.equal(seeded_subsets(splits, {"train": None}, seed=3)["val"]["x"], torch.arange(6))
    with pytest.raises(ValueError, match="max_rows must be >= 1 or None, got 0"):
        check_limit("max_rows", 0)


def test_rows_loader_takes_a_sampler_for_training_and_evaluation():
    rows = TensorDictDataset(x=torch.arange(6))
    backwards = list(range(5, -1, -1))
    train = rows_loader(rows, batch_size=4, collate_fn=identity_collate, train=True, sampler=backwards)
    assert isinstance(train, ResumableDataLoader)
    evaluation = rows_loader(rows, batch_size=4, collate_fn=identity_collate, train=False, sampler=backwards)
    for loader in (train, evaluation):
        assert [int(x) for batch in loader for x in batch["x"]] == backwards
    in_order = rows_loader(rows, batch_size=4, collate_fn=identity_collate, train=False)
    assert [int(x) for batch in in_order for x in batch["x"]] == list(range(6))
