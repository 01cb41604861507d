"""Tokenizers for the data modules: byte-level BPE trained offline, cached, or a user's tokenizer.json.

Nothing is downloaded: a tokenizer is either trained here on the training split (HuggingFace
``tokenizers``, byte-level BPE so every input byte is representable and ``[UNK]`` never occurs) or read
from a local ``tokenizer.json`` (for example the one of ``bert-base-uncased``, copied by the user).

Tokenizers trained here put the special tokens first: ``[PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4``.
A user's tokenizer may number them differently, so code reads the ids from :class:`SpecialTokenIds`
rather than assuming them.

Trained tokenizers are cached under ``<cache_dir>/tokenizers/<name>-v<vocab>-<key>/tokenizer.json`` where
the key hashes what the tokenizer was trained on (file list and contents) and the recipe, so a second run
loads the file instead of training again, and a changed corpus or vocabulary size trains a new one. The file
is a verified cache entry (:mod:`.cache`): a damaged or truncated one is trained again, with a warning.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .cache import load_or_build
from .common import cache_key

__all__ = [
    "CLS_ID",
    "MASK_ID",
    "PAD_ID",
    "SEP_ID",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "SpecialTokenIds",
    "TokenizerLifecycle",
    "cached_bpe_tokenizer",
    "check_vocab_size",
    "encode_texts",
    "file_sha1",
    "load_checked_tokenizer",
    "load_tokenizer",
    "min_bpe_vocab_size",
    "train_bpe_tokenizer",
]

SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))
#: bump when the training recipe changes, so old caches are not reused
_RECIPE_VERSION = 1


def _tokenizers():
    try:
        import tokenizers
    except ImportError as err:  # pragma: no cover - declared dependency
        raise ImportError(
            "comera_lightning.data needs the HuggingFace `tokenizers` library: pip install 'tokenizers>=0.19'"
        ) from err
    return tokenizers


def min_bpe_vocab_size() -> int:
    """Smallest vocabulary a byte-level BPE can have: the special tokens plus the 256 byte symbols."""
    return len(SPECIAL_TOKENS) + 256


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    length: int | None = None,
    add_prefix_space: bool = False,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> Any:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on ``texts`` (no download, no network).

    Special tokens come first (``[PAD]=0 ... [MASK]=4``); the 256 byte symbols are always in the
    vocabulary, so any text encodes without ``[UNK]``. The result may have fewer than ``vocab_size``
    tokens when the texts have few distinct merges, never more.

    Args:
        texts: training documents (a code file, a sentence, ...).
        vocab_size: target vocabulary size, at least :func:`min_bpe_vocab_size`.
        length: number of texts, only for the trainer's bookkeeping.
        add_prefix_space: treat the first word like one after a space (natural language: ``True``;
            code, where leading whitespace is meaningful: ``False``).
        min_frequency: pairs seen fewer times are not merged.
        show_progress: the ``tokenizers`` trainer's own progress bars (on a terminal).
    """
    if vocab_size < min_bpe_vocab_size():
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
            f"{min_bpe_vocab_size()} (5 special tokens + 256 bytes)"
        )
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer, length=length)
    return tokenizer


def cached_bpe_tokenizer(
    cache_dir: str | os.PathLike[str],
    name: str,
    key_parts: Mapping[str, Any],
    texts: Callable[[], Iterable[str]],
    vocab_size: int,
    *,
    add_prefix_space: bool = False,
    origin: str | None = None,
) -> tuple[Path, bool]:
    """Path of a cached byte-level BPE tokenizer.json, training and saving it first when missing, damaged or
    stale (:func:`~.cache.load_or_build`: verified by size, checksum and source, built under a lock).

    Args:
        cache_dir: cache root; the file goes to ``<cache_dir>/tokenizers/<name>-v<vocab>-<key>/``.
        name: human-readable prefix of the cache folder (``"code"``, ``"mnli"``).
        key_parts: what identifies the training data (e.g. a corpus fingerprint); hashed into the key
            together with ``vocab_size``, ``add_prefix_space`` and the recipe version.
        texts: called only when training is needed; returns the training texts.
        vocab_size: target vocabulary size.
        origin: what the texts are, for the message that says what is trained ("412 files under /src").

    Returns:
        ``(path, trained)``: the tokenizer.json and whether it was trained by this call.
    """
    key = cache_key(
        {**key_parts, "vocab_size": vocab_size, "prefix_space": add_prefix_space, "recipe": _RECIPE_VERSION}
    )
    path = Path(cache_dir).expanduser() / "tokenizers" / f"{name}-v{vocab_size}-{key}" / "tokenizer.json"

    def build(target: Path, progress: Any) -> None:
        items = list(texts())
        if not any(items):
            raise ValueError(f"no training text to fit the {name!r} tokenizer on (all inputs are empty)")
        progress(f"training on {len(items):,} texts")
        tokenizer = train_bpe_tokenizer(
            items, vocab_size, length=len(items), add_prefix_space=add_prefix_space, show_progress=sys.stderr.isatty()
        )
        tokenizer.save(str(target))

    return load_or_build(
        path,
        kind="bpe-tokenizer",
        version=_RECIPE_VERSION,
        source={**key_parts, "vocab_size": vocab_size, "prefix_space": add_prefix_space},
        build=build,
        what=f"{name!r} byte-level BPE tokenizer (vocabulary {vocab_size:,})",
        origin=origin or f"the {name!r} training text",
    )


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Load a ``tokenizers`` tokenizer.json from a local path (a clear error if it is not there or unreadable)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(
            f"tokenizer file {str(path)!r} does not exist; pass tokenizer_path= a local tokenizer.json "
            "(HuggingFace `tokenizers` format) or tokenizer_path=None to train one on the training data"
        )
    try:
        return _tokenizers().Tokenizer.from_file(str(path))
    except Exception as error:  # the tokenizers library names neither the file nor a fix
        raise ValueError(
            f"tokenizer file {str(path)!r} does not load ({error}): it is damaged, cut short or not a HuggingFace "
            "tokenizer.json; copy it again from where it came from, or pass tokenizer_path=None to train one"
        ) from error


def file_sha1(path: str | os.PathLike[str]) -> str:
    """SHA-1 of a file's bytes (identifies a tokenizer in the keys of encoded-data caches)."""
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()


@dataclass(frozen=True)
class SpecialTokenIds:
    """Ids of the special tokens of one tokenizer (``None`` where it has no such token)."""

    pad: int
    cls: int
    sep: int
    mask: int | None
    unk: int | None

    _NAMES: ClassVar[dict[str, tuple[str, str]]] = {
        "pad": ("[PAD]", "<pad>"),
        "cls": ("[CLS]", "<s>"),
        "sep": ("[SEP]", "</s>"),
        "mask": ("[MASK]", "<mask>"),
        "unk": ("[UNK]", "<unk>"),
    }

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, require_mask: bool = False, source: str = "tokenizer") -> SpecialTokenIds:
        """Look the special tokens up by name (BERT ``[CLS]`` style or RoBERTa ``<s>`` style)."""
        ids: dict[str, int | None] = {}
        for field, names in cls._NAMES.items():
            ids[field] = next((i for i in map(tokenizer.token_to_id, names) if i is not None), None)
        needed = ["pad", "cls", "sep"] + (["mask"] if require_mask else [])
        missing = [f for f in needed if ids[f] is None]
        if missing:
            raise ValueError(
                f"{source} lacks the special tokens {[cls._NAMES[f][0] for f in missing]} "
                f"(or their RoBERTa-style equivalents); use a BERT/RoBERTa-style tokenizer.json or let "
                "the data module train one (tokenizer_path=None)"
            )
        return cls(**ids)  # type: ignore[arg-type]

    def all(self) -> list[int]:
        """Every special id this tokenizer has."""
        return sorted({i for i in (self.pad, self.cls, self.sep, self.mask, self.unk) if i is not None})


def check_vocab_size(actual: int, requested: int, source: str) -> None:
    """Refuse a tokenizer larger than the configured ``vocab_size`` (the model is built with the latter)."""
    if actual > requested:
        raise ValueError(
            f"{source} has {actual} tokens but vocab_size={requested}; the model's embedding is built with "
            f"vocab_size, so set vocab_size >= {actual}"
        )


def load_checked_tokenizer(path: str | os.PathLike[str], vocab_size: int) -> Any:
    """:func:`load_tokenizer`, refused by :func:`check_vocab_size` when it has more than ``vocab_size`` tokens."""
    tokenizer = load_tokenizer(path)
    check_vocab_size(tokenizer.get_vocab_size(), vocab_size, f"tokenizer {str(Path(path).expanduser())!r}")
    return tokenizer


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text (no special tokens added), as int64 numpy arrays."""
    if not texts:
        return []
    encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch  # fast: no offsets
    return [np.asarray(e.ids, dtype=np.int64) for e in encode(list(texts), add_special_tokens=False)]


class TokenizerLifecycle:
    """The tokenizer of a text data module: one place for loading, size checking and special ids.

    A data module mixes this in, sets ``vocab_size`` (and ``tokenizer_path`` when it takes one) and implements
    ``_train_tokenizer()``: train and cache its byte-level BPE, used when no ``tokenizer_path`` is given.
    ``require_mask`` says whether the task needs a ``[MASK]`` token (masked-LM).
    """

    vocab_size: int
    #: a local tokenizer.json to use instead of training one
    tokenizer_path: str | None = None
    #: whether this instance trained (rather than loaded) the tokenizer
    tokenizer_trained: bool = False
    require_mask: bool = False
    _tokenizer_file: Path | None = None
    _tokenizer: Any = None

    def _train_tokenizer(self) -> tuple[Path, bool]:  # pragma: no cover - abstract
        """``(tokenizer.json, trained)`` of :func:`cached_bpe_tokenizer` on this module's training text."""
        raise NotImplementedError

    def _ensure_tokenizer_file(self) -> Path:
        """The tokenizer.json in use: ``tokenizer_path`` (checked to load), else the trained and cached BPE."""
        if self._tokenizer_file is None:
            if self.tokenizer_path is not None:
                self._tokenizer_file = Path(self.tokenizer_path).expanduser()
                load_tokenizer(self._tokenizer_file)  # a missing or damaged file fails here, clearly
            else:
                self._tokenizer_file, self.tokenizer_trained = self._train_tokenizer()
        return self._tokenizer_file

    @property
    def tokenizer_file(self) -> Path:
        """The tokenizer.json this module encodes with (trained and cached on first use): what an export carries so
        the model can be run on text."""
        return self._ensure_tokenizer_file()

    @property
    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` (trained or loaded on first access, refused if larger than ``vocab_size``)."""
        if self._tokenizer is None:
            self._tokenizer = load_checked_tokenizer(self._ensure_tokenizer_file(), self.vocab_size)
        return self._tokenizer

    @property
    def special_ids(self) -> SpecialTokenIds:
        """Ids of [PAD], [CLS], [SEP], [MASK], [UNK] in the tokenizer."""
        return SpecialTokenIds.from_tokenizer(
            self.tokenizer, require_mask=self.require_mask, source=f"tokenizer {self._tokenizer_file}"
        )

    @property
    def vocab_size_actual(self) -> int:
        """Number of tokens of the tokenizer in use (<= ``vocab_size``)."""
        return int(self.tokenizer.get_vocab_size())
