"""`metrics.jsonl`: one JSON object per logged training step (schema `MetricsRecord`,
`metrics_version`; METRICS.md), and its one reader in two modes.

- strict (`read_metrics`, `parse_metrics_text`): the trainer's own runs. Every line must be a
  valid record of this major version; the first that is not raises `MetricsFormatError` (or
  `MetricsVersionError`, naming both versions) with the file and line number.
- tolerant (`scan_metrics_lines`): for displays (the relay's dashboard, `colibri status`) that
  read a file someone else's trainer may still be appending to. It never raises on content: a
  last line without its newline is noted as incomplete, a line that is not a JSON object or of
  another major version is skipped and reported, and a line with no `metrics_version` is kept
  as a generic record (relays whose payload is not a Colibri model need not carry one). It
  hands back the JSON objects, not records, so a display can plot fields this schema lacks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import MetricsFormatError, MetricsVersionError, VersionMismatchError
from .versions import require_major

METRICS_FILE = "metrics.jsonl"
METRICS_VERSION = "1.0"


class RouterLayerMetrics(BaseModel):
    """One MoE layer's routing statistics at one step."""

    model_config = ConfigDict(extra="forbid")
    layer: int
    max_vio: float
    dead_experts: int
    load_entropy: float
    load: list[float]

    @classmethod
    def from_stats(cls, s) -> RouterLayerMetrics:
        """From colibri-model's `RouterStats` (or anything with its fields), rounded as logged."""
        return cls(layer=s.layer, max_vio=round(s.max_vio, 5), dead_experts=s.dead_experts,
                   load_entropy=round(s.load_entropy, 5), load=s.load)


class MetricsRecord(BaseModel):
    """One line of metrics.jsonl (METRICS.md lists the fields)."""

    model_config = ConfigDict(extra="forbid")
    metrics_version: str = METRICS_VERSION
    step: int  # optimizer steps completed
    time: float  # unix seconds
    kind: str = "pretrain"
    loss: float | None  # mean LM cross-entropy over the global batch (None when skipped)
    aux_loss: float | None = None
    lr: float
    phase: str
    grad_norm: float | None
    tokens_seen: int
    tokens_per_s: float
    mfu: float | None
    skipped: bool = False
    skip_reason: str | None = None
    val_loss: float | None = None  # at top_k_train, on the fixed validation batches
    val_loss_infer: float | None = None  # at top_k_infer (serving), when measured
    router: list[RouterLayerMetrics] = []


@dataclass
class MetricsLine:
    """One JSON object of a metrics file and its 1-based line number."""

    lineno: int
    data: dict


@dataclass
class ScannedMetrics:
    """What `scan_metrics_lines` could read, and what it could not and why."""

    lines: list[MetricsLine] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    incomplete_tail: bool = False


def _check_version(data: dict, where: str, reader: str) -> None:
    require_major(data.get("metrics_version"), METRICS_VERSION, key="metrics_version", where=where,
                  reader=reader, error=MetricsVersionError)


def scan_metrics_lines(text: str, where: str, *, first_lineno: int = 1, reader: str = "colibri-spec",
                       max_problems: int = 20) -> ScannedMetrics:
    """The tolerant mode (module docstring): every complete line that is a JSON object of this
    major version (or of none). `where` names the file in each problem, `first_lineno`
    continues the numbering of an earlier chunk, `reader` names the reader in a version problem;
    after `max_problems` one line says more were not shown."""
    lines = text.split("\n")
    scanned = ScannedMetrics(incomplete_tail=bool(lines) and lines[-1] != "")
    if scanned.incomplete_tail:
        lines = lines[:-1]  # the writer has not finished this line yet

    def report(message: str) -> None:
        if len(scanned.problems) < max_problems:
            scanned.problems.append(message)
        elif len(scanned.problems) == max_problems:
            scanned.problems.append(f"{where}: more problems not shown")

    for lineno, line in enumerate(lines, first_lineno):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            report(f"{where} line {lineno}: not valid JSON ({exc.msg}); skipped")
            continue
        if not isinstance(data, dict):
            report(f"{where} line {lineno}: not a JSON object; skipped")
            continue
        if data.get("metrics_version") is not None:
            try:
                _check_version(data, f"{where} line {lineno}", reader)
            except VersionMismatchError as exc:
                report(f"{exc}; skipped")
                continue
        scanned.lines.append(MetricsLine(lineno, data))
    return scanned


def parse_metrics_text(text: str, where: str) -> list[MetricsRecord]:
    """The strict mode (module docstring) over the text of a metrics file; blank lines are skipped."""
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        at = f"{where}:{lineno}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MetricsFormatError(f"{at}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, dict):
            raise MetricsFormatError(f"{at}: expected a JSON object")
        _check_version(data, at, "colibri-spec")
        try:
            records.append(MetricsRecord.model_validate(data))
        except ValidationError as exc:
            raise MetricsFormatError(f"{at}: invalid metrics record: {' '.join(str(exc).splitlines()[:3])}") from None
    return records


def read_metrics(run_dir: str | os.PathLike) -> list[MetricsRecord]:
    """The records of a run directory's metrics.jsonl, strictly (module docstring)."""
    path = Path(run_dir) / METRICS_FILE
    return parse_metrics_text(path.read_text(), str(path))
