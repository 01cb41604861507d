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
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from .base import ComeraDataModule
from .code_mlm import _compact
from .common import TensorDictDataset, check_limit, check_val_fraction
from .corpus import SourceCorpus

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


class CausalLMEvaluation(ComeraDataModule):
    """What both causal-LM data modules share: their batches, prompts for prediction and ``decode``.

    A module built on it sets ``train_dataset`` and ``val_dataset`` (rows of ``input_ids`` and ``labels``) in
    ``setup`` and has a ``tokenizer``; ``test`` runs on the validation rows.
    """

    tokenizer: Any

    def __init__(
        self, batch_size: int, num_workers: int, seed: int, cache_dir: str | None, prompt_len: int, num_prompts: int
    ) -> None:
        if prompt_len < 1 or num_prompts < 1:
            raise ValueError(f"prompt_len and num_prompts must be >= 1, got {prompt_len}, {num_prompts}")
        super().__init__(batch_size, num_workers, seed, cache_dir)
        self.prompt_len, self.num_prompts = prompt_len, num_prompts

    @override
    def _collate_fn(self, train: bool) -> LMCollator:
        return LMCollator()

    def prompts(self) -> torch.Tensor:
        """``(n, prompt_len)`` prompts: the first tokens of up to ``num_prompts`` validation rows, evenly spread."""
        rows = self._rows("val_dataset", "predict")
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


class CodeLMDataModule(CausalLMEvaluation, SourceCorpus):
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

    _encoded_name = "code-lm"
    _encoded_what = "encoded token streams"

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
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        check_val_fraction(val_fraction)
        check_limit("max_sequences", max_sequences)
        check_limit("max_val_sequences", max_val_sequences)
        super().__init__(batch_size, num_workers, seed, cache_dir, prompt_len, num_prompts)
        self.save_hyperparameters()
        self.seq_len, self.max_sequences, self.max_val_sequences = seq_len, max_sequences, max_val_sequences
        self._init_corpus(root, pattern, include_tests, max_files, val_fraction, vocab_size, tokenizer_path)

    @property
    def eos_id(self) -> int:
        """The end-of-document token that follows every file in the streams (``[SEP]``)."""
        return self.special_ids.sep

    # ------------------------------------------------------------------ encoding and caching
    @override
    def _encoded_source(self) -> dict[str, Any]:
        return {**super()._encoded_source(), "version": _STREAM_VERSION}

    @override
    def _encode_split(self, split: str) -> torch.Tensor:
        docs = self._encode_files(split)
        eos = np.asarray([self.eos_id], dtype=np.int64)
        parts = [part for doc in docs if len(doc) for part in (doc, eos)]
        stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return _compact(torch.from_numpy(stream), self.vocab_size_actual)

    def streams(self) -> dict[str, torch.Tensor]:
        """The encoded ``train`` and ``val`` token streams (cached)."""
        return self._encoded_splits()

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
            splits[name] = {
                "input_ids": _compact(inputs, self.vocab_size_actual),
                "labels": _compact(labels, self.vocab_size_actual),
            }
        if len(splits["train"]["input_ids"]) == 0:
            raise ValueError(
                f"the training files under {str(self.corpus_root)!r} contain fewer than two tokens; add non-empty files"
            )
        rows = self._capped(splits, self.max_sequences, self.max_val_sequences)
        self.train_dataset = TensorDictDataset(**rows["train"])
        self.val_dataset = TensorDictDataset(**rows["val"])
