"""Shared plumbing of the data modules: stable hashing, file discovery, fingerprints, cache keys, datasets.

Everything here is deterministic across processes and machines: hashes come from :mod:`hashlib`
(Python's ``hash()`` is salted per process) and file lists are sorted. Caches themselves (verified, built
under a lock, written atomically) are :mod:`.cache`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import itertools
import json
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, Sampler
from typing_extensions import override

# absolute: this file also loads on its own (tests/data/test_common.py runs it in a child process)
from comera_lightning.utilities.internals import IndexSamplerHook

__all__ = [
    "DEFAULT_EXCLUDED_DIRS",
    "TEST_DIR_NAMES",
    "EpochShuffleSampler",
    "KeepIndex",
    "ResumableDataLoader",
    "TensorDictDataset",
    "cache_key",
    "check_limit",
    "check_val_fraction",
    "discover_files",
    "fingerprint_files",
    "identity_collate",
    "is_binary_bytes",
    "read_source_text",
    "rows_loader",
    "seeded_subsets",
    "split_by_hash",
    "stable_hash",
    "stable_hash_many",
    "stable_unit",
    "text_files_only",
    "uses_validation_rows_notice",
    "validation_share",
]

#: directory names never searched for corpus files (installed packages, byte code, VCS, caches)
DEFAULT_EXCLUDED_DIRS: frozenset[str] = frozenset(
    {"site-packages", "dist-packages", "__pycache__", ".git", ".hg", ".svn", ".tox", ".venv", "node_modules"}
)
#: directory names treated as test suites (skipped unless ``include_tests``)
TEST_DIR_NAMES: frozenset[str] = frozenset({"test", "tests", "idle_test"})


def stable_hash(value: str | bytes, salt: str = "") -> int:
    """A 64-bit hash of ``value`` that is identical in every process and on every machine.

    Python's built-in ``hash()`` of a str is randomised per process (PYTHONHASHSEED), so it cannot decide
    data splits or embedding ids that must agree across DDP ranks, workers and reruns.
    """
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    digest = hashlib.blake2b(data, digest_size=8, person=salt.encode("utf-8")[:16]).digest()
    return int.from_bytes(digest, "little")


def stable_unit(value: str, salt: str = "") -> float:
    """``stable_hash`` mapped to ``[0, 1)``: a reproducible pseudo-random draw per string."""
    return stable_hash(value, salt) / 2.0**64


_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, vectorised (uint64 arithmetic wraps modulo 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _parse_hex(values: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 value, ok) of strings of 1-16 hex digits; ``ok`` is False for anything else."""
    n = len(values)
    lengths = np.fromiter((len(v) if v.isascii() else -1 for v in values), dtype=np.int64, count=n)
    # longer strings are truncated here but refused below by `lengths`; non-ASCII ones are blanked
    raw = np.array([v if v.isascii() else "" for v in values], dtype="S16")
    chars = raw.view(np.uint8).reshape(n, 16) if n else np.zeros((0, 16), dtype=np.uint8)
    pos = np.arange(16)
    used = pos[None, :] < lengths[:, None]
    nib = _HEX_LUT[chars]
    ok = (lengths >= 1) & (lengths <= 16) & ~((nib == 255) & used).any(axis=1)
    value = np.zeros(n, dtype=np.uint64)
    for j in range(16):
        value = np.where(used[:, j], (value << np.uint64(4)) | nib[:, j].astype(np.uint64), value)
    return value, ok


def stable_hash_many(values: Sequence[str], salt: str = "") -> np.ndarray:
    """64-bit hashes (uint64 array) of many strings, identical in every process and on every machine.

    Strings of 1-16 hex digits (Criteo's categorical values; case-insensitive) hash as
    ``splitmix64(int(v, 16) ^ stable_hash(salt))``, vectorised in numpy (about 0.3 s per million); any
    other string as :func:`stable_hash` ``(v, salt)``.
    """
    parsed, ok = _parse_hex(values)
    out = _splitmix64(parsed ^ np.uint64(stable_hash(salt)))
    if not ok.all():
        bad = np.flatnonzero(~ok)
        out[bad] = np.fromiter((stable_hash(values[int(i)], salt) for i in bad), dtype=np.uint64, count=len(bad))
    return out


def cache_key(parts: Mapping[str, Any]) -> str:
    """A short hex key for a cache entry from JSON-serialisable parts (order-independent)."""
    blob = json.dumps(dict(parts), sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha1(blob).hexdigest()[:16]


def discover_files(
    root: str | os.PathLike[str],
    pattern: str = "*.py",
    *,
    include_tests: bool = False,
    max_files: int | None = None,
    excluded_dirs: Iterable[str] = DEFAULT_EXCLUDED_DIRS,
    text_only: bool = True,
) -> list[str]:
    """Relative POSIX paths of the files under ``root`` whose name matches ``pattern``, sorted.

    Directories named in ``excluded_dirs`` (and, unless ``include_tests``, test directories: ``test``,
    ``tests``, ``idle_test``) are skipped at any depth below ``root``; hidden directories too. With
    ``max_files`` a deterministic, well-spread subset is kept: the files with the smallest stable hash of
    their relative path (not the alphabetically first ones, which would all come from one package).
    With ``text_only`` (the default, for source corpora) binary files are then handled by
    :func:`text_files_only`: a few are skipped with a warning naming them, a mostly binary corpus is
    refused. Under ``max_files`` only the selected files are read, so a skipped one is not replaced.

    Raises:
        ValueError: ``root`` is missing, not a directory, holds no matching file, or (``text_only``) its
            matching files are mostly binary; the message names the path (and files) and how to fix it.
    """
    root_path = Path(root).expanduser()
    if not root_path.exists():
        raise ValueError(
            f"corpus root {str(root_path)!r} does not exist; pass root= an existing directory of source files "
            "(or root=None for the Python standard library)"
        )
    if not root_path.is_dir():
        raise ValueError(
            f"corpus root {str(root_path)!r} is not a directory; pass root= the folder that holds the files"
        )
    skip = set(excluded_dirs) | (set() if include_tests else set(TEST_DIR_NAMES))
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root_path):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        rel_dir = Path(dirpath).relative_to(root_path)
        for name in filenames:
            if fnmatch.fnmatch(name, pattern) and (Path(dirpath) / name).is_file():
                found.append((rel_dir / name).as_posix())
    if not found:
        hint = (
            ""
            if include_tests
            else f" (directories named {sorted(TEST_DIR_NAMES)} are skipped unless include_tests=True)"
        )
        raise ValueError(
            f"no file matching pattern {pattern!r} under {str(root_path)!r}{hint}; point root= at a folder "
            "with source files or change pattern="
        )
    if max_files is not None:
        if max_files < 1:
            raise ValueError(f"max_files must be >= 1 or None, got {max_files}")
        found = sorted(found, key=lambda rel: stable_hash(rel, "select"))[:max_files]
    found.sort()
    return text_files_only(root_path, found, pattern=pattern) if text_only else found


#: what a corpus of source text must not be, in messages
_BINARY_RULE = "binary, not source text (not valid UTF-8, or containing NUL bytes)"


def is_binary_bytes(data: bytes) -> bool:
    """Whether file contents are binary rather than source text: not valid UTF-8, or holding a NUL byte.

    Source files are UTF-8 (Python's default source encoding, and what the byte-level tokenizers are
    trained on); a NUL byte never occurs in text but in nearly every compiled or compressed file.
    """
    if b"\0" in data:
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _name_some(rel_paths: Sequence[str], limit: int = 5) -> str:
    """``a, b, c`` or ``a, b, c, d, e and 7 more``: files for a message, never an unbounded list."""
    shown = ", ".join(rel_paths[:limit])
    return shown + (f" and {len(rel_paths) - limit} more" if len(rel_paths) > limit else "")


def text_files_only(root: str | os.PathLike[str], rel_paths: Sequence[str], *, pattern: str = "*.py") -> list[str]:
    """``rel_paths`` (under ``root``) without the binary files (:func:`is_binary_bytes`), order kept.

    The one check every data module reading a source tree goes through (via :func:`discover_files`):

    * no binary file: the list is returned unchanged;
    * binary files are the minority (stray build outputs, a compiled file named ``.py``): they are
      skipped, with one warning that names them (the first five and a count) and how to silence it;
    * binary files are the majority (or all): ``ValueError`` naming them, since ``root`` most likely points
      at the wrong folder; training on the few text files left would only fail later, less clearly.
    """
    root_path = Path(root)
    binary = [rel for rel in rel_paths if is_binary_bytes((root_path / rel).read_bytes())]
    if not binary:
        return list(rel_paths)
    where = f"file(s) matching {pattern!r} under {str(root_path)!r}"
    if 2 * len(binary) > len(rel_paths):
        raise ValueError(
            f"{len(binary)} of the {len(rel_paths)} {where} are {_BINARY_RULE}: {_name_some(binary)}; point "
            "root= at a folder of source text files, or exclude those files from it (or narrow pattern=)"
        )
    rank_zero_warn(
        f"skipping {len(binary)} of {len(rel_paths)} {where} that are {_BINARY_RULE}: {_name_some(binary)}; "
        "exclude them from the corpus (or point root= elsewhere) to silence this warning"
    )
    skip = set(binary)
    return [rel for rel in rel_paths if rel not in skip]


def read_source_text(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of a source file; ``ValueError`` naming it when it is binary (:func:`is_binary_bytes`).

    Decoding is strict: a file that changed into a binary one after :func:`discover_files` checked it is
    refused rather than silently fed to the tokenizer as replacement characters.
    """
    data = Path(path).read_bytes()
    if is_binary_bytes(data):
        raise ValueError(
            f"{str(path)!r} is {_BINARY_RULE}; exclude it from the corpus or point root= at a folder of "
            "source text files"
        )
    return data.decode("utf-8")


def check_val_fraction(val_fraction: float) -> None:
    """Refuse a held-out share outside ``[0, 1)`` (something must be left to train on)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")


def check_limit(name: str, value: int | None) -> None:
    """Refuse a limit on rows or examples below one (``None``: no limit)."""
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1 or None, got {value}")


def validation_share(train_count: int, val_fraction: float) -> int:
    """How many validation items go with ``train_count`` training items at ``val_fraction`` (at least one)."""
    return max(1, round(train_count * val_fraction / (1.0 - val_fraction)))


def seeded_subsets(
    splits: Mapping[str, dict[str, torch.Tensor]], keep: Mapping[str, int | None], seed: int
) -> dict[str, dict[str, torch.Tensor]]:
    """Each split's rows, at most ``keep[split]`` of them: a random subset drawn from ``seed``, in row order.

    ``splits`` maps a split name to equally long tensors (the rows' columns); the splits draw one after the
    other, in the order of ``splits``, from one generator, and a split that fits (or ``keep`` ``None``) draws
    nothing.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, columns in splits.items():
        rows, limit = len(next(iter(columns.values()))), keep.get(name)
        if limit is not None and rows > limit:
            chosen = torch.randperm(rows, generator=g)[:limit].sort().values
            columns = {column: t[chosen] for column, t in columns.items()}
        out[name] = columns
    return out


def split_by_hash(rel_paths: Sequence[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Split files into (train, validation) by a stable hash of each relative path.

    A file's side depends only on its own path, so adding or removing other files never moves it. When
    ``val_fraction > 0`` and there are at least two files, validation gets at least one file (the one with
    the smallest hash) and training keeps at least one.
    """
    check_val_fraction(val_fraction)
    units = {rel: stable_unit(rel, "split") for rel in rel_paths}
    val = [rel for rel in rel_paths if units[rel] < val_fraction]
    if val_fraction > 0 and not val and len(rel_paths) >= 2:
        val = [min(rel_paths, key=units.__getitem__)]
    if len(val) == len(rel_paths) and rel_paths:
        val.remove(max(val, key=units.__getitem__))
    val_set = set(val)
    return [rel for rel in rel_paths if rel not in val_set], [rel for rel in rel_paths if rel in val_set]


def fingerprint_files(root: str | os.PathLike[str], rel_paths: Iterable[str]) -> str:
    """SHA-1 over (relative path, content) of each file: the identity of a corpus for cache keys."""
    outer = hashlib.sha1()
    for rel in rel_paths:
        inner = hashlib.sha1()
        with open(Path(root) / rel, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                inner.update(block)
        outer.update(rel.encode("utf-8") + b"\0" + inner.digest())
    return outer.hexdigest()


class TensorDictDataset(Dataset):
    """Rows of equally long tensors, fetched a whole batch at a time.

    ``__getitems__`` (used by the DataLoader when present) gathers a batch with one indexing operation per
    tensor instead of one Python call per sample, and adds ``index`` (the row numbers) so collate functions
    can seed per-sample randomness. Works with any sampler, including Lightning's DistributedSampler.
    """

    def __init__(self, **tensors: torch.Tensor) -> None:
        lengths = {name: len(t) for name, t in tensors.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"tensors of different lengths: {lengths}")
        self.tensors = tensors
        self._len = next(iter(lengths.values()), 0)

    def __len__(self) -> int:
        return self._len

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(list(indices), dtype=torch.long)
        out = {name: t[index] for name, t in self.tensors.items()}
        out["index"] = index
        return out

    @override
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: t[0] for name, t in self.__getitems__([i]).items()}


def identity_collate(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collate for :class:`TensorDictDataset` batches that need no further work (drops ``index``)."""
    return {k: v for k, v in batch.items() if k != "index"}


class KeepIndex:
    """Collate wrapper for prediction loaders: ``collate_fn(batch)`` plus ``index``, the dataset row numbers.

    :class:`TensorDictDataset` batches carry ``index`` (which the collate functions drop); keeping it as a
    long tensor lets a ``predict_step`` say which row each prediction belongs to, whatever the sampler
    (under DDP every process sees its own shard of the rows).
    """

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(self.collate_fn(batch))
        out["index"] = torch.as_tensor(batch["index"]).long()
        return out


def uses_validation_rows_notice(owner: Any, stage: str, why: str) -> None:
    """Say once per data module (rank zero, info level) that ``stage`` runs on the validation rows.

    ``why`` completes the sentence, e.g. ``"the corpus is split into training and validation files only"``.
    """
    said = owner.__dict__.setdefault("_validation_rows_notices", set())
    if stage in said:
        return
    said.add(stage)
    rank_zero_info(f"{type(owner).__name__}: {stage} runs on the validation examples ({why})")


# ---------------------------------------------------------------------------------------------- loaders
class EpochShuffleSampler(Sampler[int]):
    """A random permutation of ``range(num_samples)`` that depends only on ``(seed, epoch)``.

    Like ``DistributedSampler``'s shuffle: Lightning calls ``set_epoch`` before every epoch, so the order
    of epoch ``e`` is the same in a run and in the same run resumed from a checkpoint, without any random
    generator state to save. Under DDP Lightning wraps it in a ``DistributedSamplerWrapper`` (which
    forwards ``set_epoch``) and every process takes its shard of the same permutation.
    """

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_samples

    @override
    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % (2**63))
        return iter(torch.randperm(self.num_samples, generator=g).tolist())


class _SkipFirstBatches:
    """The loader's index sampler, minus the batches the loader says to skip when an epoch starts.

    It holds the loader weakly: the loader keeps its (persistent-worker) iterator, which keeps this object,
    and a reference cycle through worker-process queues makes garbage collection stall on worker shutdown.
    """

    def __init__(self, loader: ResumableDataLoader, inner: Any) -> None:
        self._loader = weakref.ref(loader)
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        # a generator: the skip is taken at the first ``next``, not at ``iter`` (a worker-process iterator
        # calls ``iter`` twice on construction and only advances the second one)
        loader = self._loader()
        skip = loader._take_skip() if loader is not None else 0
        del loader
        yield from itertools.islice(iter(self.inner), skip, None)


class _ResumableIterator:
    """Iterator of a :class:`ResumableDataLoader`: starts the real iterator at the first ``next``.

    Lightning creates the training iterator (``iter``) before it calls ``set_epoch`` on the samplers when it
    resumes, so the decision "continue the saved epoch, or start the next one" and the worker processes'
    index prefetching wait until the first batch is requested.
    """

    def __init__(self, loader: ResumableDataLoader) -> None:
        self.loader = loader
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> _ResumableIterator:
        return self

    def __len__(self) -> int:
        return len(self.loader)

    def __next__(self) -> Any:
        if self._it is None:
            self._it = self.loader._start_epoch()
        batch = next(self._it)
        self.loader._yielded += 1
        return batch


class ResumableDataLoader(IndexSamplerHook):
    """A DataLoader whose position inside an epoch survives a checkpoint (Lightning's ``_Stateful`` loader).

    Lightning 2.x saves ``state_dict()`` of every training loader that has one in the checkpoint's loop
    state and calls ``load_state_dict`` when it resumes, before the first batch. The state is where the
    epoch stood: the sampler's epoch when the current iterator started and the number of batches handed
    out since, plus ``collate_fn.state_dict()`` when the collate function has one (the MLM masking
    generator; only meaningful with ``num_workers=0``, where the collate function runs in this process).

    On resume, when the epoch Lightning continues is the saved one, the first saved ``batches`` index
    batches are skipped (indices only: nothing is loaded or collated for them); when Lightning moves on to
    the next epoch (the checkpoint was taken after the epoch's last batch) nothing is skipped. The data
    order must be a function of the epoch (:class:`EpochShuffleSampler`, ``DistributedSampler``,
    sequential), which makes a resumed epoch see exactly the batches the interrupted one had left.

    Lightning does not pre-fetch from a loader whose length is known, so the batches handed out are the
    batches trained on (an iterable of unknown length is not supported).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0
        self._iter_epoch = -1
        self._skip = 0
        self._pending: tuple[int, int] | None = None

    # -- iteration
    @override
    def wrap_index_sampler(self, index_sampler: Any) -> Any:
        return _SkipFirstBatches(self, index_sampler)

    def _take_skip(self) -> int:
        skip, self._skip = self._skip, 0
        return skip

    def _sampler_epoch(self) -> int | None:
        for sampler in (getattr(self.batch_sampler, "sampler", None), self.sampler):
            epoch = getattr(sampler, "epoch", None)
            if isinstance(epoch, int):
                return epoch
        return None

    def _start_epoch(self) -> Iterator[Any]:
        epoch = self._sampler_epoch()
        skip = 0
        if self._pending is not None:
            saved_epoch, batches = self._pending
            self._pending = None
            if epoch is None:  # no epoch to compare: continue unless the saved epoch was complete
                skip = batches if batches < len(self) else 0
            elif epoch == saved_epoch:
                skip = batches
        self._iter_epoch = -1 if epoch is None else epoch
        self._yielded = skip
        self._skip = skip
        return super().__iter__()

    @override
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return _ResumableIterator(self)

    # -- state
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": int(self._iter_epoch), "batches": int(self._yielded)}
        collate_state = getattr(self.collate_fn, "state_dict", None)
        if callable(collate_state) and self.num_workers == 0:
            state["collate_fn"] = collate_state()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._pending = (int(state_dict.get("epoch", -1)), int(state_dict.get("batches", 0)))
        collate_load = getattr(self.collate_fn, "load_state_dict", None)
        if "collate_fn" in state_dict and callable(collate_load) and self.num_workers == 0:
            collate_load(state_dict["collate_fn"])


def rows_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    collate_fn: Any,
    train: bool,
    seed: int = 0,
    num_workers: int = 0,
    sampler: Sampler[int] | None = None,
) -> DataLoader:
    """The loader every comera data module uses.

    Training: a :class:`ResumableDataLoader` over ``sampler``, by default an :class:`EpochShuffleSampler`
    (order a function of ``(seed, epoch)``, position restored on resume; a given sampler's order must be a
    function of the epoch too). Evaluation: a plain loader over ``sampler``, by default in order. Both get their
    own ``torch.Generator`` so creating an iterator (which draws the workers' base seed) never consumes the
    global torch random stream that dropout and the rest of training use.
    """
    common: dict[str, Any] = dict(
        batch_size=batch_size,
        collate_fn=collate_fn,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )
    if train:
        if sampler is None:
            sampler = EpochShuffleSampler(len(dataset), seed)  # type: ignore[arg-type]
        return ResumableDataLoader(dataset, sampler=sampler, **common)
    if sampler is not None:
        return DataLoader(dataset, sampler=sampler, **common)
    return DataLoader(dataset, shuffle=False, **common)
