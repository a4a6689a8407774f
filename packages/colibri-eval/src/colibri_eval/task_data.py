"""Where task documents come from: local JSONL, the bundled 200-item samples, or the HF Hub.

Local files are named ``TASK.jsonl`` (one JSON object per line, HF field names, UTF-8) in a
directory given by ``--data-dir``; the keyword ``bundled`` selects the samples shipped in
``colibri_eval/data`` (first 200 items of each split; provenance in data/README.md). With no
data directory the documents come from the task's HF dataset id through ``datasets``, imported
only then (it needs the network or a warm HF cache).

Every row is validated before any model work starts, so a malformed line fails fast with a
one-line ``DataError`` naming the file and line, instead of after an hour of scoring.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibri_eval.errors import DataError
from colibri_eval.tasks import FieldError, Task, TaskItem, build_item

BUNDLED = "bundled"


def bundled_data_dir() -> Path:
    """Directory of the bundled 200-item samples (one ``TASK.jsonl`` per task)."""
    return Path(__file__).parent / "data"


@dataclass(frozen=True)
class Document:
    index: int  # position in the split (lm-eval's doc_id)
    doc: dict[str, Any]
    item: TaskItem


def read_jsonl(task: Task, path: Path, limit: int | None = None) -> list[Document]:
    """Read and validate ``path``; stop after ``limit`` documents (blank lines are skipped)."""
    if not path.is_file():
        raise DataError(str(path), None, f"no data file for task {task.name} (expected {path.name})")
    documents: list[Document] = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if limit is not None and len(documents) >= limit:
                break
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(str(path), line_no, f"malformed JSON ({exc.msg} at column {exc.colno})") from None
            try:
                item = build_item(task, doc)
            except FieldError as exc:
                raise DataError(str(path), line_no, str(exc)) from None
            documents.append(Document(len(documents), doc, item))
    return documents


def read_hf(task: Task, limit: int | None = None) -> list[Document]:
    """Load the task's split from the Hugging Face Hub (lazy ``datasets`` import)."""
    try:
        import datasets  # noqa: PLC0415 - optional dependency, only for online use
    except ImportError:
        raise DataError(task.hf_path, None, "HF dataset ids need datasets (not installed): "
                        "pip install 'colibri-eval[hub]', or pass --data-dir DIR or --data-dir bundled") from None
    split = task.hf_split if limit is None else f"{task.hf_split}[:{limit}]"
    try:
        rows = datasets.load_dataset(task.hf_path, task.hf_name, split=split)
    except Exception as exc:  # noqa: BLE001 - network/hub errors come in many types
        raise DataError(task.hf_path, None, f"could not load split {split!r}: {exc}".splitlines()[0]) from None
    documents = []
    for index, doc in enumerate(rows):
        try:
            documents.append(Document(index, dict(doc), build_item(task, dict(doc))))
        except FieldError as exc:
            raise DataError(f"{task.hf_path}[{task.hf_split}]", index, str(exc)) from None
    return documents


def load_documents(task: Task, data_dir: str | Path | None, limit: int | None = None) -> list[Document]:
    """Documents for ``task`` from ``data_dir`` (a path or ``"bundled"``) or, if None, the HF Hub."""
    if data_dir is None:
        return read_hf(task, limit)
    directory = bundled_data_dir() if str(data_dir) == BUNDLED else Path(data_dir)
    return read_jsonl(task, directory / f"{task.name}.jsonl", limit)
