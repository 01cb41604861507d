"""Masked-language-model data on a corpus of source files (default: the Python standard library).

The quickstart corpus ships with every Python interpreter, so a first run needs no download: the ``*.py``
files under ``sysconfig.get_paths()["stdlib"]`` (installed packages in ``site-packages`` never included,
test suites only with ``include_tests=True``).

Pipeline (each step cached under ``cache_dir``, so a second run starts in about a second):

1. files are found and split into train/validation BY FILE, by a stable hash of the relative path
   (adding files never moves others between the splits);
2. a byte-level BPE tokenizer is trained on the training files only (``tokenizers``), keyed by the
   training files' paths and contents and ``vocab_size``;
3. each split is encoded into one token stream (files separated by ``[SEP]``) and cut into rows of
   ``seq_len`` tokens, ``[CLS] <seq_len - 2 tokens> [SEP]``; the last row of a split is padded;
4. BERT masking happens in the collate function: each non-special token is selected with probability
   ``mlm_probability``; a selected token becomes ``[MASK]`` 80% of the time, a random non-special token
   10%, stays itself 10%. Training masks are fresh every epoch; validation masks are a function of
   ``(seed, row)`` only, so every validation pass scores the very same task.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info
from typing_extensions import override

from .common import TensorDictDataset, check_limit, check_val_fraction
from .corpus import SourceCorpus, stdlib_root

__all__ = ["CodeMLMDataModule", "MLMCollator", "chunk_stream", "mask_tokens", "stdlib_root"]

IGNORE_INDEX = -100
_ENCODING_VERSION = 1
_NO_TEST_SPLIT = "the corpus is split into training and validation files only"


def mask_tokens(
    input_ids: torch.Tensor,
    *,
    mask_id: int,
    special_ids: Sequence[int],
    vocab_size: int,
    mlm_probability: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of a (B, T) batch of token ids: returns ``(masked_inputs, labels)``.

    Tokens whose id is in ``special_ids`` ([PAD], [CLS], [SEP], ...) are never selected. Each other
    token is selected with probability ``mlm_probability``; a selected token is replaced by ``mask_id``
    with probability 0.8, by a uniformly drawn non-special id below ``vocab_size`` with probability 0.1,
    and kept with probability 0.1. ``labels`` holds the original id at selected positions and -100
    (ignored by ``cross_entropy``) elsewhere. All randomness comes from ``generator``.
    """
    ids = input_ids.long()
    special = torch.as_tensor(list(special_ids), dtype=torch.long)
    maskable = ~torch.isin(ids, special)
    selected = (torch.rand(ids.shape, generator=generator) < mlm_probability) & maskable
    action = torch.rand(ids.shape, generator=generator)
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[special[special < vocab_size]] = False
    allowed_ids = allowed.nonzero().squeeze(1)
    random_ids = allowed_ids[torch.randint(len(allowed_ids), ids.shape, generator=generator)]
    labels = torch.where(selected, ids, torch.full_like(ids, IGNORE_INDEX))
    out = torch.where(selected & (action < 0.8), torch.full_like(ids, mask_id), ids)
    out = torch.where(selected & (action >= 0.8) & (action < 0.9), random_ids, out)
    return out, labels


class MLMCollator:
    """Collate function that masks a :class:`TensorDictDataset` batch of token rows.

    Args:
        mask_id, special_ids, vocab_size, mlm_probability: see :func:`mask_tokens`.
        pad_id: id whose positions get ``attention_mask`` 0.
        seed: base seed.
        deterministic: if True (validation) each row is masked with a generator seeded from
            ``(seed, row index)``, so the masks do not depend on batch composition, epoch, worker or
            process; if False (training) one generator per process/worker draws fresh masks every batch.
        rank: the process's global rank, mixed into the training seed so that DDP processes do not mask
            the same positions in step.
    """

    def __init__(
        self,
        *,
        mask_id: int,
        special_ids: Sequence[int],
        vocab_size: int,
        mlm_probability: float,
        pad_id: int,
        seed: int = 0,
        deterministic: bool = False,
        rank: int = 0,
    ) -> None:
        self.mask_id = mask_id
        self.special_ids = list(special_ids)
        self.vocab_size = vocab_size
        self.mlm_probability = mlm_probability
        self.pad_id = pad_id
        self.seed = seed
        self.deterministic = deterministic
        self.rank = rank
        self._generator: torch.Generator | None = None
        self._worker_generator: torch.Generator | None = None

    def _train_generator(self) -> torch.Generator:
        info = get_worker_info()
        if info is not None:
            # in a worker, the worker's own seed (different per worker and per epoch, derived from the loader's
            # generator); kept apart from the main process's generator, which a worker receives as a copy
            if self._worker_generator is None:
                self._worker_generator = torch.Generator().manual_seed(self._mix(info.seed))
            return self._worker_generator
        if self._generator is None:  # in the main process, the configured seed
            self._generator = torch.Generator().manual_seed(self._mix(self.seed))
        return self._generator

    def _mix(self, seed: int) -> int:
        return (seed + 0x9E3779B97F4A7C15 * self.rank) % (2**63)

    def state_dict(self) -> dict[str, Any]:
        """The main process's training-mask generator (a uint8 tensor) and the rank it belongs to.

        Saved in the training loader's state (:class:`~comera_lightning.data.common.ResumableDataLoader`)
        so a run resumed mid-epoch draws the same masks as the uninterrupted run. Masks drawn in worker
        processes (``num_workers > 0``) come from the workers' seeds and are not part of the state.
        """
        if self.deterministic:
            return {}
        return {"rank": int(self.rank), "generator": self._train_generator().get_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state saved by another rank is ignored (each rank masks differently)."""
        state = state_dict.get("generator")
        if self.deterministic or state is None or int(state_dict.get("rank", 0)) != self.rank:
            return
        self._train_generator().set_state(state)

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = batch["input_ids"].long()
        kwargs: dict[str, Any] = dict(
            mask_id=self.mask_id,
            special_ids=self.special_ids,
            vocab_size=self.vocab_size,
            mlm_probability=self.mlm_probability,
        )
        if self.deterministic:
            g = torch.Generator()
            rows = []
            for row, index in zip(ids, batch["index"].tolist(), strict=True):
                g.manual_seed((self.seed * 1_000_003 + int(index) * 7919 + 17) % (2**63))
                rows.append(mask_tokens(row.unsqueeze(0), generator=g, **kwargs))
            inputs = torch.cat([r[0] for r in rows])
            labels = torch.cat([r[1] for r in rows])
        else:
            inputs, labels = mask_tokens(ids, generator=self._train_generator(), **kwargs)
        if not (labels != IGNORE_INDEX).any():
            # a batch without a single target gives a NaN loss: mask its first maskable token
            maskable = (~torch.isin(ids, torch.as_tensor(self.special_ids))).flatten().nonzero()
            if len(maskable):
                pos = int(maskable[0])
                labels.view(-1)[pos] = ids.view(-1)[pos]
                inputs.view(-1)[pos] = self.mask_id
        return {
            "input_ids": inputs,
            "attention_mask": (ids != self.pad_id).long(),
            "labels": labels,
        }


def chunk_stream(docs: Sequence[np.ndarray], seq_len: int, *, cls_id: int, sep_id: int, pad_id: int) -> torch.Tensor:
    """Concatenate token arrays (``sep_id`` between documents) and cut rows ``[CLS] ... [SEP]``.

    Every row has exactly ``seq_len`` ids; only the last row can be short, and it is padded with
    ``pad_id`` after its ``[SEP]``. Returns a (rows, seq_len) int64 tensor (0 rows for empty input).
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 ([CLS] token [SEP]), got {seq_len}")
    parts: list[np.ndarray] = []
    for doc in docs:
        if len(doc) == 0:
            continue
        if parts:
            parts.append(np.asarray([sep_id], dtype=np.int64))
        parts.append(np.asarray(doc, dtype=np.int64))
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    body = seq_len - 2
    n_rows = math.ceil(len(stream) / body)
    out = np.full((n_rows, seq_len), pad_id, dtype=np.int64)
    if n_rows == 0:
        return torch.from_numpy(out)
    full = len(stream) // body
    out[:full, 0] = cls_id
    out[:full, 1:-1] = stream[: full * body].reshape(full, body)
    out[:full, -1] = sep_id
    rest = stream[full * body :]
    if len(rest):
        out[-1, 0] = cls_id
        out[-1, 1 : 1 + len(rest)] = rest
        out[-1, 1 + len(rest)] = sep_id
    return torch.from_numpy(out)


def _compact(t: torch.Tensor, vocab: int) -> torch.Tensor:
    return t.to(torch.int16 if vocab <= torch.iinfo(torch.int16).max else torch.int32)


class CodeMLMDataModule(SourceCorpus):
    """Masked-LM batches from a local corpus of source files (default: the Python standard library).

    ``prepare_data`` (local rank zero) trains and caches the tokenizer and the encoded splits; ``setup``
    loads them (and builds them itself when ``prepare_data`` was not called, e.g. outside a Trainer).

    Vocabulary size: ``vocab_size`` stays the configured value and is an upper bound (a trained BPE never
    exceeds it; a user tokenizer that does is refused), so a model built with ``data.vocab_size`` (e.g. a
    LightningCLI argument link) always fits. ``vocab_size_actual`` is the tokenizer's real size (it
    trains/loads the tokenizer on first access).

    Batches: ``input_ids`` (B, T) long with masks applied, ``attention_mask`` (B, T) long (0 on padding),
    ``labels`` (B, T) long, the original id at masked positions and -100 elsewhere; prediction batches add
    ``index`` (B,) long, the row number. Training rows are shuffled with fresh masks every epoch (position and
    mask generator are part of the checkpoint, so a run resumed mid-epoch draws the same); validation masks are
    fixed by (seed, row). ``test`` and ``predict`` run on the VALIDATION rows with the same masks (the corpus is
    split into training and validation files only; said once at info level), so ``comera test`` scores exactly
    the task validation scores.

    Args:
        root: folder searched recursively for the corpus; ``None`` is the standard library of the running
            Python. Binary files (not UTF-8, or holding NUL bytes) are skipped with a warning naming them,
            and a corpus that is mostly binary is refused up front (``data.common.text_files_only``).
        pattern: file-name glob (``fnmatch``), e.g. ``"*.py"``.
        vocab_size: BPE vocabulary size to train (upper bound of the real size, see above).
        seq_len: tokens per row including ``[CLS]`` and ``[SEP]``.
        batch_size: rows per batch.
        mlm_probability: fraction of non-special tokens selected for prediction.
        val_fraction: share of FILES held out for validation (by a stable hash of the path).
        max_files: keep only this many files (a deterministic, spread-out subset) for quick runs.
        max_sequences: keep at most this many training rows (a seeded random subset) and proportionally
            many validation rows (at least one); the cache always holds all rows.
        cache_dir: where tokenizers and encoded tensors are cached.
        tokenizer_path: a local tokenizer.json to use instead of training one; it must have
            ``[PAD] [CLS] [SEP] [MASK]`` (or ``<pad> <s> </s> <mask>``).
        include_tests: also use files in ``test``/``tests``/``idle_test`` directories (in the standard
            library they are about 60% of the files and contain deliberately broken code).
        num_workers: DataLoader worker processes.
        seed: seeds the training shuffle, the training masks, the validation masks and the
            ``max_sequences`` subset (not the split, which depends only on file paths).
    """

    require_mask = True
    _encoded_name = "code-mlm"
    _encoded_what = "encoded masked-LM rows"
    _no_test_split = _NO_TEST_SPLIT

    def __init__(
        self,
        root: str | None = None,
        pattern: str = "*.py",
        vocab_size: int = 8192,
        seq_len: int = 128,
        batch_size: int = 32,
        mlm_probability: float = 0.15,
        val_fraction: float = 0.05,
        max_files: int | None = None,
        max_sequences: int | None = None,
        cache_dir: str = ".cache/comera",
        tokenizer_path: str | None = None,
        include_tests: bool = False,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        if seq_len < 3:
            raise ValueError(f"seq_len must be >= 3 ([CLS] token [SEP]), got {seq_len}")
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        check_val_fraction(val_fraction)
        check_limit("max_sequences", max_sequences)
        super().__init__(batch_size, num_workers, seed, cache_dir)
        self.save_hyperparameters()
        self.seq_len, self.mlm_probability, self.max_sequences = seq_len, mlm_probability, max_sequences
        self._init_corpus(root, pattern, include_tests, max_files, val_fraction, vocab_size, tokenizer_path)

    # ------------------------------------------------------------------ encoding and caching
    @override
    def _encoded_source(self) -> dict[str, Any]:
        return {**super()._encoded_source(), "seq_len": self.seq_len, "version": _ENCODING_VERSION}

    @override
    def _encode_split(self, split: str) -> torch.Tensor:
        ids = self.special_ids
        docs = self._encode_files(split)
        rows = chunk_stream(docs, self.seq_len, cls_id=ids.cls, sep_id=ids.sep, pad_id=ids.pad)
        return _compact(rows, self.vocab_size_actual)

    @override
    def setup(self, stage: str | None = None) -> None:
        """Load the cached tokenizer and encoded rows and build the datasets.

        Every stage (``fit``, ``validate``, ``test``, ``predict``) loads both splits from the one cache file:
        ``test`` and ``predict`` run on the validation rows, with the validation masks.
        """
        if self.train_dataset is not None:
            return
        _ = self.tokenizer  # loads it and checks its size against vocab_size, even when the rows are cached
        data = self._encoded_splits()
        if len(data["train"]) == 0:
            raise ValueError(
                f"the training files under {str(self.corpus_root)!r} contain no tokens; add non-empty files"
            )
        rows = self._capped({split: {"input_ids": data[split]} for split in ("train", "val")}, self.max_sequences)
        self.train_dataset = TensorDictDataset(**rows["train"])
        self.val_dataset = TensorDictDataset(**rows["val"])

    # ------------------------------------------------------------------ loaders
    @override
    def _collate_fn(self, train: bool) -> MLMCollator:
        """Fresh BERT masks for training (the generator is part of the loader's state, so a resumed run draws
        the same); masks fixed by (seed, row) for the others."""
        ids = self.special_ids
        return MLMCollator(
            mask_id=ids.mask,  # type: ignore[arg-type]
            special_ids=ids.all(),
            vocab_size=self.vocab_size_actual,
            mlm_probability=self.mlm_probability,
            pad_id=ids.pad,
            seed=self.seed,
            deterministic=not train,
            rank=self.trainer.global_rank if self.trainer is not None else 0,
        )
