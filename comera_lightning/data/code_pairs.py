"""Code pairs: does this docstring describe this function? An MNLI-shaped task on local source files.

The paper trains its six-encoder classifier on GLUE MNLI (two segments, three classes), which must be
downloaded. This task has the same shape and is built offline from any tree of ``*.py`` files (default:
the Python standard library of the running interpreter), so the classifier trains on real text anywhere.

Examples. Every function or method (``def``/``async def``, nested ones too) with a docstring becomes an
anchor when its docstring has at least :data:`MIN_DOC_WORDS` words and the code after the docstring at
least :data:`MIN_BODY_TOKENS` tokens (files that do not parse are skipped). Segment A is the anchor's
docstring (``ast.get_docstring``); segment B is a function's *body*: its source from the ``def`` line to
its end without the docstring (decorators left out, blank lines dropped, dedented). Each anchor gives
three examples, like each MNLI premise has three hypotheses, so the classes are exactly balanced:

* 0 ``match``: the anchor's own body;
* 1 ``same_module``: the body of another documented function of the same file;
* 2 ``other_module``: the body of a documented function of another file of the same split.

A negative never has the anchor's docstring or body text (duplicated code would make it a match), nor
is it a function nested in the anchor or the one the anchor is nested in.
Anchors in a file with no other usable function give no examples (they still serve as negatives).

Splits are BY FILE (``split_by_hash`` of the relative path, as for :class:`CodeMLMDataModule`): a
validation example's docstring and both bodies come from validation files only. Which anchors and which
negatives are drawn depends on ``seed`` (a numpy ``Generator`` per split) and on nothing else: files are
sorted, functions kept in source order.

Pairs are encoded like MNLI (:func:`~comera_lightning.data.glue.encode_pairs`): ``[CLS] docstring [SEP]
body [SEP]``, truncated longest-first to ``seq_len`` (so a long docstring and a long body share it about
evenly) and padded; each segment is first cut to ``8 * seq_len`` characters, which only saves tokenising
text that truncation would drop.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from typing_extensions import override

from .common import TensorDictDataset, read_source_text, validation_share
from .corpus import SourceCorpus
from .glue import PairClassification, encode_pair_rows
from .tokenizer import cached_bpe_tokenizer, min_bpe_vocab_size

__all__ = [
    "CODE_PAIR_LABELS",
    "MIN_BODY_TOKENS",
    "MIN_DOC_WORDS",
    "CodePair",
    "CodePairsDataModule",
    "DocumentedFunction",
    "extract_documented_functions",
    "make_code_pairs",
]

#: class names by label id
CODE_PAIR_LABELS: tuple[str, ...] = ("match", "same_module", "other_module")
#: an anchor's docstring needs at least this many whitespace-separated words
MIN_DOC_WORDS = 3
#: the code after the docstring needs at least this many tokens (identifiers, numbers, punctuation)
MIN_BODY_TOKENS = 4
#: each segment is cut to this many characters per ``seq_len`` position before tokenising
CHARS_PER_POSITION = 8
_EXTRACTION_VERSION = 1  # bump when extraction or pairing changes, so old caches are not reused
_TOKEN = re.compile(r"\w+|[^\w\s]")
_NO_TEST_SPLIT = "the files are split into training and validation only"


@dataclass(frozen=True)
class DocumentedFunction:
    """One usable function: where it is, its docstring and its body (source without the docstring)."""

    path: str  #: relative POSIX path of its file
    name: str  #: qualified name, e.g. ``Class.method`` or ``outer.<locals>.inner``
    lineno: int  #: line of its ``def``
    end_lineno: int  #: its last line
    docstring: str
    body: str


@dataclass(frozen=True)
class CodePair:
    """One example: ``anchor``'s docstring (segment A), ``source``'s body (segment B) and the label."""

    anchor: DocumentedFunction
    source: DocumentedFunction
    label: int

    @property
    def text_a(self) -> str:
        return self.anchor.docstring

    @property
    def text_b(self) -> str:
        return self.source.body


def _function_nodes(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function in ``tree``, in source order.

    Iterative and statement-only: a ``def`` can only appear among statements, and recursing into deeply
    nested expressions (long ``a + b + ...`` chains) could exceed Python's recursion limit.
    """
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                stack.append((child, f"{prefix}{child.name}.<locals>."))
            elif isinstance(child, ast.ClassDef):
                stack.append((child, f"{prefix}{child.name}."))
            elif not isinstance(child, ast.expr):
                stack.append((child, prefix))
    found.sort(key=lambda item: (item[1].lineno, item[1].col_offset))
    return found


def extract_documented_functions(source: str, path: str = "") -> list[DocumentedFunction]:
    """The usable documented functions of one file's source (``[]`` when it does not parse).

    See the module docstring for what is usable and what the body is. ``path`` is only recorded.
    """
    text = source.replace("\r\n", "\n").replace("\r", "\n")  # the line breaks ast counts, and only those
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. invalid escape sequences in old code
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    data = text.encode("utf-8")  # ast columns are UTF-8 byte offsets
    line_start = [0]
    for line in text.split("\n"):
        line_start.append(line_start[-1] + len(line.encode("utf-8")) + 1)

    def offset(lineno: int, col: int) -> int:
        return line_start[lineno - 1] + col

    out: list[DocumentedFunction] = []
    for name, node in _function_nodes(tree):
        first = node.body[0]
        if (
            not (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            )
            or len(node.body) < 2
        ):
            continue
        docstring = ast.get_docstring(node, clean=True) or ""
        end = offset(node.end_lineno or node.lineno, node.end_col_offset or 0)
        code_after = data[offset(node.body[1].lineno, node.body[1].col_offset) : end].decode("utf-8", "replace")
        if len(docstring.split()) < MIN_DOC_WORDS or len(_TOKEN.findall(code_after)) < MIN_BODY_TOKENS:
            continue
        head = data[line_start[node.lineno - 1] : offset(first.lineno, first.col_offset)]
        tail = data[offset(first.end_lineno or first.lineno, first.end_col_offset or 0) : end]
        stripped = tail.lstrip(b" \t")
        if stripped.startswith(b";"):  # ``"""doc"""; statement`` on one line
            tail = stripped[1:]
        lines = (head + tail).decode("utf-8", "replace").split("\n")
        indent = node.col_offset
        body = "\n".join(line[min(indent, len(line) - len(line.lstrip())) :].rstrip() for line in lines if line.strip())
        out.append(DocumentedFunction(path, name, node.lineno, node.end_lineno or node.lineno, docstring, body))
    return out


def _distinct(a: DocumentedFunction, b: DocumentedFunction) -> bool:
    """Whether ``b`` can be a negative for anchor ``a``: neither its docstring nor its body repeats ``a``'s,
    and neither function contains the other (an outer function's body holds its nested functions' code)."""
    nested = a.path == b.path and (a.lineno <= b.lineno <= a.end_lineno or b.lineno <= a.lineno <= b.end_lineno)
    return not nested and a.docstring != b.docstring and a.body != b.body


def make_code_pairs(
    functions: Sequence[DocumentedFunction], rng: np.random.Generator, max_anchors: int | None = None
) -> list[CodePair]:
    """Three examples (match, same_module, other_module, in this order) per anchor, anchors in random order.

    ``functions`` are one split's usable functions; anchors are visited in a permutation drawn from
    ``rng`` and kept when both negatives exist, up to ``max_anchors``.
    """
    by_file: dict[str, list[int]] = {}
    for i, fn in enumerate(functions):
        by_file.setdefault(fn.path, []).append(i)
    if len(by_file) < 2:
        return []
    pairs: list[CodePair] = []
    for a in rng.permutation(len(functions)).tolist():
        if max_anchors is not None and len(pairs) >= 3 * max_anchors:
            break
        anchor = functions[a]
        same = [j for j in by_file[anchor.path] if _distinct(anchor, functions[j])]
        if not same:
            continue
        same_fn = functions[same[int(rng.integers(len(same)))]]
        other_fn = _draw_other(functions, anchor, rng)
        if other_fn is None:
            continue
        pairs += [CodePair(anchor, anchor, 0), CodePair(anchor, same_fn, 1), CodePair(anchor, other_fn, 2)]
    return pairs


def _draw_other(
    functions: Sequence[DocumentedFunction], anchor: DocumentedFunction, rng: np.random.Generator
) -> DocumentedFunction | None:
    """A uniformly drawn usable function of another file (``None`` if there is none)."""
    for _ in range(32):  # rejection sampling: almost always done in one or two draws
        fn = functions[int(rng.integers(len(functions)))]
        if fn.path != anchor.path and _distinct(anchor, fn):
            return fn
    candidates = [fn for fn in functions if fn.path != anchor.path and _distinct(anchor, fn)]
    return candidates[int(rng.integers(len(candidates)))] if candidates else None


class CodePairsDataModule(PairClassification, SourceCorpus):
    """Docstring/body pair classification on a local tree of ``.py`` files (default: the standard library).

    An offline stand-in for MNLI with the same batch layout, for
    :class:`~comera_lightning.lit.SequenceClassification` with ``num_classes=3``. Segment A is a function's
    docstring, segment B a function body; the label says whose body it is: 0 ``match`` (the same function), 1
    ``same_module`` (another function of the same file), 2 ``other_module`` (a function of another file). The
    classes are exactly balanced; see the module docstring for extraction, pairing and encoding.

    ``prepare_data`` (local rank zero) trains and caches the tokenizer (byte-level BPE on the training
    functions' docstrings and bodies) and the encoded splits under ``cache_dir``; ``setup`` loads them.
    The cache key covers the files' paths and contents and every argument that changes the examples.

    Batches (like :class:`MNLIDataModule`'s): ``input_ids``, ``attention_mask``, ``token_type_ids``
    (B, seq_len) long and ``labels`` (B,) long (names in :attr:`class_names`); prediction batches add
    ``index`` (B,) long, the example's number in the validation split (:meth:`examples` ``("val")``).

    ``test`` and ``predict`` run on the VALIDATION examples (the files are split into training and
    validation only; said once at info level).

    Vocabulary size: ``vocab_size`` is an upper bound (a trained BPE never exceeds it), so a model built
    with ``data.vocab_size`` always fits; ``vocab_size_actual`` is the tokenizer's real size.

    Args:
        root: folder searched recursively for ``*.py`` files; ``None`` is the standard library of the
            running Python (installed packages never included). Files are found and read as for
            :class:`CodeMLMDataModule` (``discover_files``, ``read_source_text``): a few binary files are
            skipped with a warning naming them, a mostly binary tree is refused.
        include_tests: also use files in ``test``/``tests``/``idle_test`` directories.
        max_files: keep only this many files (a deterministic, spread-out subset) for quick runs.
        max_examples: at most this many training examples (rounded down to a multiple of 3, at least 3)
            and proportionally many validation examples (``val_fraction / (1 - val_fraction)`` of it, at
            least 3); ``None`` uses every anchor.
        val_fraction: share of FILES held out for validation (by a stable hash of the path), in (0, 1).
        vocab_size: BPE vocabulary size to train (upper bound of the real size).
        seq_len: tokens per row, ``[CLS] docstring [SEP] body [SEP]`` after truncation, plus padding.
        batch_size: pairs per batch.
        cache_dir: where the tokenizer and the encoded splits are cached.
        num_workers: DataLoader worker processes.
        seed: seeds which anchors and negatives are drawn and the training shuffle (not the split, which
            depends only on file paths).
    """

    label_names = CODE_PAIR_LABELS
    _encoded_name = "code-pairs"
    _encoded_what = "encoded code-pair examples"
    _no_test_split = _NO_TEST_SPLIT

    def __init__(
        self,
        root: str | None = None,
        include_tests: bool = False,
        max_files: int | None = None,
        max_examples: int | None = None,
        val_fraction: float = 0.1,
        vocab_size: int = 8192,
        seq_len: int = 128,
        batch_size: int = 32,
        cache_dir: str = ".cache/comera",
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f"val_fraction must be in (0, 1) (the share of files held out for validation), got {val_fraction}"
            )
        if seq_len < 5:
            raise ValueError(f"seq_len must be >= 5 ([CLS] docstring [SEP] body [SEP]), got {seq_len}")
        if vocab_size < min_bpe_vocab_size():
            raise ValueError(
                f"vocab_size must be >= {min_bpe_vocab_size()} for a byte-level BPE (5 special tokens + 256 "
                f"bytes), got {vocab_size}"
            )
        if max_files is not None and max_files < 4:
            raise ValueError(
                "max_files must be >= 4 or None (each split needs two files with documented functions), "
                f"got {max_files}"
            )
        if max_examples is not None and max_examples < 3:
            raise ValueError(f"max_examples must be >= 3 (one example per class) or None, got {max_examples}")
        super().__init__(batch_size, num_workers, seed, cache_dir)
        self.save_hyperparameters()
        self.max_examples, self.seq_len = max_examples, seq_len
        self._init_corpus(root, "*.py", include_tests, max_files, val_fraction, vocab_size, None)
        self._functions: dict[str, list[DocumentedFunction]] = {}
        self._examples: dict[str, list[CodePair]] = {}

    # ------------------------------------------------------------------ examples
    def functions(self, split: str) -> list[DocumentedFunction]:
        """The usable documented functions of a split's files (``"train"`` or ``"val"``), files sorted."""
        if split not in self._functions:
            root = self.corpus_root
            found: list[DocumentedFunction] = []
            for rel in self._files_of(split):
                found += extract_documented_functions(read_source_text(root / rel), rel)
            self._functions[split] = found
        return self._functions[split]

    def _max_anchors(self, split: str) -> int | None:
        if self.max_examples is None:
            return None
        train = max(1, self.max_examples // 3)
        return train if split == "train" else validation_share(train, self.val_fraction)

    def examples(self, split: str) -> list[CodePair]:
        """A split's examples (``"train"`` or ``"val"``), unencoded; a clear error when there are none."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if split not in self._examples:
            functions = self.functions(split)
            rng = np.random.default_rng([self.seed, 0 if split == "train" else 1])
            pairs = make_code_pairs(functions, rng, self._max_anchors(split))
            if not pairs:
                files = self._files_of(split)
                n_files = len({fn.path for fn in functions})
                name = "training" if split == "train" else "validation"
                raise ValueError(
                    f"no code-pair examples in the {name} split of {str(self.corpus_root)!r}: its {len(files)} "
                    f"file(s) hold {len(functions)} usable documented function(s) in {n_files} file(s), but every "
                    "split needs at least two files with documented functions and one file with two different ones "
                    f"(a function is usable with a docstring of >= {MIN_DOC_WORDS} words and >= {MIN_BODY_TOKENS} "
                    "tokens of code after it); point root= at a larger tree of documented Python code, raise "
                    "max_files=, or change val_fraction= so that both splits get such files"
                )
            self._examples[split] = pairs
        return self._examples[split]

    # ------------------------------------------------------------------ tokenizer
    def _clip(self, text: str) -> str:
        return text[: CHARS_PER_POSITION * self.seq_len]

    @override
    def _train_tokenizer(self) -> tuple[Path, bool]:
        train, _ = self.split_files()

        def texts() -> list[str]:
            self.examples("train"), self.examples("val")  # an unusable tree fails before any training
            return [self._clip(t) for fn in self.functions("train") for t in (fn.docstring, fn.body)]

        return cached_bpe_tokenizer(
            self.cache_dir,
            "code-pairs",
            {
                "corpus": self._fingerprint("train"),
                "files": len(train),
                "clip": CHARS_PER_POSITION * self.seq_len,
                "extraction": [_EXTRACTION_VERSION, MIN_DOC_WORDS, MIN_BODY_TOKENS],
            },
            texts,
            self.vocab_size,
            add_prefix_space=False,
            origin=f"the functions of {len(train):,} training files under {self.corpus_root}",
        )

    # ------------------------------------------------------------------ encoding and caching
    @override
    def _encoded_source(self) -> dict[str, Any]:
        # every option that changes which examples are drawn or how they are encoded
        options = {name: getattr(self, name) for name in ("val_fraction", "max_examples", "seq_len", "seed")}
        extraction = [_EXTRACTION_VERSION, MIN_DOC_WORDS, MIN_BODY_TOKENS, CHARS_PER_POSITION]
        return {**super()._encoded_source(), **options, "extraction": extraction}

    @override
    def _encode_split(self, split: str) -> dict[str, torch.Tensor]:
        pairs = self.examples(split)
        return encode_pair_rows(
            self.tokenizer,
            [self._clip(p.text_a) for p in pairs],
            [self._clip(p.text_b) for p in pairs],
            [p.label for p in pairs],
            self.seq_len,
            self.special_ids,
        )

    @override
    def setup(self, stage: str | None = None) -> None:
        """Load the cached tokenizer and encoded splits (building them when missing) and make the datasets.

        Every stage (``fit``, ``validate``, ``test``, ``predict``) loads both splits from the one cache file.
        """
        if self.train_dataset is not None:
            return
        _ = self.tokenizer  # loads it and checks its size against vocab_size, even when the rows are cached
        data = self._encoded_splits()
        self.train_dataset = TensorDictDataset(**data["train"])
        self.val_dataset = TensorDictDataset(**data["val"])
