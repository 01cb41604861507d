"""A corpus of local source files and the code tokenizer trained on it, shared by the code data modules.

:class:`SourceCorpus` is the base of ``CodeMLMDataModule``, ``CodeLMDataModule`` and ``CodePairsDataModule``: it
finds the files (``common.discover_files``: binary files skipped or refused, test folders left out unless
asked), splits them into train/validation BY FILE with a stable hash of the relative path, fingerprints each
split's contents, trains (or loads from the cache) a byte-level BPE tokenizer on the training files, and caches
both splits once encoded. The tokenizer's cache key depends only on the training files and ``vocab_size``, so a
masked-LM and a causal-LM run on the same corpus share one tokenizer.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
from typing_extensions import override

from .base import ComeraDataModule
from .cache import cached_tensors
from .common import (
    discover_files,
    fingerprint_files,
    read_source_text,
    seeded_subsets,
    split_by_hash,
    validation_share,
)
from .tokenizer import TokenizerLifecycle, cached_bpe_tokenizer, encode_texts, file_sha1

__all__ = ["SourceCorpus", "stdlib_root"]


def stdlib_root() -> str:
    """Directory of the running interpreter's standard library sources."""
    return sysconfig.get_paths()["stdlib"]


class SourceCorpus(TokenizerLifecycle, ComeraDataModule):
    """Files under ``root`` matching ``pattern``, split by file, their ``"code"`` BPE tokenizer and encoded splits.

    The data module's constructor hands its corpus options to :meth:`_init_corpus`. It encodes a split in
    :meth:`_encode_split` (the files' tokens: :meth:`_encode_files`) and says in :meth:`_encoded_source` what the
    encoding depends on; both splits are cached together under ``<cache_dir>/encoded/<_encoded_name>-<key>.pt``.
    """

    cache_dir: str
    #: the encoded splits' cache file name before its key, and what they are (for the cache's messages)
    _encoded_name: str
    _encoded_what: str

    def _init_corpus(
        self,
        root: str | None,
        pattern: str,
        include_tests: bool,
        max_files: int | None,
        val_fraction: float,
        vocab_size: int,
        tokenizer_path: str | None,
    ) -> None:
        """Keep the corpus options (the module's arguments of the same names); nothing is read yet."""
        self.root, self.pattern, self.include_tests, self.max_files = root, pattern, include_tests, max_files
        self.val_fraction, self.vocab_size, self.tokenizer_path = val_fraction, vocab_size, tokenizer_path
        self._files: tuple[Path, list[str], list[str]] | None = None
        self._fingerprints: dict[str, str] = {}

    @property
    def corpus_root(self) -> Path:
        """The resolved corpus folder."""
        return Path(self.root if self.root is not None else stdlib_root()).expanduser()

    def split_files(self) -> tuple[list[str], list[str]]:
        """(train, validation) file lists, relative POSIX paths under :attr:`corpus_root`."""
        if self._files is None:
            root = self.corpus_root
            files = discover_files(root, self.pattern, include_tests=self.include_tests, max_files=self.max_files)
            train, val = split_by_hash(files, self.val_fraction)
            self._files = (root, train, val)
        return self._files[1], self._files[2]

    def _files_of(self, split: str) -> list[str]:
        """The files of one split, ``"train"`` or ``"val"``."""
        train, val = self.split_files()
        return train if split == "train" else val

    def _fingerprint(self, split: str) -> str:
        """Content hash of a split's files (memoised)."""
        if split not in self._fingerprints:
            self._fingerprints[split] = fingerprint_files(self.corpus_root, self._files_of(split))
        return self._fingerprints[split]

    @override
    def _train_tokenizer(self) -> tuple[Path, bool]:
        train, _ = self.split_files()
        root = self.corpus_root

        def texts() -> list[str]:
            read = [read_source_text(root / rel) for rel in train]
            if not any(read):
                raise ValueError(
                    f"the {len(train)} training file(s) matching {self.pattern!r} under {str(root)!r} are "
                    "all empty; point root= at a folder with non-empty source files"
                )
            return read

        return cached_bpe_tokenizer(
            self.cache_dir,
            "code",
            {"corpus": self._fingerprint("train"), "files": len(train)},
            texts,
            self.vocab_size,
            add_prefix_space=False,
            origin=f"{len(train):,} training files under {root}",
        )

    # ------------------------------------------------------------------ encoded splits
    def _encoded_source(self) -> dict[str, Any]:
        """What the encoded splits are derived from: the tokenizer and both splits' files (modules add theirs)."""
        return {
            "tokenizer": file_sha1(self._ensure_tokenizer_file()),
            "train": self._fingerprint("train"),
            "val": self._fingerprint("val"),
        }

    def _encode_files(self, split: str) -> list[np.ndarray]:
        """The token ids of each file of a split (no special tokens), in file order."""
        return encode_texts(self.tokenizer, [read_source_text(self.corpus_root / rel) for rel in self._files_of(split)])

    def _encode_split(self, split: str) -> Any:  # pragma: no cover - abstract
        """The tensors of one split, ``"train"`` or ``"val"``, as cached."""
        raise NotImplementedError

    def _encoded_cache_path(self) -> Path:
        """Where both encoded splits are cached."""
        return self._cache_file(self._encoded_name, self._encoded_source())

    def _encoded_splits(self) -> dict[str, Any]:
        """``{"train": ..., "val": ...}``: both splits encoded (:meth:`_encode_split`), or read from the cache."""
        train, val = self.split_files()
        source = self._encoded_source()
        return cached_tensors(
            self._cache_file(self._encoded_name, source),
            source=source,
            make=lambda: {split: self._encode_split(split) for split in ("train", "val")},
            what=self._encoded_what,
            origin=f"{len(train) + len(val):,} files under {self.corpus_root}",
        )

    def _capped(
        self, splits: dict[str, dict[str, Any]], max_sequences: int | None, max_val_sequences: int | None = None
    ) -> dict[str, dict[str, Any]]:
        """The rows of ``splits`` (``"train"``, ``"val"``: columns of tensors) within their caps, seeded subsets in
        row order: ``max_sequences`` training rows and ``max_val_sequences`` validation rows, by default
        proportionally many (at least one) when only ``max_sequences`` is set."""
        if max_val_sequences is None and max_sequences is not None:
            max_val_sequences = validation_share(max_sequences, self.val_fraction)
        return seeded_subsets(splits, {"train": max_sequences, "val": max_val_sequences}, self.seed)

    @override
    def prepare_data(self) -> None:
        """Train/cache the tokenizer and encode/cache both splits (Lightning calls this on local rank 0)."""
        self._encoded_splits()
