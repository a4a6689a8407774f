"""Where documents come from: local text/JSONL/parquet files, or a Hugging Face dataset id.

Every input yields its documents in a fixed order, so `prepare` can resume by skipping the
documents it already consumed. Formats:

- `.txt` / `.md`: split at blank lines, consecutive paragraphs grouped into documents of at
  least `text_doc_chars` characters (a book is one long text; without this it would be one
  document and could not contribute to the held-out split). A BOM is dropped, CRLF -> LF.
- `.jsonl` / `.jsonl.gz`: one JSON object per line with a string field (`text`, FineWeb-Edu's
  shape). A bad line is an error naming file and line.
- `.parquet`: the `text` column, read in record batches with pyarrow.
- anything that is not a local path and looks like `owner/name`: a Hugging Face dataset streamed
  with `datasets` (needs network). FineWeb-Edu is the documented default:
  `HuggingFaceFW/fineweb-edu` with `--hf-config sample-10BT`.
"""

from __future__ import annotations

import gzip
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

from ..errors import DataSourceError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
DEFAULT_HF_DATASET = "HuggingFaceFW/fineweb-edu"
DEFAULT_HF_CONFIG = "sample-10BT"


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files stay, directories become their readable files (sorted, recursive), Hub ids stay."""
    out: list[str] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p))
            if not files:
                raise DataSourceError(f"{path}: directory holds no .txt, .jsonl or .parquet files")
            out.extend(str(p) for p in files)
        elif path.is_file():
            if _kind(path) is None:
                raise DataSourceError(f"{path}: unknown input type (use .txt, .md, .jsonl[.gz] or .parquet)")
            out.append(str(path))
        elif re.fullmatch(r"[\w.-]+/[\w.-]+", item) and not item.startswith("."):
            out.append(item)
        else:
            raise DataSourceError(f"{item}: no such file or directory (and not a Hub dataset id owner/name)")
    return out


def _text_documents(path: Path, doc_chars: int) -> Iterator[str]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataSourceError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    text = text.replace("\r\n", "\n")
    group: list[str] = []
    size = 0
    for paragraph in re.split(r"\n\s*\n", text):
        if not paragraph.strip():
            continue
        group.append(paragraph)
        size += len(paragraph)
        if size >= doc_chars:
            yield "\n\n".join(group)
            group, size = [], 0
    if group:
        yield "\n\n".join(group)


def jsonl_rows(path: Path) -> Iterator[tuple[int, str, object]]:
    """(line number, raw line, parsed JSON) of each non-empty line of a .jsonl[.gz] file; a line
    that is not JSON raises DataSourceError naming the file and line."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, line, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataSourceError(f"{path}:{number}: not valid JSON ({exc.msg})") from None


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    for number, _, row in jsonl_rows(path):
        value = row.get(field) if isinstance(row, dict) else None
        if not isinstance(value, str):
            raise DataSourceError(f"{path}:{number}: no string field {field!r}")
        yield value


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataSourceError(f"{path}: reading parquet needs pyarrow (pip install 'colibri-model[data]')") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise DataSourceError(f"{path}: unreadable parquet file ({exc})") from None
    if field not in table.schema_arrow.names:
        raise DataSourceError(f"{path}: no column {field!r} (columns: {', '.join(table.schema_arrow.names)})")
    for batch in table.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield value


def _hub_documents(dataset_id: str, field: str, config: str | None, split: str) -> Iterator[str]:
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataSourceError(f"{dataset_id}: Hub datasets need `datasets` (pip install 'colibri-model[data]')") from None
    try:
        stream = load_dataset(dataset_id, name=config, split=split, streaming=True)
    except Exception as exc:  # network and Hub errors come in many types
        raise DataSourceError(f"{dataset_id}: cannot open Hub dataset ({type(exc).__name__}: {exc})") from None
    for row in stream:
        yield row[field]


def iter_documents(
    source: str,
    *,
    text_field: str = "text",
    text_doc_chars: int = 4000,
    hf_config: str | None = None,
    hf_split: str = "train",
    skip: int = 0,
) -> Iterator[str]:
    """The documents of one expanded input, skipping the first `skip` (for resume)."""
    path = Path(source)
    kind = _kind(path) if path.is_file() else "hub"
    if kind == "text":
        docs = _text_documents(path, text_doc_chars)
    elif kind == "jsonl":
        docs = _jsonl_documents(path, text_field)
    elif kind == "parquet":
        docs = _parquet_documents(path, text_field)
    else:
        docs = _hub_documents(source, text_field, hf_config, hf_split)
    return itertools.islice(docs, skip, None)
