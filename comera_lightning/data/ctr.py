"""Click-through-rate data in the Criteo format (DLRM): local TSV files or a realistic synthetic stand-in.

A Criteo row is ``label \\t I1..I13 \\t C1..C26``: a 0/1 click label, 13 integer count features and 26
categorical features written as 8-digit hex hashes; any feature may be empty (missing). Here:

* dense features become ``log(1 + max(x, 0))`` with missing = 0 (the DLRM reference preprocessing);
* categorical value ``v`` of column ``t`` becomes an id in ``[0, table_sizes[t])``: missing is id 0, a
  present value is ``1 + h(t, v) % (table_sizes[t] - 1)`` with ``h`` a keyed BLAKE2b hash, identical in
  every process and on every machine (Python's ``hash()`` of a str is salted per process and would give
  each DDP rank different ids);
* the validation set is the LAST ``val_fraction`` of the rows (Criteo files are in time order, so this
  is the usual "predict the future" split); with ``test_fraction`` the last rows are held out for
  ``test``/``predict`` and validation takes the ``val_fraction`` before them.

``synthetic_criteo`` draws data with the statistics that make CTR embedding tables hard: per table a
Zipf(``alpha``) popularity over ids (a few ids cover most rows, a long tail is seen rarely), heavy-tailed
counts with missing values, and clicks from a hidden logistic model of the dense features and per-id
effects (about 25% positives, like Criteo), so a model can reach a validation AUC well above 0.5.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from typing_extensions import override

from .base import ComeraDataModule
from .cache import cached_tensors
from .common import (
    TensorDictDataset,
    check_val_fraction,
    stable_hash_many,
    uses_validation_rows_notice,
)

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "DEFAULT_TABLE_SIZES",
    "NUM_DENSE",
    "NUM_SPARSE",
    "CTRCollator",
    "CriteoDataModule",
    "hash_categorical",
    "read_criteo_tsv",
    "synthetic_criteo",
    "transform_dense",
    "write_synthetic_criteo_tsv",
]

NUM_DENSE = 13
NUM_SPARSE = 26
#: distinct values per categorical column in the Criteo Kaggle (Display Advertising Challenge) training set
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
#: the Kaggle cardinalities capped at one million rows (5 large tables, the rest small): big enough that
#: TT-compressing the large tables matters, small enough for a laptop
DEFAULT_TABLE_SIZES: tuple[int, ...] = tuple(min(c, 1_000_000) for c in CRITEO_KAGGLE_CARDINALITIES)
_COLUMNS = ["label", *(f"I{i}" for i in range(1, NUM_DENSE + 1)), *(f"C{i}" for i in range(1, NUM_SPARSE + 1))]
_DATA_SUFFIXES = (".tsv", ".txt", ".tsv.gz", ".txt.gz", ".tsv.bz2", ".txt.bz2")


def _check_table_sizes(table_sizes: Sequence[int] | None) -> list[int]:
    sizes = list(DEFAULT_TABLE_SIZES if table_sizes is None else table_sizes)
    if len(sizes) != NUM_SPARSE or any(int(s) < 1 for s in sizes):
        raise ValueError(f"table_sizes must be {NUM_SPARSE} positive ints (one per categorical column), got {sizes}")
    return [int(s) for s in sizes]


def transform_dense(raw: np.ndarray) -> np.ndarray:
    """``log(1 + max(x, 0))`` with NaN (missing) as 0, as float32."""
    x = np.nan_to_num(np.asarray(raw, dtype=np.float64), nan=0.0)
    return np.log1p(np.maximum(x, 0.0)).astype(np.float32)


def hash_categorical(values: Sequence[str | None], column: int, table_size: int) -> np.ndarray:
    """Ids in ``[0, table_size)`` of raw categorical strings of column ``column`` (0-based).

    Missing (``None`` or ``""``) is 0; anything else is ``1 + h % (table_size - 1)`` (0 for a one-row
    table), where ``h`` is :func:`~comera_lightning.data.common.stable_hash_many` keyed by the column
    (vectorised for Criteo's hex values). Deterministic across processes, machines and Python versions.
    """
    values = list(values)
    n = len(values)
    out = np.zeros(n, dtype=np.int64)
    present = np.fromiter((v is not None and v != "" for v in values), dtype=bool, count=n)
    mod = table_size - 1
    if mod <= 0 or not present.any():
        return out
    idx = np.flatnonzero(present)
    h = stable_hash_many([v for v in values if v is not None and v != ""], f"criteo-c{column}")  # idx's order
    out[idx] = (1 + h % np.uint64(mod)).astype(np.int64)
    return out


def _open_criteo(path: Path, block_size: int):
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    types = {name: (pa.float64() if name[0] in "lI" else pa.string()) for name in _COLUMNS}
    return pa_csv.open_csv(
        str(path),
        read_options=pa_csv.ReadOptions(column_names=_COLUMNS, block_size=block_size),
        parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pa_csv.ConvertOptions(column_types=types, strings_can_be_null=True, null_values=[""]),
    )


def read_criteo_tsv(
    path: str | os.PathLike[str], table_sizes: Sequence[int] | None = None, block_size: int = 1 << 24
) -> dict[str, torch.Tensor]:
    """Parse one Criteo-format TSV (optionally .gz/.bz2) into model-ready tensors.

    Streams the file in blocks (pyarrow), hashes each block's distinct categorical values once, and
    keeps compact dtypes, so memory is about 110 bytes a row.

    Returns:
        ``dense`` (N, 13) float32 (transformed), ``sparse`` (N, 26) int32 ids, ``labels`` (N,) float32.

    Raises:
        ValueError: the file does not have 40 tab-separated columns (e.g. Criteo's unlabelled test.txt).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    sizes = _check_table_sizes(table_sizes)
    path = Path(path)
    dense_parts, sparse_parts, label_parts = [], [], []
    try:
        for batch in _open_criteo(path, block_size):
            n = batch.num_rows
            label = batch.column(0).to_numpy(zero_copy_only=False)
            if np.isnan(label).any():
                raise ValueError(f"{path}: some rows have no label (first column empty)")
            raw = np.stack([batch.column(1 + j).to_numpy(zero_copy_only=False) for j in range(NUM_DENSE)], axis=1)
            sparse = np.zeros((n, NUM_SPARSE), dtype=np.int32)
            for t in range(NUM_SPARSE):
                encoded = pc.dictionary_encode(batch.column(1 + NUM_DENSE + t))
                if isinstance(encoded, pa.ChunkedArray):
                    encoded = encoded.combine_chunks()
                uniques = encoded.dictionary.to_pylist()
                codes = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
                lut = np.append(hash_categorical(uniques, t, sizes[t]), 0)  # index -1 (missing) -> 0
                sparse[:, t] = lut[codes]
            dense_parts.append(transform_dense(raw))
            sparse_parts.append(sparse)
            label_parts.append(label.astype(np.float32))
    except pa.ArrowInvalid as err:
        raise ValueError(
            f"{path} is not a labelled Criteo-format TSV (label, 13 integer, 26 categorical columns, "
            f"tab-separated): {err}"
        ) from err
    if not label_parts:
        return {
            "dense": torch.zeros(0, NUM_DENSE),
            "sparse": torch.zeros(0, NUM_SPARSE, dtype=torch.int32),
            "labels": torch.zeros(0),
        }
    return {
        "dense": torch.from_numpy(np.concatenate(dense_parts)),
        "sparse": torch.from_numpy(np.concatenate(sparse_parts)),
        "labels": torch.from_numpy(np.concatenate(label_parts)),
    }


# ---------------------------------------------------------------------------------------------- synthetic
def _zipf_ids(rng: np.random.Generator, n: int, size: int, alpha: float) -> np.ndarray:
    """``n`` ids in ``[1, size)`` with Zipf(alpha) popularity, the popular ids scattered by a permutation."""
    k = size - 1
    if k <= 0:
        return np.zeros(n, dtype=np.int64)
    cdf = np.cumsum(np.arange(1, k + 1, dtype=np.float64) ** -alpha)
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), k - 1)
    return 1 + rng.permutation(k)[ranks]


def _synthetic_raw(
    num_samples: int, table_sizes: Sequence[int] | None, seed: int, alpha: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw synthetic rows: dense counts (NaN = missing), ids (0 = missing) and 0/1 labels."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    sizes = _check_table_sizes(table_sizes)
    rng = np.random.default_rng(seed)
    # dense: heavy-tailed counts (log-normal), a few columns with negative values, 0-40% missing per column
    scale = rng.uniform(0.5, 2.5, NUM_DENSE)
    raw = np.floor(np.exp(rng.normal(0.0, 1.0, (num_samples, NUM_DENSE)) * scale / 1.5 + scale))
    raw[:, 1] -= 3  # like Criteo's I2, which has small negative values
    missing_rate = rng.uniform(0.0, 0.4, NUM_DENSE)
    raw[rng.random((num_samples, NUM_DENSE)) < missing_rate] = np.nan
    # sparse: Zipf popularity per table, 0-20% missing in a third of the columns
    sparse = np.stack([_zipf_ids(rng, num_samples, s, alpha) for s in sizes], axis=1)
    cat_missing = np.where(rng.random(NUM_SPARSE) < 1 / 3, rng.uniform(0.0, 0.2, NUM_SPARSE), 0.0)
    sparse[rng.random((num_samples, NUM_SPARSE)) < cat_missing] = 0
    # hidden logistic model: standardised log-dense features and one random effect per id
    feats = transform_dense(raw).astype(np.float64)
    feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-6) if num_samples > 1 else feats
    logit = feats @ rng.normal(0.0, 0.25, NUM_DENSE)
    for t, size in enumerate(sizes):
        effect = rng.normal(0.0, 0.6 if t % 3 == 0 else 0.25, size)
        effect[0] = 0.0
        logit += effect[sparse[:, t]]
    # bias so that about 25% of the rows are clicks (Criteo's rate)
    lo, hi = -20.0, 20.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if num_samples and (1 / (1 + np.exp(-(logit + mid)))).mean() > 0.25:
            hi = mid
        else:
            lo = mid
    labels = (rng.random(num_samples) < 1 / (1 + np.exp(-(logit + (lo + hi) / 2)))).astype(np.float32)
    return raw, sparse, labels


def synthetic_criteo(
    num_samples: int, table_sizes: Sequence[int] | None = None, seed: int = 0, alpha: float = 1.05
) -> dict[str, torch.Tensor]:
    """SYNTHETIC Criteo-like rows, model-ready: ``dense`` (N, 13) float32, ``sparse`` (N, 26) int64,
    ``labels`` (N,) float32.

    Per table, ids in ``[1, size)`` follow a Zipf(``alpha``) popularity (0 = missing); clicks come from a
    hidden logistic model, so the rows are learnable (AUC > 0.5) and deterministic for a ``seed``.
    """
    raw, sparse, labels = _synthetic_raw(num_samples, table_sizes, seed, alpha)
    return {
        "dense": torch.from_numpy(transform_dense(raw)),
        "sparse": torch.from_numpy(sparse.astype(np.int64)),
        "labels": torch.from_numpy(labels),
    }


def _hex_value(ids: np.ndarray, column: int) -> np.ndarray:
    """A bijective 32-bit scramble of the ids of a column, like Criteo's hex hashes."""
    scrambled = ids.astype(np.uint64) * np.uint64(2654435761) + np.uint64(0x9E3779B9 * (column + 1))
    return scrambled & np.uint64(0xFFFFFFFF)


def write_synthetic_criteo_tsv(
    path: str | os.PathLike[str],
    num_samples: int,
    table_sizes: Sequence[int] | None = None,
    seed: int = 0,
    alpha: float = 1.05,
) -> Path:
    """Write the rows of :func:`synthetic_criteo` (same seed, same draws) as a raw Criteo TSV.

    Dense counts are written as integers, categorical ids as 8-digit hex strings, missing values as
    empty fields. Reading the file back hashes the hex strings into ``table_sizes`` (ids differ from the
    generator's, frequencies are kept up to hash collisions). Returns ``path``.
    """
    raw, sparse, labels = _synthetic_raw(num_samples, table_sizes, seed, alpha)
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    hexes = np.stack([_hex_value(sparse[:, t], t) for t in range(NUM_SPARSE)], axis=1)
    with open(path, "w", encoding="ascii", newline="\n") as fh:
        for i in range(num_samples):
            dense = ["" if np.isnan(x) else str(int(x)) for x in raw[i]]
            cats = ["" if sparse[i, t] == 0 else f"{int(hexes[i, t]):08x}" for t in range(NUM_SPARSE)]
            fh.write("\t".join([str(int(labels[i])), *dense, *cats]) + "\n")
    return path


# ---------------------------------------------------------------------------------------------- module
class CTRCollator:
    """Batch dict ``dense`` float32, ``sparse`` int64, ``labels`` float32 from stored compact tensors."""

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            "dense": batch["dense"].float(),
            "sparse": batch["sparse"].long(),
            "labels": batch["labels"].float(),
        }


def _criteo_files(data_dir: Path) -> list[Path]:
    if data_dir.is_file():
        return [data_dir]
    if not data_dir.is_dir():
        raise ValueError(
            f"Criteo data_dir {str(data_dir)!r} does not exist; pass data_dir= a folder of Criteo-format TSV "
            "files (or one file), or synthetic=True"
        )
    files = sorted(
        p for p in data_dir.iterdir() if p.is_file() and p.name.endswith(_DATA_SUFFIXES) and not p.name.startswith(".")
    )
    if not files:
        raise ValueError(
            f"no Criteo-format file ({', '.join('*' + s for s in _DATA_SUFFIXES)}) in {str(data_dir)!r}; "
            "write one with write_synthetic_criteo_tsv() or pass synthetic=True"
        )
    return files


class CriteoDataModule(ComeraDataModule):
    """Criteo-format CTR batches for DLRM-style models, from local TSV files or synthetic rows.

    Batches: ``dense`` (B, 13) float32, ``sparse`` (B, 26) int64 with column ``t`` in
    ``[0, table_sizes[t])`` (0 = missing), ``labels`` (B,) float32 in {0, 1}; prediction batches add
    ``index`` (B,) long, the row's number in the test slice.

    Splits, in time order: training, then validation (``val_fraction`` of the rows), then test
    (``test_fraction``, the last rows). With ``test_fraction=0`` (the default, which keeps the training and
    validation rows of earlier versions) ``test`` and ``predict`` run on the validation rows (said once at
    info level).

    Args:
        data_dir: a Criteo-format file or a folder of them (``*.tsv``, ``*.txt``, optionally ``.gz``/``.bz2``,
            read in name order and concatenated; Criteo's unlabelled ``test.txt`` must not be among them).
        synthetic: generate ``num_samples`` rows with :func:`synthetic_criteo` instead (no data_dir).
        num_samples: rows to generate when ``synthetic``.
        table_sizes: rows per embedding table, 26 ints; default :data:`DEFAULT_TABLE_SIZES`.
        batch_size: rows per batch.
        val_fraction: share of rows held out for validation, taken from the END (time order), before the
            test rows.
        test_fraction: share of rows held out for ``test``/``predict``, the very last ones; 0 tests on the
            validation rows.
        num_workers: DataLoader worker processes.
        seed: seeds the synthetic data and the training shuffle.
        cache_dir: if set, the parsed tensors of ``data_dir`` are saved there by ``prepare_data`` (keyed by
            file names, sizes, modification times and ``table_sizes``) and memory-mapped by later runs,
            which skips the parse (minutes for the full Kaggle set). Unused for synthetic data.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        synthetic: bool = False,
        num_samples: int = 100000,
        table_sizes: list[int] | None = None,
        batch_size: int = 2048,
        val_fraction: float = 0.05,
        test_fraction: float = 0.0,
        num_workers: int = 0,
        seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        if data_dir is not None and synthetic:
            raise ValueError("pass either data_dir= (Criteo TSV files) or synthetic=True, not both")
        if data_dir is None and not synthetic:
            raise ValueError("no data: pass data_dir= a folder of Criteo-format TSV files, or synthetic=True")
        check_val_fraction(val_fraction)
        if not 0.0 <= test_fraction < 1.0 or val_fraction + test_fraction >= 1.0:
            raise ValueError(
                f"test_fraction must be in [0, 1) and val_fraction + test_fraction < 1 (rows must be left to train "
                f"on), got test_fraction={test_fraction}, val_fraction={val_fraction}"
            )
        super().__init__(batch_size, num_workers, seed, cache_dir)
        self.save_hyperparameters()
        self.data_dir, self.synthetic, self.num_samples = data_dir, synthetic, num_samples
        self.table_sizes = _check_table_sizes(table_sizes)
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.num_dense_features = NUM_DENSE
        self.test_dataset: TensorDictDataset | None = None

    def load(self) -> dict[str, torch.Tensor]:
        """All rows (synthetic or read from ``data_dir``) before the split."""
        if self.synthetic:
            data = synthetic_criteo(self.num_samples, self.table_sizes, seed=self.seed)
            data["sparse"] = data["sparse"].to(torch.int32)
            return data
        if self.data_dir is None:
            raise ValueError("CriteoDataModule needs data_dir= a folder of Criteo-format TSV files, or synthetic=True")
        files = _criteo_files(Path(self.data_dir).expanduser())

        def parse() -> dict[str, torch.Tensor]:
            parts = [read_criteo_tsv(p, self.table_sizes) for p in files]
            return {k: torch.cat([p[k] for p in parts]) for k in ("dense", "sparse", "labels")}

        if self.cache_dir is None:
            return parse()
        stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        source = {"files": stats, "table_sizes": self.table_sizes, "version": 1}
        return cached_tensors(
            self._cache_file("criteo", source),
            source=source,
            make=parse,
            what="parsed Criteo rows",
            origin=f"{len(files)} file(s) in {self.data_dir}",
            mmap=True,
        )

    @override
    def prepare_data(self) -> None:
        """Parse ``data_dir`` once into the cache (only with ``cache_dir``; local rank zero)."""
        if self.cache_dir is not None and not self.synthetic:
            self.load()

    @override
    def setup(self, stage: str | None = None) -> None:
        """Generate or read the rows and split them in time order (training, validation, test); every stage
        builds all three (the rows are read once)."""
        if self.train_dataset is not None:
            return
        data = self.load()
        n = len(data["labels"])
        if n == 0:
            raise ValueError(
                f"no rows in {self.data_dir!r}: the Criteo files are empty; pass data_dir= files with rows (label, "
                f"13 integer and 26 categorical tab-separated columns) or synthetic=True"
                if not self.synthetic
                else "num_samples must be > 0"
            )
        n_test = round(n * self.test_fraction)
        if self.test_fraction > 0 and n >= 2:
            n_test = min(max(n_test, 1), n - 1)
        test_cut = n - n_test
        n_val = round(n * self.val_fraction)
        if self.val_fraction > 0 and test_cut >= 2:
            n_val = min(max(n_val, 1), test_cut - 1)
        n_val = min(n_val, max(test_cut - 1, 0))
        cut = test_cut - n_val
        self.train_dataset = TensorDictDataset(**{k: v[:cut] for k, v in data.items()})
        self.val_dataset = TensorDictDataset(**{k: v[cut:test_cut] for k, v in data.items()})
        self.test_dataset = (
            TensorDictDataset(**{k: v[test_cut:] for k, v in data.items()}) if n_test else self.val_dataset
        )

    @override
    def _collate_fn(self, train: bool) -> CTRCollator:
        return CTRCollator()

    @override
    def _test_rows(self, stage: str) -> TensorDictDataset:
        """The test rows in order (the last ``test_fraction``; the validation rows when it is 0)."""
        rows = self._rows("test_dataset", stage)
        if rows is self.val_dataset:
            uses_validation_rows_notice(self, stage, "test_fraction=0; set test_fraction= to hold out the last rows")
        return rows
