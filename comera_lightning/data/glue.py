"""GLUE MNLI (premise/hypothesis -> entailment, neutral, contradiction) from local files.

Three local layouts are read (``format="auto"`` picks by what ``data_dir`` holds):

* ``"disk"``: a ``datasets.DatasetDict`` written by ``save_to_disk`` (e.g. of ``load_dataset("glue",
  "mnli")`` on a machine with network), splits ``train``, ``validation_matched``,
  ``validation_mismatched``, columns ``premise``, ``hypothesis``, ``label``;
* ``"tsv"``: the GLUE distribution, ``train.tsv``, ``dev_matched.tsv``, ``dev_mismatched.tsv`` with
  columns ``sentence1``, ``sentence2``, ``gold_label`` (or ``label``);
* ``"jsonl"``: one JSON object per line with ``premise``, ``hypothesis``, ``label`` (int or name), or the
  MultiNLI originals' ``sentence1``, ``sentence2``, ``gold_label``; files ``train.jsonl``,
  ``validation_matched.jsonl``/``dev_matched.jsonl`` (``multinli_1.0_*.jsonl`` too).

Labels: entailment=0, neutral=1, contradiction=2 (the GLUE/HF order). Rows without a gold label (``-``,
``-1``, empty) are skipped.

Held-out split for ``test``/``predict`` (``test_split``, see :class:`MNLIDataModule`): by default a labelled
``test_matched``/``test_mismatched`` split when the data has one (GLUE hides the test labels, so usually
not), else the validation split that validation does not use (``validation_mismatched`` when validating on
``validation_matched``), else the validation split itself, said once at info level.

Pairs are encoded ``[CLS] premise [SEP] hypothesis [SEP]``, ``token_type_ids`` 0 up to and including
the first ``[SEP]`` and 1 after, truncated longest-first to ``seq_len`` and padded to ``seq_len`` (static
shapes). The tokenizer is a local tokenizer.json (``tokenizer_path``) or a byte-level BPE trained on the
training premises and hypotheses and cached like the encoded splits.
"""

from __future__ import annotations

import csv
import json
import random
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from .base import ComeraDataModule
from .cache import cached_tensors
from .common import TensorDictDataset, check_limit, fingerprint_files, uses_validation_rows_notice
from .tokenizer import (
    SpecialTokenIds,
    TokenizerLifecycle,
    cached_bpe_tokenizer,
    encode_texts,
    file_sha1,
)

__all__ = [
    "MNLI_LABELS",
    "TEST_SPLITS",
    "MNLIDataModule",
    "PairClassification",
    "PairCollator",
    "detect_mnli_format",
    "encode_pair_rows",
    "encode_pairs",
    "mnli_split_exists",
    "read_mnli_split",
    "truncate_longest_first",
    "write_synthetic_mnli",
]

MNLI_LABELS: dict[str, int] = {"entailment": 0, "neutral": 1, "contradiction": 2}
_NO_LABEL = {"-", "", "-1", "None", "none", "null"}
_FORMATS = ("auto", "disk", "tsv", "jsonl")
_SPLIT_NAMES: dict[str, tuple[str, ...]] = {
    "train": ("train", "multinli_1.0_train"),
    "validation_matched": ("validation_matched", "dev_matched", "multinli_1.0_dev_matched"),
    "validation_mismatched": ("validation_mismatched", "dev_mismatched", "multinli_1.0_dev_mismatched"),
    "test_matched": ("test_matched",),
    "test_mismatched": ("test_mismatched",),
}
#: splits ``MNLIDataModule(test_split=...)`` accepts
TEST_SPLITS: tuple[str, ...] = ("validation_matched", "validation_mismatched", "test_matched", "test_mismatched")
_ENCODING_VERSION = 1


def _label_id(value: Any, where: str) -> int | None:
    """Our label id of a raw label (int or name); ``None`` for 'no gold label'."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if int(value) == -1:
            return None
        if int(value) in (0, 1, 2):
            return int(value)
        raise ValueError(f"{where}: label {value!r} is not 0, 1, 2 (or -1 for unlabelled)")
    text = str(value).strip()
    if text in _NO_LABEL:
        return None
    if text.isdigit():
        return _label_id(int(text), where)
    try:
        return MNLI_LABELS[text.lower()]
    except KeyError:
        raise ValueError(f"{where}: unknown label {value!r}; expected one of {list(MNLI_LABELS)} or 0/1/2") from None


def detect_mnli_format(data_dir: str | Path) -> str:
    """``"disk"``, ``"tsv"`` or ``"jsonl"`` from the files in ``data_dir`` (ValueError if none fits)."""
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise ValueError(
            f"MNLI data_dir {str(root)!r} is not a directory; pass data_dir= the folder with the MNLI files"
        )
    if (root / "dataset_dict.json").is_file():
        return "disk"
    for fmt in ("tsv", "jsonl"):
        if any((root / f"{name}.{fmt}").is_file() for name in _SPLIT_NAMES["train"]):
            return fmt
    raise ValueError(
        f"cannot tell the MNLI format of {str(root)!r}: expected a datasets.save_to_disk folder "
        "(dataset_dict.json), GLUE TSVs (train.tsv, dev_matched.tsv, dev_mismatched.tsv) or JSONL files "
        "(train.jsonl, validation_matched.jsonl, ...); write test data with write_synthetic_mnli()"
    )


def _split_file(root: Path, split: str, ext: str) -> Path:
    for name in _SPLIT_NAMES[split]:
        path = root / f"{name}.{ext}"
        if path.is_file():
            return path
    wanted = ", ".join(f"{n}.{ext}" for n in _SPLIT_NAMES[split])
    raise ValueError(f"no file for MNLI split {split!r} in {str(root)!r}: expected one of {wanted}")


_REQUIRED = object()


def _pick(row: dict[str, Any], names: Sequence[str], where: str, default: Any = _REQUIRED) -> Any:
    for name in names:
        if name in row:
            return row[name]
    if default is not _REQUIRED:
        return default
    raise ValueError(f"{where}: none of the columns {list(names)} (has {sorted(row)})")


def _labelled_pairs(
    rows: Iterable[tuple[str, dict[str, Any]]], columns: Sequence[Sequence[str]], label_optional: bool
) -> tuple[list[str], list[str], list[int]]:
    """(premises, hypotheses, labels) of the labelled ones of ``(where, row)`` rows.

    ``columns``: the names of the label, premise and hypothesis columns, each as a list, the preferred first.
    """
    label_names, premise_names, hypothesis_names = columns
    no_label = None if label_optional else _REQUIRED  # a test file may have no label column at all
    a, b, y = [], [], []
    for where, row in rows:
        label = _label_id(_pick(row, label_names, where, no_label), where)
        if label is None:
            continue
        a.append(_pick(row, premise_names, where) or "")
        b.append(_pick(row, hypothesis_names, where) or "")
        y.append(label)
    return a, b, y


def _read_tsv(path: Path, label_optional: bool = False) -> tuple[list[str], list[str], list[int]]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, encoding="utf-8", newline="") as fh:
        # GLUE TSVs contain unbalanced quotes: read with quoting off, as the GLUE baselines do
        reader = csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
        rows = ((f"{path}:{line}", row) for line, row in enumerate(reader, start=2))
        columns = (("gold_label", "label"), ("sentence1", "premise"), ("sentence2", "hypothesis"))
        return _labelled_pairs(rows, columns, label_optional)


def _read_jsonl(path: Path, label_optional: bool = False) -> tuple[list[str], list[str], list[int]]:
    with open(path, encoding="utf-8") as fh:
        rows = ((f"{path}:{n}", json.loads(line)) for n, line in enumerate(fh, start=1) if line.strip())
        columns = (("label", "gold_label"), ("premise", "sentence1"), ("hypothesis", "sentence2"))
        return _labelled_pairs(rows, columns, label_optional)


def _datasets_module():
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            "reading a save_to_disk MNLI folder needs the HuggingFace `datasets` library: "
            "pip install 'datasets>=2.14' (or use the GLUE TSV / JSONL formats)"
        ) from err
    return datasets


def _read_disk(root: Path, split: str, label_optional: bool = False) -> tuple[list[str], list[str], list[int]]:
    dsets = _datasets_module().load_from_disk(str(root))
    name = next((n for n in _SPLIT_NAMES[split] if n in dsets), None)
    if name is None:
        raise ValueError(f"the dataset at {str(root)!r} has splits {list(dsets)}, none of {list(_SPLIT_NAMES[split])}")
    ds = dsets[name]
    cols = set(ds.column_names)
    a_col = "premise" if "premise" in cols else "sentence1"
    b_col = "hypothesis" if "hypothesis" in cols else "sentence2"
    y_col = "label" if "label" in cols else "gold_label"
    missing = {a_col, b_col, *(() if label_optional else (y_col,))} - cols
    if missing:
        raise ValueError(f"the {name!r} split at {str(root)!r} lacks columns {sorted(missing)} (has {sorted(cols)})")
    if y_col not in cols:  # label_optional: an unlabelled test split
        return [], [], []
    names = getattr(ds.features[y_col], "names", None)  # ClassLabel: map through its names, whatever the order
    a, b, y = [], [], []
    for i, (p, h, raw) in enumerate(zip(ds[a_col], ds[b_col], ds[y_col], strict=True)):
        if names is not None and isinstance(raw, (int, np.integer)) and 0 <= raw < len(names):
            raw = names[raw]
        label = _label_id(raw, f"{root}[{name}][{i}]")
        if label is None:
            continue
        a.append(p or "")
        b.append(h or "")
        y.append(label)
    return a, b, y


def read_mnli_split(data_dir: str | Path, split: str, fmt: str = "auto") -> tuple[list[str], list[str], list[int]]:
    """(premises, hypotheses, labels) of the labelled rows of one split (``train``, ``validation_matched``,
    ``validation_mismatched``, ``test_matched``, ``test_mismatched``).

    A test split may lack the label column (GLUE's test TSVs): it then has no labelled rows.
    """
    if split not in _SPLIT_NAMES:
        raise ValueError(f"unknown MNLI split {split!r}; expected one of {list(_SPLIT_NAMES)}")
    root = Path(data_dir).expanduser()
    fmt = detect_mnli_format(root) if fmt == "auto" else fmt
    label_optional = split.startswith("test")
    if fmt == "disk":
        return _read_disk(root, split, label_optional)
    if fmt == "tsv":
        return _read_tsv(_split_file(root, split, "tsv"), label_optional)
    if fmt == "jsonl":
        return _read_jsonl(_split_file(root, split, "jsonl"), label_optional)
    raise ValueError(f"unknown MNLI format {fmt!r}; expected one of {list(_FORMATS)}")


def mnli_split_exists(data_dir: str | Path, split: str, fmt: str = "auto") -> bool:
    """Whether ``data_dir`` holds ``split`` at all (its file, or a split of that name in a save_to_disk folder)."""
    root = Path(data_dir).expanduser()
    fmt = detect_mnli_format(root) if fmt == "auto" else fmt
    if fmt == "disk":
        try:
            splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, ValueError):
            return False
        return any(name in splits for name in _SPLIT_NAMES[split])
    return any((root / f"{name}.{fmt}").is_file() for name in _SPLIT_NAMES[split])


def truncate_longest_first(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths after removing tokens one at a time from the longer side until ``len_a + len_b <= budget``.

    Ties remove from the second sequence first, as HuggingFace's ``longest_first`` does.
    """
    excess = len_a + len_b - max(budget, 0)
    if excess <= 0:
        return len_a, len_b
    diff = abs(len_a - len_b)
    if excess <= diff:
        return (len_a - excess, len_b) if len_a > len_b else (len_a, len_b - excess)
    m = min(len_a, len_b)
    rest = excess - diff
    return m - rest // 2, m - (rest + 1) // 2


def encode_pairs(
    tokenizer: Any, premises: Sequence[str], hypotheses: Sequence[str], seq_len: int, special: SpecialTokenIds
) -> dict[str, torch.Tensor]:
    """Encode pairs as padded rows ``[CLS] a [SEP] b [SEP]``.

    Returns ``input_ids`` (N, seq_len) int64 padded with ``special.pad``, ``length`` (N,) the number of real
    tokens, and ``type_start`` (N,) the first position of segment B (``token_type_ids`` 1 from there up to
    ``length``).
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 for [CLS] a [SEP] b [SEP], got {seq_len}")
    enc_a = encode_texts(tokenizer, premises)
    enc_b = encode_texts(tokenizer, hypotheses)
    n = len(enc_a)
    ids = np.full((n, seq_len), special.pad, dtype=np.int64)
    length = np.zeros(n, dtype=np.int64)
    type_start = np.zeros(n, dtype=np.int64)
    for i, (a, b) in enumerate(zip(enc_a, enc_b, strict=True)):
        ta, tb = truncate_longest_first(len(a), len(b), seq_len - 3)
        row = np.concatenate(([special.cls], a[:ta], [special.sep], b[:tb], [special.sep]))
        ids[i, : len(row)] = row
        length[i] = len(row)
        type_start[i] = ta + 2
    return {
        "input_ids": torch.from_numpy(ids),
        "length": torch.from_numpy(length),
        "type_start": torch.from_numpy(type_start),
    }


def encode_pair_rows(
    tokenizer: Any,
    texts_a: Sequence[str],
    texts_b: Sequence[str],
    labels: Sequence[int],
    seq_len: int,
    special: SpecialTokenIds,
) -> dict[str, torch.Tensor]:
    """:func:`encode_pairs` plus ``labels``, in compact dtypes: the cached rows that :class:`PairCollator` reads.

    ``input_ids`` are int16 when the vocabulary fits (int32 otherwise), ``length``/``type_start`` int32,
    ``labels`` int64.
    """
    enc = encode_pairs(tokenizer, texts_a, texts_b, seq_len, special)
    small = torch.int16 if tokenizer.get_vocab_size() <= torch.iinfo(torch.int16).max else torch.int32
    return {
        "input_ids": enc["input_ids"].to(small),
        "length": enc["length"].to(torch.int32),
        "type_start": enc["type_start"].to(torch.int32),
        "labels": torch.tensor(list(labels), dtype=torch.int64),
    }


class PairCollator:
    """Turn a batch of encoded rows into ``input_ids, attention_mask, token_type_ids, labels`` (all long)."""

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = batch["input_ids"].long()
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        length = batch["length"].long().unsqueeze(1)
        attention = pos < length
        token_type = (pos >= batch["type_start"].long().unsqueeze(1)) & attention
        return {
            "input_ids": ids,
            "attention_mask": attention.long(),
            "token_type_ids": token_type.long(),
            "labels": batch["labels"].long(),
        }


class PairClassification(ComeraDataModule):
    """What the sentence-pair classification modules share: their batches (:class:`PairCollator`) and class names."""

    #: class names by label id
    label_names: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        """How many classes the labels name."""
        return len(self.label_names)

    @property
    def class_names(self) -> list[str]:
        """Label names by id."""
        return list(self.label_names)

    @override
    def _collate_fn(self, train: bool) -> PairCollator:
        return PairCollator()


class MNLIDataModule(TokenizerLifecycle, PairClassification):
    """GLUE MNLI sentence-pair classification from a local folder (no download).

    Batches: ``input_ids``, ``attention_mask``, ``token_type_ids`` (B, seq_len) long and ``labels`` (B,)
    long with entailment=0, neutral=1, contradiction=2 (names in :attr:`class_names`); prediction batches
    add ``index`` (B,) long, the row number in the test split.

    ``test``/``predict`` run on :attr:`resolved_test_split`: ``test_split`` when set, otherwise the first of
    a labelled ``test_matched`` (``test_mismatched`` when validating on ``validation_mismatched``), the other
    validation split, and, when the data has neither, the validation split itself (said once at info level).

    Vocabulary size: ``vocab_size`` stays the configured value and is an upper bound (the trained BPE
    never exceeds it; a ``tokenizer_path`` tokenizer larger than it is refused), so a model built with
    ``data.vocab_size`` always fits; ``vocab_size_actual`` is the tokenizer's real size.

    Args:
        data_dir: folder with the MNLI files (see the module docstring for the layouts).
        format: ``"auto"``, ``"disk"`` (``datasets.save_to_disk``), ``"tsv"`` (GLUE) or ``"jsonl"``.
        tokenizer_path: a local tokenizer.json (e.g. BERT's); ``None`` trains a byte-level BPE on the
            training texts (cached under ``cache_dir``).
        vocab_size: size of the trained tokenizer; upper bound of a given one. 30522 is BERT's.
        seq_len: tokens per row after truncation (longest-first) and padding.
        batch_size: pairs per batch.
        validation_split: ``"validation_matched"`` or ``"validation_mismatched"``.
        test_split: the labelled split ``test``/``predict`` run on, one of :data:`TEST_SPLITS`; ``None``
            chooses as described above. A ``test_*`` split must have labelled rows (GLUE's do not).
        max_train_samples: keep the first this many labelled training pairs (quick runs); the trained
            tokenizer then sees only those.
        cache_dir: where the trained tokenizer and the encoded splits are cached.
        num_workers: DataLoader worker processes.
        seed: seeds the training shuffle.
    """

    label_names = tuple(MNLI_LABELS)
    cache_dir: str

    def __init__(
        self,
        data_dir: str,
        format: str = "auto",
        tokenizer_path: str | None = None,
        vocab_size: int = 30522,
        seq_len: int = 128,
        batch_size: int = 32,
        validation_split: str = "validation_matched",
        test_split: str | None = None,
        max_train_samples: int | None = None,
        cache_dir: str = ".cache/comera",
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        if not data_dir:
            raise ValueError(
                "MNLIDataModule needs data_dir= the folder with the MNLI files (GLUE TSVs, JSONL or a "
                "datasets.save_to_disk folder); write test data with write_synthetic_mnli()"
            )
        if format not in _FORMATS:
            raise ValueError(f"format must be one of {list(_FORMATS)}, got {format!r}")
        if validation_split not in ("validation_matched", "validation_mismatched"):
            raise ValueError(
                f"validation_split must be 'validation_matched' or 'validation_mismatched', got {validation_split!r}"
            )
        if test_split is not None and test_split not in TEST_SPLITS:
            raise ValueError(f"test_split must be one of {list(TEST_SPLITS)} or None (choose), got {test_split!r}")
        if seq_len < 3:
            raise ValueError(f"seq_len must be >= 3, got {seq_len}")
        check_limit("max_train_samples", max_train_samples)
        super().__init__(batch_size, num_workers, seed, cache_dir)
        self.save_hyperparameters()
        self.data_dir, self.format, self.tokenizer_path, self.vocab_size = data_dir, format, tokenizer_path, vocab_size
        self.seq_len, self.validation_split, self.test_split = seq_len, validation_split, test_split
        self.max_train_samples = max_train_samples
        self._test_split: str | None = None
        self._format: str | None = None
        self._splits: dict[str, tuple[list[str], list[str], list[int]]] = {}
        self._fingerprints: dict[str, str] = {}
        self.test_dataset: TensorDictDataset | None = None

    @property
    def root(self) -> Path:
        return Path(self.data_dir).expanduser()

    @property
    def resolved_format(self) -> str:
        """The format in use (``format`` or what ``"auto"`` detected)."""
        if self._format is None:
            self._format = detect_mnli_format(self.root) if self.format == "auto" else self.format
        return self._format

    def _source_fingerprint(self, split: str) -> str:
        """Content hash of the files a split is read from (memoised: MNLI's train.tsv is 330 MB)."""
        if split not in self._fingerprints:
            fmt = self.resolved_format
            if fmt == "disk":
                files = sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
                self._fingerprints[split] = fingerprint_files(self.root, files)
            else:
                path = _split_file(self.root, split, fmt)
                self._fingerprints[split] = fingerprint_files(path.parent, [path.name])
        return self._fingerprints[split]

    def _read(self, split: str) -> tuple[list[str], list[str], list[int]]:
        if split not in self._splits:
            a, b, y = read_mnli_split(self.root, split, self.resolved_format)
            if split == self.test_split and not y:
                raise ValueError(
                    f"the MNLI split {split!r} in {str(self.root)!r} has no labelled pairs (GLUE does not publish "
                    "test labels), so it cannot be tested on; set test_split= a validation split, or leave it unset"
                )
            if split == "train":
                if not y:
                    raise ValueError(f"the MNLI training split in {str(self.root)!r} has no labelled pairs")
                if self.max_train_samples is not None:
                    a, b, y = a[: self.max_train_samples], b[: self.max_train_samples], y[: self.max_train_samples]
            self._splits[split] = (a, b, y)
        return self._splits[split]

    @override
    def _train_tokenizer(self) -> tuple[Path, bool]:
        def texts() -> list[str]:
            a, b, _ = self._read("train")
            return [*a, *b]

        return cached_bpe_tokenizer(
            self.cache_dir,
            "mnli",
            {"train": self._source_fingerprint("train"), "max_train_samples": self.max_train_samples},
            texts,
            self.vocab_size,
            add_prefix_space=True,
            origin=f"the MNLI training split under {self.root}",
        )

    @property
    def resolved_test_split(self) -> str:
        """The split ``test``/``predict`` run on (``test_split``, or chosen as the class docstring says)."""
        if self._test_split is None:
            self._test_split = self.test_split or self._choose_test_split()
        return self._test_split

    def _choose_test_split(self) -> str:
        kind = self.validation_split.removeprefix("validation_")
        other = "validation_mismatched" if kind == "matched" else "validation_matched"
        for split in (f"test_{kind}", other):
            if mnli_split_exists(self.root, split, self.resolved_format) and self._read(split)[2]:
                rank_zero_info(
                    f"MNLIDataModule: test and predict run on the held-out split {split!r} "
                    f"(validation: {self.validation_split!r})"
                )
                return split
        return self.validation_split

    def _encoded(self, split: str) -> dict[str, torch.Tensor]:
        source = {
            "tokenizer": file_sha1(self._ensure_tokenizer_file()),
            "source": self._source_fingerprint(split),
            "format": self.resolved_format,
            "split": split,
            "seq_len": self.seq_len,
            "max_train_samples": self.max_train_samples if split == "train" else None,
            "version": _ENCODING_VERSION,
        }

        def make() -> dict[str, torch.Tensor]:
            a, b, y = self._read(split)
            return encode_pair_rows(self.tokenizer, a, b, y, self.seq_len, self.special_ids)

        return cached_tensors(
            self._cache_file(f"mnli-{split}", source),
            source=source,
            make=make,
            what=f"encoded MNLI split {split!r}",
            origin=f"{self.root} ({self.resolved_format})",
        )

    @override
    def prepare_data(self) -> None:
        """Train/cache the tokenizer and encode/cache the training and validation splits, and the test split
        when the trainer is testing or predicting (local rank 0)."""
        self._encoded("train")
        self._encoded(self.validation_split)
        if _trainer_fn(self) in ("test", "predict"):
            self._encoded(self.resolved_test_split)

    @override
    def setup(self, stage: str | None = None) -> None:
        """Load the cached encodings and build the datasets the stage needs: ``fit`` training and validation,
        ``validate`` validation, ``test``/``predict`` the test split (:attr:`resolved_test_split`), ``None`` all."""
        _ = self.tokenizer  # loads it and checks its size against vocab_size, even when the rows are cached
        if stage in (None, "fit") and self.train_dataset is None:
            self.train_dataset = TensorDictDataset(**self._encoded("train"))
        if self.val_dataset is None and stage in (None, "fit", "validate"):
            self.val_dataset = TensorDictDataset(**self._encoded(self.validation_split))
        if self.test_dataset is None and stage in (None, "test", "predict"):
            split = self.resolved_test_split
            if split == self.validation_split and self.val_dataset is not None:
                self.test_dataset = self.val_dataset
            else:
                self.test_dataset = TensorDictDataset(**self._encoded(split))

    @override
    def _test_rows(self, stage: str) -> TensorDictDataset:
        """Labelled pairs of :attr:`resolved_test_split`, in file order."""
        rows = self._rows("test_dataset", stage)
        if self.resolved_test_split == self.validation_split:
            uses_validation_rows_notice(
                self, stage, f"{str(self.root)!r} has no other labelled split; set test_split= to choose one"
            )
        return rows


def _trainer_fn(datamodule: pl.LightningDataModule) -> str | None:
    """What the attached trainer is running (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``), or ``None``."""
    trainer = getattr(datamodule, "trainer", None)
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return None if fn is None else str(getattr(fn, "value", fn))


# ---------------------------------------------------------------------------------------------- synthetic
_SUBJECTS = ["the cat", "a dog", "the teacher", "my friend", "the pilot", "a child", "the farmer", "our neighbour"]
_VERBS = ["sees", "likes", "paints", "follows", "visits", "helps", "finds", "greets"]
_OBJECTS = ["the river", "a house", "the garden", "a bird", "the market", "a tree", "the station", "a boat"]
_PLACES = ["in the morning", "at noon", "near the hill", "after lunch", "by the sea", "in the city"]


def _synthetic_pair(rng: random.Random) -> tuple[str, str, str]:
    """A premise and a hypothesis whose relation follows a simple lexical rule.

    entailment: the hypothesis repeats the premise's clause without the time/place; contradiction: it
    negates it ("does not"); neutral: another subject "also" does something. The words "not" and "also"
    decide the label, so even a bag-of-words model can learn it.
    """
    s, v, o, p = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_PLACES)
    premise = f"{s.capitalize()} {v} {o} {p}."
    label = rng.choice(list(MNLI_LABELS))
    if label == "entailment":
        hypothesis = f"{s.capitalize()} {v} {o}."
    elif label == "contradiction":
        hypothesis = f"{s.capitalize()} does not {v[:-1]} {o}."
    else:
        other = rng.choice([x for x in _SUBJECTS if x != s])
        hypothesis = f"{other.capitalize()} also {v} {rng.choice(_OBJECTS)}."
    return premise, hypothesis, label


def write_synthetic_mnli(directory: str | Path, num_train: int, num_val: int, fmt: str = "tsv", seed: int = 0) -> Path:
    """Write a SYNTHETIC MNLI-shaped dataset (for tests and smoke runs, not for reporting results).

    Writes ``train``, ``dev_matched`` and ``dev_mismatched`` (``fmt="tsv"``, GLUE columns incl.
    ``gold_label``) or ``train``, ``validation_matched``, ``validation_mismatched`` (``fmt="jsonl"``,
    ``premise``/``hypothesis``/``label`` with label names) into ``directory``; see
    :func:`_synthetic_pair` for the rule that decides the label. Returns ``directory``.
    """
    if fmt not in ("tsv", "jsonl"):
        raise ValueError(f"fmt must be 'tsv' or 'jsonl', got {fmt!r}")
    out = Path(directory).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = (
        ("train", "dev_matched", "dev_mismatched")
        if fmt == "tsv"
        else ("train", "validation_matched", "validation_mismatched")
    )
    for name, count in zip(names, (num_train, num_val, num_val), strict=True):
        rows = [_synthetic_pair(rng) for _ in range(count)]
        path = out / f"{name}.{fmt}"
        with open(path, "w", encoding="utf-8", newline="") as fh:
            if fmt == "tsv":
                fh.write("index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\tlabel1\tgold_label\n")
                for i, (a, b, y) in enumerate(rows):
                    fh.write(f"{i}\t{i}\t{i}e\tsynthetic\t{a}\t{b}\t{y}\t{y}\n")
            else:
                for i, (a, b, y) in enumerate(rows):
                    fh.write(json.dumps({"premise": a, "hypothesis": b, "label": y, "idx": i}) + "\n")
    return out
