"""Verified caches (comera_lightning.data.cache): every kind of cache entry the data modules keep is verified
before use; damaged, truncated, stale or unmanifested entries are rebuilt with a warning naming them, or
refused with the fix; concurrent builders never leave a damaged entry."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from comera_lightning.data import CodeMLMDataModule, TextLMDataModule
from comera_lightning.data.cache import CacheError, cached_tensors, load_or_build, manifest_path, verify_cache
from comera_lightning.data.tokenizer import cached_bpe_tokenizer, load_tokenizer
from tests.helpers.code_tree import write_tree

SOURCE = {"corpus": "abc", "options": [1, 2]}


def _damage(path: Path, how: str, source: dict, files: list[str] | None = None) -> dict:
    """Damage the entry ``path`` the way ``how`` says; returns the source to ask for afterwards."""
    target = path / files[0] if files else path
    data = bytearray(target.read_bytes())
    if how == "damaged":  # same size, one byte flipped in the middle
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif how == "truncated":
        target.write_bytes(bytes(data[: len(data) // 3]))
    elif how == "stale":
        return {**source, "corpus": "changed"}
    elif how == "no manifest":
        manifest_path(path, files).unlink()
    elif how == "damaged manifest":
        manifest_path(path, files).write_text('{"format": 1, "files": ')
    return source


REASONS = {
    "damaged": "is damaged: the content of",
    "truncated": "is truncated:",
    "stale": r"is stale: .*\['corpus'\]",
    "no manifest": "has no manifest",
    "damaged manifest": "has a damaged manifest",
}


def _writer(payload: bytes, files: list[str] | None):
    def build(target: Path, progress) -> None:
        progress("half way")
        if files is None:
            target.write_bytes(payload)
        else:
            for name in files:
                (target / name).write_bytes(payload + name.encode())

    return build


@pytest.mark.parametrize("files", [None, ["train.bin", "val.bin"]], ids=["file", "folder"])
@pytest.mark.parametrize("how", list(REASONS))
def test_a_bad_entry_is_rebuilt_with_a_warning_naming_it(tmp_path, how, files):
    path = tmp_path / ("entry.bin" if files is None else "store")
    kw = dict(kind="test", version=1, files=files)
    entry, built = load_or_build(path, source=SOURCE, build=_writer(b"x" * 1000, files), **kw)
    assert built and entry == path and verify_cache(path, source=SOURCE, **kw) is None
    source = _damage(path, how, SOURCE, files)
    assert verify_cache(path, source=source, **kw) is not None  # never used as it is
    with pytest.warns(UserWarning, match=rf"cached test '{path}' {REASONS[how]}.*rebuilding it"):
        _, built = load_or_build(path, source=source, build=_writer(b"y" * 1000, files), **kw)
    assert built and verify_cache(path, source=source, **kw) is None
    first = path if files is None else path / files[0]
    assert first.read_bytes().startswith(b"y" * 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a good entry: used as it is, silently
        assert load_or_build(path, source=source, build=_writer(b"z", files), **kw)[1] is False


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_a_folder_entry_gets_the_mode_plain_mkdir_gives_under_the_umask(tmp_path, mask):
    previous = os.umask(mask)
    try:
        (tmp_path / "plain").mkdir()
        path = tmp_path / "store"
        kw = dict(kind="test", version=1, files=["train.bin"])
        load_or_build(path, source=SOURCE, build=_writer(b"x", ["train.bin"]), **kw)
        expected = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
        assert expected == 0o777 & ~mask
        assert stat.S_IMODE(path.stat().st_mode) == expected  # not tempfile.mkdtemp's 0o700
        with pytest.warns(UserWarning, match="is stale"):  # a rebuilt entry too
            load_or_build(path, source={**SOURCE, "corpus": "new"}, build=_writer(b"y", ["train.bin"]), **kw)
        assert stat.S_IMODE(path.stat().st_mode) == expected
        assert sorted(p.name for p in tmp_path.iterdir()) == [".store.lock", "plain", "store"]  # nothing left over
    finally:
        os.umask(previous)


def test_another_version_is_rebuilt_and_an_entry_that_cannot_be_rebuilt_names_the_file_and_the_fix(tmp_path):
    path = tmp_path / "entry.bin"
    load_or_build(path, kind="test", version=1, source=SOURCE, build=_writer(b"old", None))
    with pytest.warns(UserWarning, match=r"is of another format \(kind 'test' version 1.*expected 'test' version 2"):
        load_or_build(path, kind="test", version=2, source=SOURCE, build=_writer(b"new", None))
    path.write_bytes(b"nex")
    with pytest.raises(CacheError, match=rf"the cached test '{path}' is damaged.*Pass a new folder"):
        load_or_build(
            path,
            kind="test",
            version=2,
            source=SOURCE,
            build=_writer(b"new", None),
            rebuildable=False,
            fix="Pass a new folder.",
        )
    assert path.read_bytes() == b"nex"  # untouched


def test_an_entry_that_verifies_but_does_not_load_is_rebuilt(tmp_path):
    path = tmp_path / "rows.pt"
    kw = dict(kind="tensors", version=1, source=SOURCE)
    load_or_build(path, build=lambda target, progress: torch.save({"x": 1}, target), **kw)  # another layout
    with pytest.warns(UserWarning, match=r"rows.pt' does not load \(KeyError"):
        got, built = load_or_build(
            path,
            build=lambda target, progress: torch.save({"y": torch.arange(5)}, target),
            load=lambda p: torch.load(p, weights_only=True)["y"].sum(),
            **kw,
        )
    assert built and int(got) == 10


# ---------------------------------------------------------------------------------------------- the real kinds
def test_a_damaged_cached_tokenizer_is_trained_again(tmp_path, caplog, monkeypatch):
    # what ran before in the process decides whether Lightning's logger propagates (it stops once it has its own
    # console handler) and its level (the benchmark scripts, run in-process by their tests, set it to WARNING):
    # let caplog see the build message either way
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(50)]
    path, trained = cached_bpe_tokenizer(
        tmp_path, "code", {"corpus": "t"}, lambda: texts, 300, origin="50 test snippets"
    )
    assert trained and any(
        f"building the 'code' byte-level BPE tokenizer (vocabulary 300) from 50 test snippets into {path}" in r.message
        for r in caplog.records
    )
    reference = path.read_text()
    path.write_text(reference[: len(reference) // 2])  # a truncated JSON file: "EOF while parsing a string"
    with pytest.raises(ValueError, match=rf"tokenizer file '{path}' does not load .*copy it again"):
        load_tokenizer(path)  # as a user's own tokenizer_path: the file and the fix
    with pytest.warns(
        UserWarning,
        match=rf"cached 'code' byte-level BPE tokenizer \(vocabulary 300\) '{path}' is "
        "truncated",
    ):
        again, trained = cached_bpe_tokenizer(tmp_path, "code", {"corpus": "t"}, lambda: texts, 300)
    assert again == path and trained and path.read_text() == reference


def test_damaged_encoded_rows_are_encoded_again(tmp_path):
    write_tree(tmp_path / "src", n_files=8)
    kw = dict(
        root=str(tmp_path / "src"),
        cache_dir=str(tmp_path / "cache"),
        vocab_size=300,
        seq_len=32,
        val_fraction=0.25,
        batch_size=4,
    )
    first = CodeMLMDataModule(**kw)
    first.prepare_data()
    first.setup("fit")
    encoded = first._encoded_cache_path()
    data = encoded.read_bytes()
    encoded.write_bytes(data[:-100])
    second = CodeMLMDataModule(**kw)
    with pytest.warns(UserWarning, match=rf"cached encoded masked-LM rows '{encoded}' is truncated"):
        second.setup("fit")
    assert torch.equal(second.train_dataset.tensors["input_ids"], first.train_dataset.tensors["input_ids"])
    assert encoded.read_bytes() == data


def test_a_truncated_token_store_is_written_again_not_trained_on_in_part(tmp_path):
    (tmp_path / "c").mkdir()
    for i in range(30):
        (tmp_path / "c" / f"doc{i}.txt").write_text(f"document {i} says " + "word " * (i + 5))
    kw = dict(
        files=str(tmp_path / "c" / "*.txt"),
        vocab_size=300,
        seq_len=16,
        batch_size=4,
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.0,
    )
    first = TextLMDataModule(**kw)
    first.prepare_data()
    first.setup("fit")
    full = first.train_dataset.num_tokens
    store = first.token_folder() / "train.bin"
    store.write_bytes(store.read_bytes()[: store.stat().st_size // 2])  # a full disk, a killed writer
    second = TextLMDataModule(**kw)
    with pytest.warns(UserWarning, match=rf"cached token store '{first.token_folder()}' is truncated: '{store}'"):
        second.setup("fit")
    assert second.train_dataset.num_tokens == full
    assert np.array_equal(second.train_dataset.tokens(0, full), first.train_dataset.tokens(0, full))


# ---------------------------------------------------------------------------------------------- concurrency
def _build_concurrently(path: str, barrier, results, damage_first: bool) -> None:
    try:
        barrier.wait(timeout=30)

        def build(target: Path, progress) -> None:
            with open(target, "wb") as fh:
                for i in range(64):  # slow enough for the other builder to arrive meanwhile
                    fh.write(bytes([i]) * 4096)
                    os.sched_yield()

        _, built = load_or_build(path, kind="test", version=1, source=SOURCE, build=build)
        results.put(("ok", built))
    except BaseException as error:
        results.put(("failed", repr(error)))


def test_concurrent_builders_never_leave_a_damaged_cache(tmp_path):
    context = multiprocessing.get_context("fork")
    expected = b"".join(bytes([i]) * 4096 for i in range(64))
    damaged = 0
    for attempt in range(20):
        path = tmp_path / f"entry{attempt}.bin"
        if attempt % 2:  # half the tries start from a damaged entry, which both builders want to replace
            path.write_bytes(b"junk")
        barrier, results = context.Barrier(2), context.Queue()
        workers = [
            context.Process(target=_build_concurrently, args=(str(path), barrier, results, bool(attempt % 2)))
            for _ in range(2)
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for worker in workers:
                worker.start()
            outcomes = [results.get(timeout=60) for _ in workers]
            for worker in workers:
                worker.join(timeout=60)
        assert all(status == "ok" for status, _ in outcomes), outcomes  # neither run fails
        assert sum(built for _, built in outcomes) == 1, outcomes  # the second found the first one's entry
        if path.read_bytes() != expected or verify_cache(path, kind="test", version=1, source=SOURCE) is not None:
            damaged += 1
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert damaged == 0


def test_the_manifest_records_format_size_checksum_and_source(tmp_path):
    path = tmp_path / "rows.pt"
    cached_tensors(path, source=SOURCE, make=lambda: {"x": torch.arange(3)}, what="rows", origin="a test")
    record = json.loads(manifest_path(path).read_text())
    assert record["format"] == 1 and record["kind"] == "tensors" and record["source_parts"] == SOURCE
    assert record["files"]["rows.pt"]["size"] == path.stat().st_size
    assert record["files"]["rows.pt"]["fingerprint"].startswith("sha256:")
