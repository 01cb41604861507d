"""Next-token pre-training on a user's own local corpus, at any size: tokenised once to disk, then streamed.

The data flow goes one way:

1. **Sources** (:mod:`.text_sources`): ``files`` globs of ``.txt`` / ``.jsonl`` / ``.parquet`` files (``.gz``
   too), or a ``datasets.save_to_disk`` folder (``dataset_path``), read as bounded pieces of documents.
2. **Tokenizer**: a given ``tokenizer.json`` (HF ``tokenizers``; its own end-of-document token), or a
   byte-level BPE trained here on the first ``tokenizer_sample_mb`` of training text (``[SEP]`` ends a
   document), cached like the other modules' tokenizers.
3. **Tokenising once** (``prepare_data``, local rank 0): pieces are encoded in batches of about 4 MB of text by
   ``encode_batch`` (the tokenizers library's Rust threads: every core) and appended to a token store
   (:mod:`.token_store`): ``train.bin`` / ``val.bin`` and ``meta.json`` under ``token_dir`` (default
   ``<cache_dir>/text-lm/<key>``, the key hashing the corpus, the tokenizer and the split). Memory is bounded
   by the batch, not by the corpus. Each document's side is decided by a stable hash of its identity and
   the seed (``val_fraction`` of the documents), or by separate ``val_files``, or by a ``DatasetDict``'s
   ``validation`` split.
4. **Streaming rows**: packed rows of ``seq_len`` tokens read from the files by ``pread``
   (:class:`~.token_store.TokenRows`), shuffled by a keyed permutation in constant memory and sharded by
   DDP rank (:class:`~.token_store.ShardedShuffleSampler`), through a
   :class:`~.common.ResumableDataLoader`, so a killed fit resumes the stream where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from .cache import Progress, load_or_build
from .code_lm import CausalLMEvaluation
from .common import cache_key, check_val_fraction, stable_unit
from .corpus import stdlib_root
from .text_sources import Piece, TextSource, dataset_sources, iter_pieces, resolve_files, sources_fingerprint
from .token_store import (
    STORE_FILES,
    ShardedShuffleSampler,
    TokenRows,
    TokenStoreWriter,
    read_token_store,
    token_dtype,
)
from .tokenizer import TokenizerLifecycle, cached_bpe_tokenizer, encode_texts, file_sha1

__all__ = ["EOS_TOKEN_NAMES", "TextLMDataModule"]

#: end-of-document tokens looked up, in this order, in a given tokenizer (GPT-2/LLaMA-3, LLaMA-2/T5, ...)
EOS_TOKEN_NAMES: tuple[str, ...] = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]", "<|im_end|>")
_STORE_VERSION = 1
#: text per encode_batch call: enough pieces to keep every core busy, bounded memory
_BATCH_BYTES = 4 << 20


class TextLMDataModule(TokenizerLifecycle, CausalLMEvaluation):
    """Packed next-token batches from local text, JSON lines, Parquet or a ``datasets`` folder (module docstring).

    Batches: ``input_ids`` and ``labels`` (B, ``seq_len``) long; ``labels`` is ``-100`` only on the padded end
    of a split's last row. ``test_dataloader`` gives the validation rows again; ``predict_dataloader`` gives
    ``num_prompts`` prompts of ``prompt_len`` tokens spread over the validation rows.

    Args:
        files: glob(s) of the training corpus (``**`` recurses); relative ones are taken from ``root``.
        dataset_path: a ``datasets.save_to_disk`` folder instead of ``files``.
        text_field: the JSON key / column that holds a document's text.
        val_files: glob(s) of separate validation files (then ``val_fraction`` is not used).
        val_fraction: fraction of the documents held out for validation, by a stable hash under ``seed``.
        root: folder of relative globs (default: the working directory); ``"stdlib"`` is the Python standard
            library, a corpus every installation has (the CPU example's).
        tokenizer_path: a local ``tokenizer.json``; ``None`` trains a byte-level BPE of ``vocab_size``.
        eos_token: the end-of-document token of a given tokenizer; ``None`` looks up :data:`EOS_TOKEN_NAMES`.
        vocab_size: size of the BPE to train, or the largest vocabulary a given tokenizer may have (the
            model's embedding has ``model.vocab_size >= data.vocab_size`` rows).
        seq_len: tokens per row.
        batch_size: rows per batch (per process).
        token_dir: where the token store goes (default: under ``cache_dir``, keyed by corpus and tokenizer);
            an existing store written from another corpus or tokenizer is refused, never overwritten.
        cache_dir: root of the caches (trained tokenizers, token stores).
        tokenizer_sample_mb: megabytes of training text a BPE is trained on.
        prompt_len, num_prompts: prediction prompts.
        num_workers: DataLoader worker processes.
        seed: the training order and the validation split.
    """

    cache_dir: str

    def __init__(
        self,
        files: str | list[str] | None = None,
        dataset_path: str | None = None,
        text_field: str = "text",
        val_files: str | list[str] | None = None,
        val_fraction: float = 0.01,
        root: str | None = None,
        tokenizer_path: str | None = None,
        eos_token: str | None = None,
        vocab_size: int = 32000,
        seq_len: int = 256,
        batch_size: int = 32,
        token_dir: str | None = None,
        cache_dir: str = ".cache/comera",
        tokenizer_sample_mb: float = 64.0,
        prompt_len: int = 16,
        num_prompts: int = 8,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        if (files is None) == (dataset_path is None):
            raise ValueError(
                "pass exactly one corpus: data.files (globs of .txt/.jsonl/.parquet files) or data.dataset_path "
                f"(a datasets.save_to_disk folder); got files={files!r}, dataset_path={dataset_path!r}"
            )
        if dataset_path is not None and val_files is not None:
            raise ValueError(
                "val_files= goes with files=; a dataset_path's validation comes from its 'validation' "
                "split or val_fraction"
            )
        check_val_fraction(val_fraction)
        if seq_len < 2 or batch_size < 1:
            raise ValueError(f"seq_len must be >= 2 and batch_size >= 1, got {seq_len}, {batch_size}")
        if tokenizer_sample_mb <= 0:
            raise ValueError(f"tokenizer_sample_mb must be > 0, got {tokenizer_sample_mb}")
        super().__init__(batch_size, num_workers, seed, cache_dir, prompt_len, num_prompts)
        self.save_hyperparameters()
        self.files, self.dataset_path, self.text_field = files, dataset_path, text_field
        self.val_files, self.val_fraction, self.root = val_files, val_fraction, root
        self.tokenizer_path, self.eos_token, self.vocab_size = tokenizer_path, eos_token, vocab_size
        self.seq_len, self.token_dir, self.tokenizer_sample_mb = seq_len, token_dir, tokenizer_sample_mb
        self._sources: dict[str, list[TextSource]] | None = None

    # ------------------------------------------------------------------ corpus
    def sources(self) -> dict[str, list[TextSource]]:
        """``{"train": [...], "val": [...]}``: the inputs of each split (``val`` empty when split by document)."""
        if self._sources is None:
            if self.dataset_path is not None:
                splits = dataset_sources(self.dataset_path)
                self._sources = {
                    "train": [splits["train"]],
                    "val": [splits["validation"]] if "validation" in splits else [],
                }
            else:
                root = stdlib_root() if self.root == "stdlib" else self.root
                train = resolve_files(self.files, root, "files")  # type: ignore[arg-type]
                val = resolve_files(self.val_files, root, "val_files") if self.val_files is not None else []
                overlap = {s.path for s in train} & {s.path for s in val}
                if overlap:
                    raise ValueError(
                        f"{len(overlap)} file(s) match both files= and val_files=, e.g. {str(min(overlap))!r}; "
                        "make the two globs disjoint"
                    )
                self._sources = {"train": train, "val": val}
        return self._sources

    def _split_by_document(self) -> bool:
        return not self.sources()["val"]

    def _is_validation(self, piece: Piece) -> bool:
        return stable_unit(piece.doc, f"val{self.seed}") < self.val_fraction

    def _pieces(self, split: str) -> Iterator[tuple[str, Piece]]:
        """(split, piece) of every document, training sources first."""
        by_document = self._split_by_document()
        for source in self.sources()[split]:
            for piece in iter_pieces(source, self.text_field):
                side = split if not by_document else "val" if self._is_validation(piece) else "train"
                yield side, piece

    # ------------------------------------------------------------------ tokenizer
    @override
    def _train_tokenizer(self) -> tuple[Path, bool]:
        budget = int(self.tokenizer_sample_mb * 2**20)
        return cached_bpe_tokenizer(
            self.cache_dir,
            "text",
            {"corpus": self._corpus_fingerprint(), "text_field": self.text_field, "sample_bytes": budget},
            lambda: self._sample_text(budget),
            self.vocab_size,
        )

    def _sample_text(self, budget: int) -> Iterator[str]:
        seen = 0
        for side, piece in self._pieces("train"):
            if side == "train":
                yield piece.text
                seen += len(piece.text)
                if seen >= budget:
                    return

    @property
    def eos_id(self) -> int:
        """The end-of-document token after every document (the tokenizer's own; ``[SEP]`` in a trained BPE)."""
        names = (self.eos_token,) if self.eos_token is not None else EOS_TOKEN_NAMES
        for name in names:
            found = self.tokenizer.token_to_id(name)
            if found is not None:
                return int(found)
        raise ValueError(
            f"tokenizer {str(self._tokenizer_file)!r} has no end-of-document token (looked for {list(names)}); set "
            "data.eos_token to the token that ends a document in it"
        )

    @property
    def pad_id(self) -> int:
        """Input id of the padded end of a split's last row (never a target): the tokenizer's pad, else EOS."""
        for name in ("[PAD]", "<pad>", "<|pad|>"):
            found = self.tokenizer.token_to_id(name)
            if found is not None:
                return int(found)
        return self.eos_id

    # ------------------------------------------------------------------ token store
    def _corpus_fingerprint(self) -> str:
        sources = self.sources()
        return sources_fingerprint([*sources["train"], *sources["val"]])

    def _identity(self) -> dict[str, Any]:
        """What a token store must have been written from to be reused."""
        return {
            "version": _STORE_VERSION,
            "tokenizer_sha1": file_sha1(self._ensure_tokenizer_file()),
            "corpus": self._corpus_fingerprint(),
            "text_field": self.text_field,
            "eos_id": self.eos_id,
            "split": (
                {"val_fraction": self.val_fraction, "seed": self.seed}
                if self._split_by_document()
                else {"val_sources": [s.name for s in self.sources()["val"]]}
            ),
        }

    def token_folder(self) -> Path:
        """The token store of this corpus and tokenizer (``token_dir``, or its keyed folder under ``cache_dir``)."""
        if self.token_dir is not None:
            return Path(self.token_dir).expanduser()
        return Path(self.cache_dir).expanduser() / "text-lm" / cache_key(self._identity())

    def _check_store(self, folder: Path, meta: dict[str, Any]) -> None:
        expected = self._identity()
        different = [key for key in expected if meta.get(key) != expected[key]]
        if not different:
            return
        what = (
            "another tokenizer"
            if "tokenizer_sha1" in different
            else "another corpus or split"
            if {"corpus", "split", "text_field"} & set(different)
            else "another version or end-of-document token"
        )
        raise ValueError(
            f"the token store {str(folder)!r} was written by {what} (differs in {different}); nothing was "
            "overwritten: pass a new data.token_dir for this corpus and tokenizer, or delete that folder to "
            "tokenise again"
        )

    def tokenize(self) -> Path:
        """Write the token store if it is missing, or again if it does not verify (:mod:`.cache`: cut short,
        damaged); a store of another corpus or tokenizer in ``token_dir`` is refused, never overwritten."""
        folder = self.token_folder()
        try:
            meta = read_token_store(folder)
        except ValueError:  # a damaged meta.json: the store does not verify and is written again below
            meta = {}
        if meta:
            self._check_store(folder, meta)
        elif meta is None and folder.exists() and any(folder.iterdir()):
            raise ValueError(
                f"token_dir {str(folder)!r} exists and is not a token store (no meta.json); nothing was "
                "overwritten: pass an empty or new folder as data.token_dir"
            )
        elif meta is None and folder.exists():
            folder.rmdir()  # an empty folder: the store's rename needs the name free
        identity = self._identity()

        def build(target: Path, progress: Progress) -> None:
            writer = TokenStoreWriter(target, token_dtype(self.vocab_size_actual))
            try:
                self._write_tokens(writer, progress)
            finally:
                writer.close()
            if writer.counts["train"] < 2:
                raise ValueError(
                    f"the training documents of {self.files or self.dataset_path!r} give {writer.counts['train']} "
                    "token(s); a corpus needs at least two (point files= at non-empty documents)"
                )
            writer.commit(
                {
                    **identity,
                    "tokenizer": str(self._tokenizer_file),
                    "vocab_size": self.vocab_size_actual,
                    "pad_id": self.pad_id,
                }
            )

        sources = self.sources()
        count = len(sources["train"]) + len(sources["val"])
        load_or_build(
            folder,
            kind="token-store",
            version=_STORE_VERSION,
            source=identity,
            build=build,
            files=STORE_FILES,
            what="token store",
            origin=f"{count:,} source(s) ({self.files or self.dataset_path}) with {self._tokenizer_file}",
        )
        return folder

    def _write_tokens(self, writer: TokenStoreWriter, progress: Progress = lambda text: None) -> None:
        eos = np.asarray([self.eos_id], dtype=np.int64)
        batch: list[tuple[str, Piece]] = []
        size = 0

        def flush() -> None:
            for (side, piece), ids in zip(batch, encode_texts(self.tokenizer, [p.text for _, p in batch]), strict=True):
                writer.append(side, ids)
                if piece.doc_end:
                    writer.append(side, eos)
            batch.clear()
            tokens = writer.counts["train"] + writer.counts["val"]
            progress(f"{tokens / 1e6:,.1f} M tokens written ({writer.counts['val'] / 1e6:,.1f} M of them validation)")

        for split in ("train", "val"):
            for side, piece in self._pieces(split):
                batch.append((side, piece))
                size += len(piece.text)
                if size >= _BATCH_BYTES:
                    flush()
                    size = 0
        flush()

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def prepare_data(self) -> None:
        """Load or train the tokenizer and tokenise the corpus once (Lightning calls this on local rank 0)."""
        self.tokenize()

    @override
    def setup(self, stage: str | None = None) -> None:
        """Open the token store's splits as packed rows (every stage opens both)."""
        if self.train_dataset is not None:
            return
        folder = self.tokenize()  # checks the store; writes it only when prepare_data did not run
        meta = read_token_store(folder)
        assert meta is not None
        pad = int(meta["pad_id"])
        self.train_dataset = TokenRows(folder / "train.bin", meta["dtype"], self.seq_len, pad)
        self.val_dataset = TokenRows(folder / "val.bin", meta["dtype"], self.seq_len, pad)
        if len(self.val_dataset) == 0 and (self.val_fraction > 0 or not self._split_by_document()):
            rank_zero_warn(
                f"the validation split of {self.files or self.dataset_path!r} is empty (too few documents for "
                f"val_fraction={self.val_fraction}): validation is skipped; raise data.val_fraction or pass "
                "data.val_files"
            )

    @override
    def _sampler(self, rows: Any, train: bool) -> ShardedShuffleSampler:
        """This rank's share of the rows: shuffled for training (the order a function of seed and epoch), else
        in order."""
        if train:
            return ShardedShuffleSampler(len(rows), shuffle=True, seed=self.seed)
        return ShardedShuffleSampler(len(rows), shuffle=False)
