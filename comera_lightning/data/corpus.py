"""A corpus of local source files and the code tokenizer trained on it, shared by the code data modules.

:class:`SourceCorpus` is mixed into a ``LightningDataModule`` (``CodeMLMDataModule``, ``CodeLMDataModule``): it
finds the files (``common.discover_files``: binary files skipped or refused, test folders left out unless
asked), splits them into train/validation BY FILE with a stable hash of the relative path, fingerprints each
split's contents, and trains (or loads from the cache) a byte-level BPE tokenizer on the training files.
The tokenizer's cache key depends only on the training files and ``vocab_size``, so a masked-LM and a
causal-LM run on the same corpus share one tokenizer.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from .common import discover_files, fingerprint_files, read_source_text, split_by_hash
from .tokenizer import TokenizerLifecycle, cached_bpe_tokenizer, load_tokenizer

__all__ = ["SourceCorpus", "stdlib_root"]


def stdlib_root() -> str:
    """Directory of the running interpreter's standard library sources."""
    return sysconfig.get_paths()["stdlib"]


class SourceCorpus(TokenizerLifecycle):
    """Files under ``root`` matching ``pattern``, split by file, and their ``"code"`` BPE tokenizer.

    The data module's constructor sets ``root``, ``pattern``, ``include_tests``, ``max_files``, ``val_fraction``,
    ``cache_dir``, ``tokenizer_path`` and ``vocab_size``, and calls :meth:`_init_corpus` (or sets the same
    private fields itself).
    """

    root: str | None
    pattern: str
    include_tests: bool
    max_files: int | None
    val_fraction: float
    cache_dir: str
    tokenizer_path: str | None
    tokenizer_trained: bool

    def _init_corpus(self) -> None:
        self._files: tuple[Path, list[str], list[str]] | None = None
        self._fingerprints: dict[str, str] = {}
        self._tokenizer_file = None
        self._tokenizer = None
        self.tokenizer_trained = False  #: whether this instance trained (rather than loaded) the tokenizer

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

    def _fingerprint(self, split: str) -> str:
        """Content hash of a split's files (memoised)."""
        if split not in self._fingerprints:
            train, val = self.split_files()
            self._fingerprints[split] = fingerprint_files(self.corpus_root, train if split == "train" else val)
        return self._fingerprints[split]

    def _ensure_tokenizer_file(self) -> Path:
        if self._tokenizer_file is None:
            if self.tokenizer_path is not None:
                self._tokenizer_file = Path(self.tokenizer_path).expanduser()
                load_tokenizer(self._tokenizer_file)  # fail early with a clear message
            else:
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

                self._tokenizer_file, self.tokenizer_trained = cached_bpe_tokenizer(
                    self.cache_dir,
                    "code",
                    {"corpus": self._fingerprint("train"), "files": len(train)},
                    texts,
                    self.vocab_size,
                    add_prefix_space=False,
                    origin=f"{len(train):,} training files under {root}",
                )
        return self._tokenizer_file
