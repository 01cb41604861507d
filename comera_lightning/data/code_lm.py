"""Next-token (causal language model) data on a corpus of source files (default: the Python standard library).

The corpus, its train/validation split BY FILE and the byte-level BPE tokenizer are those of
:class:`~comera_lightning.data.CodeMLMDataModule` (:class:`~comera_lightning.data.corpus.SourceCorpus`; the
same corpus gives the same cached tokenizer). Each split is encoded into one token stream, every file
followed by the end-of-document token (``[SEP]``), and cached under ``cache_dir`` (the stream does not
depend on ``seq_len``, so changing it needs no re-encoding). Rows are packed: row ``i`` holds tokens
``i*T .. i*T+T-1`` of the stream as ``input_ids`` and the next ones, ``i*T+1 .. i*T+T``, as ``labels``, so
every token is a target once and documents follow each other inside a row (attention crosses the
document boundary, as in GPT/LLaMA pre-training). The last, partial row is padded (``[PAD]`` inputs,
``-100`` labels).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from .cache import cached_tensors
from .code_mlm import _compact
from .common import TensorDictDataset, cache_key, read_source_text, rows_loader
from .corpus import SourceCorpus
from .tokenizer import encode_texts, file_sha1

__all__ = ["CodeLMDataModule", "LMCollator", "pack_stream"]

IGNORE_INDEX = -100
_STREAM_VERSION = 1


def pack_stream(stream: torch.Tensor, seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a 1-D token stream into next-token rows: ``(input_ids, labels)``, each ``(rows, seq_len)`` int64.

    ``labels[i, t] = stream[i * seq_len + t + 1]``. A stream of ``n`` tokens has ``n - 1`` targets and gives
    ``ceil((n - 1) / seq_len)`` rows; the last row's missing positions hold ``pad_id`` / ``-100``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    stream = stream.long()
    targets = max(0, len(stream) - 1)
    rows = math.ceil(targets / seq_len)
    inputs = torch.full((rows * seq_len,), pad_id, dtype=torch.long)
    labels = torch.full((rows * seq_len,), IGNORE_INDEX, dtype=torch.long)
    inputs[:targets] = stream[:targets]
    labels[:targets] = stream[1 : targets + 1]
    return inputs.view(rows, seq_len), labels.view(rows, seq_len)


class LMCollator:
    """Collate of :class:`TensorDictDataset` batches into int64 tensors, optionally keeping ``index``."""

    def __init__(self, keep_index: bool = False) -> None:
        self.keep_index = keep_index

    def __call__(self, batch: Any) -> dict[str, torch.Tensor]:
        """``batch``: the dict of tensors a :class:`TensorDictDataset` returns for a list of indices."""
        return {k: v.long() for k, v in batch.items() if self.keep_index or k != "index"}


class CausalLMEvaluation(pl.LightningDataModule):
    """The loaders both causal-LM datamodules serve from their validation rows, their prompts and ``decode``.

    A datamodule using it sets ``train_dataset`` and ``val_dataset`` in ``setup``, provides ``_eval_loader(rows)``
    (its in-order loader), and has ``batch_size``, ``prompt_len``, ``num_prompts`` and ``tokenizer``.
    """

    # rows with __len__ and __getitems__ (TensorDictDataset, TokenRows); None until set up
    train_dataset: Any
    val_dataset: Any
    batch_size: int
    prompt_len: int
    num_prompts: int
    tokenizer: Any
    _eval_loader: Callable[[Any], DataLoader]

    def _datasets(self, stage: str) -> tuple[Any, Any]:
        """The training and validation rows, set up for ``stage`` on first use."""
        if self.train_dataset is None or self.val_dataset is None:
            self.setup(stage)
        return self.train_dataset, self.val_dataset

    def _validation_rows_loader(self, stage: str) -> DataLoader | list:
        rows = self._datasets(stage)[1]
        return [] if len(rows) == 0 else self._eval_loader(rows)

    @override
    def val_dataloader(self) -> DataLoader | list:
        """Validation rows in order; ``[]`` without validation rows."""
        return self._validation_rows_loader("validate")

    @override
    def test_dataloader(self) -> DataLoader | list:
        """The validation rows again (the corpus is split into training and validation only)."""
        return self._validation_rows_loader("test")

    def prompts(self) -> torch.Tensor:
        """``(n, prompt_len)`` prompts: the first tokens of up to ``num_prompts`` validation rows, evenly spread."""
        rows = self._datasets("predict")[1]
        if len(rows) == 0:
            return torch.zeros(0, self.prompt_len, dtype=torch.long)
        picks = torch.linspace(0, len(rows) - 1, min(self.num_prompts, len(rows))).round().long().unique()
        return rows.__getitems__(picks.tolist())["input_ids"][:, : self.prompt_len].long()

    @override
    def predict_dataloader(self) -> DataLoader | list:
        """Prompts for sampling (:meth:`prompts`): batches of ``input_ids`` and ``index`` (the prompt number)."""
        prompts = self.prompts()
        if len(prompts) == 0:
            return []
        return DataLoader(
            TensorDictDataset(input_ids=prompts), batch_size=self.batch_size, collate_fn=LMCollator(keep_index=True)
        )

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of a sequence of token ids (special tokens dropped)."""
        ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


class CodeLMDataModule(CausalLMEvaluation, SourceCorpus, pl.LightningDataModule):
    """Packed next-token batches from a local corpus of source files (default: the Python standard library).

    Batches: ``input_ids`` (B, T) and ``labels`` (B, T) long (``-100`` only on the padded end of the last
    row of a split). ``test_dataloader`` gives the validation rows again (the corpus has two splits);
    ``predict_dataloader`` gives prompts: the first ``prompt_len`` tokens of ``num_prompts`` validation rows,
    spread evenly over the split (``input_ids`` (B, prompt_len) and ``index``, the row).

    Args:
        root, pattern, include_tests, max_files, val_fraction, cache_dir, tokenizer_path: the corpus and its
            tokenizer, as in :class:`~comera_lightning.data.CodeMLMDataModule`.
        vocab_size: BPE vocabulary size to train (an upper bound of the real size).
        seq_len: tokens per row.
        batch_size: rows per batch.
        max_sequences: keep at most this many training rows (a seeded random subset) and proportionally many
            validation rows (at least one); the cache always holds the whole streams.
        max_val_sequences: keep at most this many validation rows (a seeded random subset of the whole split, in
            stream order), whatever ``max_sequences`` is: validation on a large corpus stays cheap and still samples
            every part of it, where ``limit_val_batches`` alone reads only the first files.
        prompt_len: tokens per prediction prompt.
        num_prompts: how many prompts ``predict`` samples from.
        num_workers: DataLoader worker processes.
        seed: seeds the training shuffle and the ``max_sequences`` subset (not the split).
    """

    def __init__(
        self,
        root: str | None = None,
        pattern: str = "*.py",
        vocab_size: int = 8192,
        seq_len: int = 256,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        max_files: int | None = None,
        max_sequences: int | None = None,
        max_val_sequences: int | None = None,
        cache_dir: str = ".cache/comera",
        tokenizer_path: str | None = None,
        include_tests: bool = False,
        prompt_len: int = 16,
        num_prompts: int = 8,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_sequences is not None and max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1 or None, got {max_sequences}")
        if max_val_sequences is not None and max_val_sequences < 1:
            raise ValueError(f"max_val_sequences must be >= 1 or None, got {max_val_sequences}")
        if prompt_len < 1 or num_prompts < 1:
            raise ValueError(f"prompt_len and num_prompts must be >= 1, got {prompt_len}, {num_prompts}")
        self.save_hyperparameters()
        self.root, self.pattern, self.include_tests = root, pattern, include_tests
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.val_fraction, self.max_files, self.max_sequences = val_fraction, max_files, max_sequences
        self.max_val_sequences = max_val_sequences
        self.cache_dir, self.tokenizer_path = cache_dir, tokenizer_path
        self.prompt_len, self.num_prompts = prompt_len, num_prompts
        self.num_workers, self.seed = num_workers, seed
        self._init_corpus()
        self.train_dataset: TensorDictDataset | None = None
        self.val_dataset: TensorDictDataset | None = None

    @property
    def eos_id(self) -> int:
        """The end-of-document token that follows every file in the streams (``[SEP]``)."""
        return self.special_ids.sep

    # ------------------------------------------------------------------ encoding and caching
    def _stream_cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser() / "encoded" / f"code-lm-{cache_key(self._stream_source())}.pt"

    def _stream_source(self) -> dict[str, Any]:
        return {
            "tokenizer": file_sha1(self._ensure_tokenizer_file()),
            "train": self._fingerprint("train"),
            "val": self._fingerprint("val"),
            "version": _STREAM_VERSION,
        }

    def _encode_split(self, files: list[str]) -> torch.Tensor:
        docs = encode_texts(self.tokenizer, [read_source_text(self.corpus_root / rel) for rel in files])
        eos = np.asarray([self.eos_id], dtype=np.int64)
        parts = [part for doc in docs if len(doc) for part in (doc, eos)]
        stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return _compact(torch.from_numpy(stream), self.vocab_size_actual)

    def streams(self) -> dict[str, torch.Tensor]:
        """The encoded ``train`` and ``val`` token streams (cached)."""
        train, val = self.split_files()
        return cached_tensors(
            self._stream_cache_path(),
            source=self._stream_source(),
            make=lambda: {"train": self._encode_split(train), "val": self._encode_split(val)},
            what="encoded token streams",
            origin=f"{len(train) + len(val):,} files under {self.corpus_root}",
        )

    @override
    def prepare_data(self) -> None:
        """Train/cache the tokenizer and encode/cache both streams (Lightning calls this on local rank 0)."""
        self.streams()

    @override
    def setup(self, stage: str | None = None) -> None:
        """Load the cached tokenizer and streams and pack them into rows (every stage builds both splits)."""
        if self.train_dataset is not None:
            return
        pad = self.special_ids.pad  # also loads the tokenizer and checks its size against vocab_size
        data = self.streams()
        splits = {}
        for name in ("train", "val"):
            inputs, labels = pack_stream(data[name], self.seq_len, pad)
            splits[name] = (_compact(inputs, self.vocab_size_actual), _compact(labels, self.vocab_size_actual))
        if len(splits["train"][0]) == 0:
            raise ValueError(
                f"the training files under {str(self.corpus_root)!r} contain fewer than two tokens; add non-empty files"
            )
        g = torch.Generator().manual_seed(self.seed)
        n_val = self.max_val_sequences
        if n_val is None and self.max_sequences is not None:
            n_val = max(1, round(self.max_sequences * self.val_fraction / (1.0 - self.val_fraction)))
        for name, keep in (("train", self.max_sequences), ("val", n_val)):
            rows = len(splits[name][0])
            if keep is not None and rows > keep:
                chosen = torch.randperm(rows, generator=g)[:keep].sort().values
                inputs, labels = splits[name]
                splits[name] = inputs[chosen], labels[chosen]
        self.train_dataset = TensorDictDataset(input_ids=splits["train"][0], labels=splits["train"][1])
        self.val_dataset = TensorDictDataset(input_ids=splits["val"][0], labels=splits["val"][1])

    # ------------------------------------------------------------------ loaders

    def _eval_loader(self, rows: TensorDictDataset) -> DataLoader:
        return rows_loader(
            rows,
            batch_size=self.batch_size,
            collate_fn=LMCollator(),
            train=False,
            seed=self.seed,
            num_workers=self.num_workers,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled rows (order a function of seed and epoch), resumable mid-epoch."""
        rows = self._datasets("fit")[0]
        return rows_loader(
            rows,
            batch_size=self.batch_size,
            collate_fn=LMCollator(),
            train=True,
            seed=self.seed,
            num_workers=self.num_workers,
        )
