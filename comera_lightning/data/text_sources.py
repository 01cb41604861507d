"""The documents of a user's local text corpus, read as a stream of bounded pieces.

Formats, chosen by file name (a trailing ``.gz`` is decompressed on the fly):

* ``.jsonl`` / ``.ndjson`` / ``.json``: JSON lines, one object per line, the document in ``text_field``
  (C4 ships as ``.json.gz`` files of this kind);
* ``.parquet``: one document per row of the ``text_field`` column;
* anything else (``.txt``, ``.md``, ``.py``, ...): UTF-8 text, one document per file;
* a ``datasets.save_to_disk`` folder (a ``Dataset`` or a ``DatasetDict``): one document per row.

Every document is yielded as :class:`Piece` objects of about ``piece_bytes`` of text, so memory stays
bounded whatever the size of a file or a document. A plain text document is cut only right after a newline
that is followed by a non-whitespace character: byte-level BPE pre-tokenisation (GPT-2's, LLaMA-3's) never
joins across such a point, so the cut pieces encode to exactly the tokens of the whole file. A line longer
than ``4 * piece_bytes`` with no such point is cut at a space or, failing that, at a character boundary.

Each piece names its document (``doc``: ``"name"`` for a text file, ``"name:line"`` / ``"name:row"``
otherwise, with ``name`` the path relative to the glob's folder), so a validation split decided by a hash
of ``doc`` does not depend on where the corpus lives or on how it is cut into pieces.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import itertools
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import DEFAULT_EXCLUDED_DIRS, _name_some

__all__ = [
    "Piece",
    "TextSource",
    "dataset_sources",
    "file_format",
    "iter_pieces",
    "resolve_files",
    "sources_fingerprint",
]

JSON_LINES_SUFFIXES = (".jsonl", ".ndjson", ".json")
#: how many bytes of text a piece holds (the unit of tokenisation work)
PIECE_BYTES = 1 << 16
_NOT_TEXT = "binary or not UTF-8 text"
_WHITESPACE = b" \t\r\n\x0b\x0c"


@dataclass(frozen=True)
class Piece:
    """A bounded piece of one document: its text, the document's identity, and whether it ends there."""

    text: str
    doc: str
    doc_end: bool


@dataclass(frozen=True)
class TextSource:
    """One input of the corpus: a file (with its format) or one split of a ``datasets`` folder."""

    path: Path
    name: str
    format: str  # "text", "jsonl", "parquet" or "dataset"
    split: str | None = None  # the DatasetDict split, for format "dataset"


def file_format(path: str | os.PathLike[str]) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"`` from a file name (``.gz`` looked through)."""
    name = Path(path).name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    if name.endswith(JSON_LINES_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _glob_base(pattern: str) -> Path:
    """The folder a glob pattern starts from: its longest leading run of folders without a wildcard."""
    fixed = list(itertools.takewhile(lambda part: not glob.has_magic(part), Path(pattern).parts[:-1]))
    return Path(*fixed) if fixed else Path(".")


def resolve_files(
    patterns: str | Sequence[str], root: str | os.PathLike[str] | None = None, what: str = "files"
) -> list[TextSource]:
    """The files matching glob ``patterns`` (``**`` recurses), sorted, each once.

    Relative patterns are taken from ``root`` (default: the working directory). Hidden folders and the
    folders of :data:`~comera_lightning.data.common.DEFAULT_EXCLUDED_DIRS` (``site-packages``, ``.git``, ...)
    below a pattern's fixed folder are skipped.

    Raises:
        ValueError: a pattern matches no file (the message names it and the folder it was taken from).
    """
    base_dir = Path(root).expanduser() if root is not None else Path.cwd()
    found: dict[Path, TextSource] = {}
    for pattern in [patterns] if isinstance(patterns, str) else list(patterns):
        full = Path(pattern).expanduser()
        full = full if full.is_absolute() else base_dir / full
        base = _glob_base(str(full))
        hits = []
        for hit in sorted(glob.glob(str(full), recursive=True)):
            path = Path(hit)
            rel = path.relative_to(base) if path.is_relative_to(base) else Path(path.name)
            if not path.is_file() or any(p in DEFAULT_EXCLUDED_DIRS or p.startswith(".") for p in rel.parts[:-1]):
                continue
            hits.append(path)
            found.setdefault(path, TextSource(path, rel.as_posix(), file_format(path)))
        if not hits:
            raise ValueError(
                f"{what}={pattern!r} matches no file (looked for {str(full)!r}); check the path, or pass a glob "
                "such as '/data/corpus/**/*.jsonl' (relative globs are taken from data.root, default the "
                "working directory)"
            )
    return sorted(found.values(), key=lambda s: str(s.path))


def dataset_sources(path: str | os.PathLike[str]) -> dict[str, TextSource]:
    """The splits of a ``datasets.save_to_disk`` folder: ``{"train": ..., "validation": ...}`` (validation
    only when a ``DatasetDict`` has a ``validation``/``valid``/``val`` split), or ``{"train": ...}`` for a
    single ``Dataset``."""
    folder = Path(path).expanduser()
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        if "train" not in splits:
            raise ValueError(
                f"the DatasetDict at {str(folder)!r} has no 'train' split (it has {splits}); save the training "
                "documents as a 'train' split, or pass the folder of one split as dataset_path="
            )
        out = {"train": TextSource(folder, "train", "dataset", "train")}
        val = next((s for s in ("validation", "valid", "val") if s in splits), None)
        if val is not None:
            out["validation"] = TextSource(folder, val, "dataset", val)
        return out
    if (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file():
        return {"train": TextSource(folder, "", "dataset")}
    raise ValueError(
        f"dataset_path={str(folder)!r} is not a folder written by datasets' save_to_disk (no dataset_dict.json "
        "or state.json there); pass the folder given to Dataset.save_to_disk / DatasetDict.save_to_disk, or use "
        "files= for text, JSON lines or Parquet files"
    )


def sources_fingerprint(sources: Sequence[TextSource]) -> str:
    """SHA-1 over each source's name, size and modification time (a changed or added file changes it).

    Contents are not read: hashing a corpus of hundreds of GB would cost as much as tokenising it.
    """
    digest = hashlib.sha1()
    for source in sources:
        files = sorted(source.path.rglob("*")) if source.path.is_dir() else [source.path]
        digest.update(f"{source.name}|{source.format}|{source.split}\0".encode())
        for file in files:
            if file.is_file():
                stat = file.stat()
                digest.update(f"{file.relative_to(source.path.parent)}|{stat.st_size}|{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def iter_pieces(source: TextSource, text_field: str = "text", piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """The pieces of every document of ``source``, in order (see the module docstring).

    Raises:
        ValueError: the file is binary or not UTF-8, a JSON line is not an object with a string
            ``text_field``, a Parquet file or dataset lacks the column; the message names the file, the
            line or row, and the fix.
    """
    if source.format == "text":
        with _open(source.path) as fh:
            yield from _text_pieces(fh, source, piece_bytes)
    elif source.format == "jsonl":
        yield from _json_lines_pieces(source, text_field, piece_bytes)
    elif source.format == "parquet":
        yield from _parquet_pieces(source, text_field, piece_bytes)
    elif source.format == "dataset":
        yield from _dataset_pieces(source, text_field, piece_bytes)
    else:  # pragma: no cover - TextSource is built here only
        raise ValueError(f"unknown source format {source.format!r}")


def _open(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _not_text(source: TextSource, where: str) -> ValueError:
    return ValueError(
        f"{str(source.path)!r} is {_NOT_TEXT} ({where}); convert it to UTF-8 (e.g. iconv -t UTF-8) or leave it out "
        "of files= (narrow the glob)"
    )


def _decode(data: bytes, source: TextSource, where: str) -> str:
    if b"\0" in data:
        raise _not_text(source, f"a NUL byte {where}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_text(source, f"{err.reason} {where}") from None


def _safe_cut(buffer: bytes, start: int, hard_limit: int) -> int:
    """First position >= ``start`` right after a newline followed by non-whitespace; beyond ``hard_limit``,
    a space or a UTF-8 character boundary instead; 0 when the buffer has no cut yet."""
    pos = start
    while True:
        pos = buffer.find(b"\n", pos)
        if pos < 0 or pos + 1 >= len(buffer):
            break
        if buffer[pos + 1] not in _WHITESPACE:
            return pos + 1
        pos += 1
    if len(buffer) < hard_limit:
        return 0
    space = buffer.rfind(b" ", start, hard_limit)
    cut = space + 1 if space > 0 else hard_limit
    while cut > 0 and buffer[cut] & 0xC0 == 0x80:  # never inside a multi-byte character
        cut -= 1
    return cut


def _text_pieces(fh: io.BufferedIOBase, source: TextSource, piece_bytes: int) -> Iterator[Piece]:
    buffer = b""
    offset = 0
    ended = False
    while not ended:
        block = fh.read(max(piece_bytes, 1 << 20))
        ended = not block
        buffer += block
        while len(buffer) > piece_bytes:
            cut = _safe_cut(buffer, piece_bytes, 4 * piece_bytes)
            if cut == 0:
                break
            yield Piece(_decode(buffer[:cut], source, f"within bytes {offset}..{offset + cut}"), source.name, False)
            offset += cut
            buffer = buffer[cut:]
    yield Piece(_decode(buffer, source, f"within bytes {offset}..{offset + len(buffer)}"), source.name, True)


def _long_document(text: str, doc: str, piece_bytes: int) -> Iterator[Piece]:
    """A structured-format document as pieces (short ones: one piece)."""
    if len(text) <= piece_bytes:
        yield Piece(text, doc, True)
        return
    data = text.encode("utf-8")
    holder = TextSource(Path(doc), doc, "text")
    yield from (Piece(p.text, doc, p.doc_end) for p in _text_pieces(io.BytesIO(data), holder, piece_bytes))


def _field_error(source: TextSource, where: str, text_field: str, available: Sequence[str]) -> ValueError:
    return ValueError(
        f"{str(source.path)!r} {where} has no text field {text_field!r} (it has {_name_some(sorted(available))}); "
        "set data.text_field to the field that holds the document text"
    )


def _json_lines_pieces(source: TextSource, text_field: str, piece_bytes: int) -> Iterator[Piece]:
    with _open(source.path) as fh:
        for number, raw in enumerate(fh, start=1):
            line = _decode(raw, source, f"on line {number}").strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{str(source.path)!r} line {number} is not JSON ({err.msg}); JSON lines files hold one JSON "
                    "object per line (a .json file holding one array is not supported: write it as JSON lines)"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                keys = list(record) if isinstance(record, dict) else [type(record).__name__]
                raise _field_error(source, f"line {number}", text_field, keys)
            text = record[text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise ValueError(
                    f"{str(source.path)!r} line {number}: {text_field!r} holds a {type(text).__name__}, not text; "
                    "set data.text_field to a field whose values are strings"
                )
            if text:
                yield from _long_document(text, f"{source.name}:{number}", piece_bytes)


def _parquet_pieces(source: TextSource, text_field: str, piece_bytes: int) -> Iterator[Piece]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(source.path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(
            f"{str(source.path)!r} is not a readable Parquet file ({err}); leave it out of files="
        ) from None
    if text_field not in parquet.schema_arrow.names:
        raise _field_error(source, "(Parquet columns)", text_field, parquet.schema_arrow.names)
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str) and text:
                yield from _long_document(text, f"{source.name}:{row}", piece_bytes)
            row += 1


def load_saved_dataset(source: TextSource) -> Any:
    """The ``datasets`` object of a ``save_to_disk`` source (memory-mapped Arrow files, nothing loaded)."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            "reading a datasets.save_to_disk folder needs the `datasets` library: pip install 'comera_lightning[hf]'"
        ) from err
    loaded = datasets.load_from_disk(str(source.path))
    return loaded[source.split] if source.split is not None else loaded


def _dataset_pieces(source: TextSource, text_field: str, piece_bytes: int) -> Iterator[Piece]:
    dataset = load_saved_dataset(source)
    if text_field not in dataset.column_names:
        raise _field_error(source, f"(split {source.split or 'of the Dataset'})", text_field, dataset.column_names)
    row = 0
    for batch in dataset.select_columns([text_field]).iter(batch_size=1024):
        for text in batch[text_field]:
            if isinstance(text, str) and text:
                yield from _long_document(text, f"{source.name}:{row}", piece_bytes)
            row += 1
