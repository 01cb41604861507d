"""Criteo-format parsing, hashing, synthetic power-law data and CriteoDataModule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from comera_lightning.data import (
    DEFAULT_TABLE_SIZES,
    CriteoDataModule,
    hash_categorical,
    read_criteo_tsv,
    synthetic_criteo,
    write_synthetic_criteo_tsv,
)

SMALL = [1000] * 26


def _line(label, dense, cats):
    return "\t".join([label, *dense, *cats]) + "\n"


def test_parse_tsv_with_missing_values(tmp_path):
    dense1 = ["5", "", "-3", "0"] + ["1"] * 9
    cats1 = ["68fd1e64", ""] + ["80e26c9b"] * 24
    dense2 = [""] * 13
    cats2 = [""] * 25 + ["68fd1e64"]
    path = tmp_path / "day.tsv"
    path.write_text(_line("1", dense1, cats1) + _line("0", dense2, cats2))
    sizes = [50] * 25 + [7]
    out = read_criteo_tsv(path, sizes)
    assert out["dense"].shape == (2, 13) and out["dense"].dtype == torch.float32
    assert out["sparse"].shape == (2, 26) and out["labels"].tolist() == [1.0, 0.0]
    assert out["dense"][0, :4].tolist() == pytest.approx([math.log(6), 0.0, 0.0, 0.0])  # missing and <0 -> 0
    assert (out["dense"][1] == 0).all()
    sparse = out["sparse"].long()
    assert sparse[0, 1] == 0 and (sparse[1, :25] == 0).all()  # missing -> id 0
    assert sparse[0, 0] == hash_categorical(["68fd1e64"], 0, 50)[0] != 0
    assert sparse[1, 25] == hash_categorical(["68fd1e64"], 25, 7)[0]
    assert (sparse >= 0).all() and (sparse < torch.tensor(sizes)).all()
    # the same value in the same column -> the same id, in another column -> independently hashed
    assert len(set(sparse[0, 2:].tolist())) > 1


def test_unlabelled_or_malformed_file_is_refused(tmp_path):
    path = tmp_path / "test.txt"
    path.write_text("\t".join(["1"] * 13 + ["ab"] * 26) + "\n")  # 39 columns: Criteo's test.txt
    with pytest.raises(
        ValueError,
        match=r"not a labelled Criteo-format TSV \(label, 13 integer, 26 categorical columns, tab-separated\)",
    ):
        read_criteo_tsv(path)


def test_hash_ids_are_in_range_and_spread():
    values = [f"{i:08x}" for i in range(20000)]
    for size in (1, 2, 3, 1000):
        ids = hash_categorical(values, 5, size)
        assert ids.min() >= (0 if size == 1 else 1) and ids.max() < size
    ids = hash_categorical(values, 5, 1001)
    counts = np.bincount(ids, minlength=1001)[1:]
    assert counts.min() > 0 and counts.max() < 3 * counts.mean()  # roughly uniform
    assert not np.array_equal(ids, hash_categorical(values, 6, 1001))  # keyed by the column


def test_synthetic_shapes_ranges_and_determinism():
    sizes = [1, 2, 3, 10, 100, 1000] + [50] * 20
    data = synthetic_criteo(5000, sizes, seed=1)
    assert data["dense"].shape == (5000, 13) and data["dense"].dtype == torch.float32
    assert data["sparse"].shape == (5000, 26) and data["sparse"].dtype == torch.long
    assert data["labels"].shape == (5000,) and data["labels"].dtype == torch.float32
    assert (data["sparse"] >= 0).all() and (data["sparse"] < torch.tensor(sizes)).all()
    assert (data["sparse"][:, 0] == 0).all()
    assert (data["dense"] >= 0).all() and set(data["labels"].unique().tolist()) <= {0.0, 1.0}
    assert 0.2 < data["labels"].mean() < 0.3  # Criteo-like click rate
    again = synthetic_criteo(5000, sizes, seed=1)
    assert all(torch.equal(data[k], again[k]) for k in data)
    assert not torch.equal(data["sparse"], synthetic_criteo(5000, sizes, seed=2)["sparse"])


def test_synthetic_category_frequencies_follow_a_power_law():
    size = 100_000
    data = synthetic_criteo(50_000, [size] * 26, seed=0, alpha=1.05)
    ids = data["sparse"][:, 3]
    ids = ids[ids != 0]
    counts = np.sort(np.bincount(ids.numpy(), minlength=size))[::-1]
    top = counts[: size // 100].sum() / counts.sum()
    assert top > 0.5  # the top 1% of ids cover most rows (uniform would give 1%)
    assert (counts > 0).sum() < 0.5 * size  # a long tail never seen
    ranks = np.arange(1, 101)
    slope = np.polyfit(np.log(ranks), np.log(counts[:100]), 1)[0]
    assert -1.35 < slope < -0.8  # Zipf: frequency ~ rank^-alpha
    # the popular ids are scattered over the table, not 1, 2, 3, ...
    popular = np.argsort(np.bincount(ids.numpy(), minlength=size))[::-1][:10]
    assert popular.max() > 1000


def _auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    order = scores.argsort()
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    pos = labels.bool()
    n_pos, n_neg = pos.sum().item(), (~pos).sum().item()
    return ((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)).item()


def test_datamodule_synthetic_batches_split_and_learnable():
    dm = CriteoDataModule(synthetic=True, num_samples=24_000, table_sizes=SMALL, batch_size=512, val_fraction=0.1)
    dm.setup("fit")
    assert len(dm.train_dataset) == 21_600 and len(dm.val_dataset) == 2_400
    full = synthetic_criteo(24_000, SMALL, seed=0)
    assert torch.equal(dm.val_dataset.tensors["labels"], full["labels"][21_600:])  # the last rows
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"dense", "sparse", "labels"}
    assert batch["dense"].shape == (512, 13) and batch["dense"].dtype == torch.float32
    assert batch["sparse"].shape == (512, 26) and batch["sparse"].dtype == torch.long
    assert batch["labels"].shape == (512,) and batch["labels"].dtype == torch.float32
    # a logistic model with one weight per id learns it
    torch.manual_seed(0)
    emb = torch.nn.Embedding(26 * 1000, 1)
    torch.nn.init.zeros_(emb.weight)
    lin = torch.nn.Linear(13, 1)
    opt = torch.optim.Adam([*emb.parameters(), *lin.parameters()], 0.05)
    offsets = torch.arange(26) * 1000

    def score(b):
        return emb(b["sparse"] + offsets).sum((1, 2)) + lin(b["dense"]).squeeze(1)

    for _ in range(2):
        for b in dm.train_dataloader():
            loss = torch.nn.functional.binary_cross_entropy_with_logits(score(b), b["labels"])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        batches = list(dm.val_dataloader())
        auc = _auc(torch.cat([score(b) for b in batches]), torch.cat([b["labels"] for b in batches]))
    assert auc > 0.65, auc


def test_tsv_round_trip_and_cache(tmp_path):
    path = write_synthetic_criteo_tsv(tmp_path / "data" / "day_0.tsv", 3000, SMALL, seed=4)
    first = path.read_text().splitlines()[0].split("\t")
    assert len(first) == 40 and all(len(c) in (0, 8) for c in first[14:])
    ref = synthetic_criteo(3000, SMALL, seed=4)
    dm = CriteoDataModule(
        data_dir=str(tmp_path / "data"), table_sizes=SMALL, batch_size=256, cache_dir=str(tmp_path / "cache")
    )
    dm.prepare_data()
    dm.setup("fit")
    got = {k: torch.cat([dm.train_dataset.tensors[k], dm.val_dataset.tensors[k]]) for k in ref}
    assert torch.equal(got["labels"], ref["labels"])
    assert torch.allclose(got["dense"], ref["dense"])
    assert torch.equal(got["sparse"] == 0, ref["sparse"] == 0)  # missing stays missing
    # equal generator ids hash to equal ids (column 7)
    a, b = ref["sparse"][:, 7], got["sparse"][:, 7].long()
    same_ref, same_got = a[:500, None] == a[None, :500], b[:500, None] == b[None, :500]
    assert not (same_ref & ~same_got).any()
    assert (same_got & ~same_ref).float().mean() < 0.01  # only rare hash collisions merge ids
    (cache,) = (tmp_path / "cache").glob("encoded/criteo-*.pt")
    mtime = cache.stat().st_mtime_ns
    again = CriteoDataModule(data_dir=str(path), table_sizes=SMALL, cache_dir=str(tmp_path / "cache"))
    assert again.load()["sparse"].shape == (3000, 26)
    again2 = CriteoDataModule(data_dir=str(tmp_path / "data"), table_sizes=SMALL, cache_dir=str(tmp_path / "cache"))
    again2.prepare_data()
    assert cache.stat().st_mtime_ns == mtime  # read from the cache, not parsed and written again
    assert torch.equal(again2.load()["sparse"], got["sparse"])


def test_datamodule_errors_and_defaults(tmp_path):
    with pytest.raises(
        ValueError, match="no data: pass data_dir= a folder of Criteo-format TSV files, or synthetic=True"
    ):
        CriteoDataModule()
    with pytest.raises(ValueError, match=r"pass either data_dir= \(Criteo TSV files\) or synthetic=True, not both"):
        CriteoDataModule(data_dir=str(tmp_path), synthetic=True)
    with pytest.raises(ValueError, match=r"table_sizes must be 26 positive ints \(one per categorical column\)"):
        CriteoDataModule(synthetic=True, table_sizes=[10] * 25)
    with pytest.raises(ValueError, match="does not exist; pass data_dir= a folder of Criteo-format TSV files"):
        CriteoDataModule(data_dir=str(tmp_path / "nope")).setup("fit")
    with pytest.raises(
        ValueError,
        match=r"no Criteo-format file .*; write one with write_synthetic_criteo_tsv\(\) or pass synthetic=True",
    ):
        CriteoDataModule(data_dir=str(tmp_path)).setup("fit")
    dm = CriteoDataModule(synthetic=True, num_samples=10)
    assert dm.table_sizes == list(DEFAULT_TABLE_SIZES) and len(dm.table_sizes) == 26
    assert sum(s >= 1_000_000 for s in dm.table_sizes) >= 3 and min(dm.table_sizes) < 10
