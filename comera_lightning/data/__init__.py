"""LightningDataModules that read local files only (nothing is downloaded at run time).

* :class:`CodeMLMDataModule`: masked-LM on source files, by default the Python standard library.
* :class:`CodeLMDataModule`: next-token (causal LM) pre-training on the same corpus, packed rows.
* :class:`TextLMDataModule`: next-token pre-training on a user's own text, JSON lines, Parquet or ``datasets``
  corpus at any size, tokenised once to disk and streamed, sharded by DDP rank.
* :class:`MNLIDataModule`: GLUE MNLI from a ``datasets.save_to_disk`` folder, GLUE TSVs or JSONL.
* :class:`CodePairsDataModule`: MNLI-shaped pair classification (docstring vs function body: match, same
  module, other module) built offline from source files, by default the Python standard library.
* :class:`CriteoDataModule`: Criteo-format CTR data from TSV files, or synthetic power-law data.

All six are built on :class:`ComeraDataModule` (:mod:`.base`): the options they share (``batch_size``, ``num_workers``,
``seed``, ``cache_dir``) checked in one place, and the same loaders. Shared pieces: byte-level BPE tokenizers
trained offline and cached (:mod:`.tokenizer`), the code corpus (:mod:`.corpus`), stable hashing and file discovery
(:mod:`.common`), verified caches (:mod:`.cache`).
"""

from .base import ComeraDataModule
from .code_lm import CodeLMDataModule, LMCollator, pack_stream
from .code_mlm import CodeMLMDataModule, MLMCollator, mask_tokens, stdlib_root
from .code_pairs import CODE_PAIR_LABELS, CodePairsDataModule, extract_documented_functions
from .common import TensorDictDataset, discover_files, split_by_hash, stable_hash
from .ctr import (
    CRITEO_KAGGLE_CARDINALITIES,
    DEFAULT_TABLE_SIZES,
    CriteoDataModule,
    hash_categorical,
    read_criteo_tsv,
    synthetic_criteo,
    write_synthetic_criteo_tsv,
)
from .glue import MNLI_LABELS, MNLIDataModule, read_mnli_split, write_synthetic_mnli
from .text_lm import TextLMDataModule
from .tokenizer import (
    SPECIAL_TOKENS,
    SpecialTokenIds,
    cached_bpe_tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

__all__ = [
    "CODE_PAIR_LABELS",
    "CRITEO_KAGGLE_CARDINALITIES",
    "DEFAULT_TABLE_SIZES",
    "MNLI_LABELS",
    "SPECIAL_TOKENS",
    "CodeLMDataModule",
    "CodeMLMDataModule",
    "CodePairsDataModule",
    "ComeraDataModule",
    "CriteoDataModule",
    "LMCollator",
    "MLMCollator",
    "MNLIDataModule",
    "SpecialTokenIds",
    "TensorDictDataset",
    "TextLMDataModule",
    "cached_bpe_tokenizer",
    "discover_files",
    "extract_documented_functions",
    "hash_categorical",
    "load_tokenizer",
    "mask_tokens",
    "pack_stream",
    "read_criteo_tsv",
    "read_mnli_split",
    "split_by_hash",
    "stable_hash",
    "stdlib_root",
    "synthetic_criteo",
    "train_bpe_tokenizer",
    "write_synthetic_criteo_tsv",
    "write_synthetic_mnli",
]
