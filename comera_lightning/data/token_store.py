"""Token streams on disk, read as packed next-token rows in bounded memory, sharded across processes.

A token store is a folder written once by :class:`TokenStoreWriter`:

* ``train.bin`` and ``val.bin``: each split's token stream (documents one after the other, each followed
  by the end-of-document token), raw little-endian ``uint16`` (vocabularies up to 65,536) or ``uint32``;
* ``meta.json``: what wrote it (tokenizer hash, corpus fingerprint, special ids, token counts), so a
  folder written by another tokenizer or from another corpus is refused instead of silently mixed;
* ``manifest.json``: the verified-cache manifest (:mod:`.cache`: sizes, checksums, source), so a store cut
  short on disk (a full disk, a killed writer) is tokenised again instead of trained on in part.

The folder appears only when it is complete: :func:`~.cache.load_or_build` has it written under a temporary
name and renames it into place.

:class:`TokenRows` reads row ``i`` (tokens ``i*T .. i*T+T`` of a stream) with one ``pread``: nothing is
memory-mapped or loaded whole, so a process's memory does not grow with the corpus (a memory map's touched
pages would count towards its resident size over an epoch). :class:`ShardedShuffleSampler` shuffles the
rows with a keyed pseudo-random permutation computed index by index (a Feistel network with cycle
walking) instead of materialising ``randperm(rows)``, and gives every DDP rank its own strided share.

Why not ``litdata`` (Lightning's streaming format, the obvious first choice): measured on this project's
CPU setup, ``pip install litdata`` requires ``torchvision``, which replaced the pinned CPU torch 2.13.0
with torch 2.14.1 and 13 CUDA packages (several GB); its resume goes through the loader's own state, the
mechanism this project measured inexact inside a Lightning fit (``StatefulDataLoader``), where
:class:`~comera_lightning.data.common.ResumableDataLoader` resumes bit for bit; and a map-style dataset
over flat token files needs no format of its own to shard by rank. Local and network-mounted folders work;
object storage would need a mount.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler
from typing_extensions import override

from .common import _splitmix64

__all__ = [
    "ShardedShuffleSampler",
    "TokenRows",
    "TokenStoreWriter",
    "keyed_permutation",
    "read_token_store",
    "token_dtype",
]

IGNORE_INDEX = -100
SPLITS = ("train", "val")
META_FILE = "meta.json"
STORE_FILES = (*(f"{split}.bin" for split in SPLITS), META_FILE)  #: what a complete store holds
_FEISTEL_ROUNDS = 4


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id of a ``vocab_size`` vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class TokenStoreWriter:
    """Append each split's tokens to files in ``folder`` (a new, empty one: the temporary folder of
    :func:`~.cache.load_or_build`); :meth:`commit` writes ``meta.json``."""

    def __init__(self, folder: str | os.PathLike[str], dtype: np.dtype) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        self.counts = dict.fromkeys(SPLITS, 0)
        # open across appends; close() closes them
        self._files = {split: open(self.folder / f"{split}.bin", "wb") for split in SPLITS}  # noqa: SIM115

    def append(self, split: str, ids: np.ndarray) -> None:
        """Append token ids (any integer array) to a split's stream."""
        self._files[split].write(np.asarray(ids).astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self.counts[split] += len(ids)

    def commit(self, meta: Mapping[str, Any]) -> None:
        """Close the token files and write ``meta.json`` (``meta`` plus the dtype and token counts)."""
        self.close()
        full = {**meta, "dtype": self.dtype.name, "tokens": dict(self.counts)}
        (self.folder / META_FILE).write_text(json.dumps(full, indent=1, sort_keys=True))

    def close(self) -> None:
        """Close the token files (the folder's fate is its caller's)."""
        for handle in self._files.values():
            handle.close()


def read_token_store(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A complete store's ``meta.json``, or ``None`` when ``folder`` holds none."""
    path = Path(folder) / META_FILE
    return json.loads(path.read_text()) if path.is_file() else None


class TokenRows(Dataset):
    """Packed next-token rows of a token file: row ``i`` is ``input_ids = s[iT : iT+T]``, ``labels = s[iT+1 :
    iT+T+1]``; the last row's missing positions hold ``pad_id`` / ``-100`` (as :func:`~.code_lm.pack_stream`).

    Batches (``__getitems__``) are dicts of int64 tensors ``input_ids``, ``labels`` (B, T) and ``index`` (B,).
    """

    def __init__(self, path: str | os.PathLike[str], dtype: str | np.dtype, seq_len: int, pad_id: int) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.seq_len, self.pad_id = int(seq_len), int(pad_id)
        self.num_tokens = self.path.stat().st_size // self.dtype.itemsize
        self._rows = math.ceil(max(0, self.num_tokens - 1) / self.seq_len)
        self._fd: int | None = None
        self._pid = -1

    def __len__(self) -> int:
        return self._rows

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # a forked worker opens its own descriptor
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def tokens(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens of the stream from ``start`` (fewer at its end), as int64."""
        size = self.dtype.itemsize
        data = os.pread(self._file(), count * size, start * size)
        return np.frombuffer(data, dtype=self.dtype).astype(np.int64)

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        rows, length = len(indices), self.seq_len
        inputs = np.full((rows, length), self.pad_id, dtype=np.int64)
        labels = np.full((rows, length), IGNORE_INDEX, dtype=np.int64)
        for j, i in enumerate(indices):
            if not 0 <= i < self._rows:
                raise IndexError(f"row {i} out of range for {self._rows} rows")
            start = i * length
            valid = min(length, self.num_tokens - 1 - start)
            tokens = self.tokens(start, valid + 1)
            inputs[j, :valid], labels[j, :valid] = tokens[:valid], tokens[1 : valid + 1]
        index = torch.as_tensor(list(indices), dtype=torch.long)
        return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels), "index": index}

    @override
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: t[0] for name, t in self.__getitems__([i]).items()}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None, "_pid": -1}

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None and self._pid == os.getpid():
            os.close(fd)


def keyed_permutation(positions: np.ndarray, n: int, key: int) -> np.ndarray:
    """Where a pseudo-random permutation of ``range(n)``, chosen by ``key``, sends each of ``positions``.

    A balanced Feistel network on the smallest even number of bits that holds ``n - 1`` is a bijection of
    ``[0, 4^k)``; applying it again until the value falls below ``n`` (cycle walking, about two rounds on
    average) makes it a bijection of ``[0, n)``. Constant memory whatever ``n``.
    """
    if n <= 1:
        return np.zeros(len(positions), dtype=np.int64)
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = np.uint64((1 << half) - 1)
    keys = [_splitmix64(np.array([key * _FEISTEL_ROUNDS + r], dtype=np.uint64))[0] for r in range(_FEISTEL_ROUNDS)]
    values = np.asarray(positions, dtype=np.uint64).copy()
    todo = np.ones(len(values), dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():
            x = values[todo]
            left, right = x >> np.uint64(half), x & mask
            for round_key in keys:
                left, right = right, left ^ (_splitmix64(right ^ round_key) & mask)
            values[todo] = (left << np.uint64(half)) | right
            todo = values >= np.uint64(n)
    return values.astype(np.int64)


class ShardedShuffleSampler(DistributedSampler):
    """Every rank's share of an epoch's rows: a keyed permutation of ``range(num_rows)`` (or the identity),
    strided across ranks, as ``DistributedSampler`` but in constant memory.

    The order depends only on ``(seed, epoch)`` (Lightning calls ``set_epoch``), so a resumed epoch sees the
    rows the interrupted one had left. Each rank gets ``ceil(num_rows / world)`` rows: disjoint shares whose
    union is the epoch, the last ``world - 1`` positions at most wrapping round to the first rows (as
    ``DistributedSampler`` pads) so every rank takes the same number of steps. Being a ``DistributedSampler``,
    Lightning uses it as it is under DDP instead of wrapping it.

    Args:
        num_rows: rows of the dataset.
        shuffle: permute (training) or keep the order (evaluation).
        seed: the permutation's key, with the epoch.
        num_replicas, rank: default: the initialised process group's, else one process.
    """

    _CHUNK = 1 << 14

    def __init__(
        self,
        num_rows: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        grouped = dist.is_available() and dist.is_initialized()
        self.num_replicas = int(num_replicas if num_replicas is not None else dist.get_world_size() if grouped else 1)
        self.rank = int(rank if rank is not None else dist.get_rank() if grouped else 0)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in [0, {self.num_replicas})")
        self.num_rows, self.shuffle, self.seed = int(num_rows), shuffle, int(seed)
        self.epoch = 0
        self.drop_last = False
        self.num_samples = math.ceil(self.num_rows / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    @override
    def __iter__(self) -> Iterator[int]:
        if self.num_rows == 0:
            return
        key = (self.seed * 1_000_003 + self.epoch) % (1 << 62)
        for start in range(0, self.num_samples, self._CHUNK):
            steps = np.arange(start, min(start + self._CHUNK, self.num_samples), dtype=np.int64)
            positions = (self.rank + steps * self.num_replicas) % self.num_rows
            rows = keyed_permutation(positions, self.num_rows, key) if self.shuffle else positions
            yield from rows.tolist()

    @override
    def __len__(self) -> int:
        return self.num_samples
