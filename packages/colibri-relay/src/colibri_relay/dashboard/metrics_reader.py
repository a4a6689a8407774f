"""Tolerant reading of `metrics.jsonl` for display: what parses is shown, what does not is reported.

The dashboard reads metrics written by someone else's trainer, possibly while it is still writing,
so it reads them with colibri-spec's tolerant reader (`scan_metrics_lines`, METRICS.md), which
never raises on content: an incomplete last line, a line that is not a JSON object or one of an
unknown MAJOR `metrics_version` is skipped and reported (naming both versions); a line with no
`metrics_version` at all is read as a generic record (relays whose payload is not a Colibri model
need not carry one). Here, a record without `step` gets its line index as its x position
(reported once per file).

What is plotted: every top-level numeric field (bools excluded) becomes a series; `router` (a list
of per-layer dicts with `load`, `max_vio`, `dead_experts`, as colibri-model writes them) becomes the
MoE views. Trade-off: nested numbers other than `router` are ignored, to keep "generic" predictable.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from colibri_spec import METRICS_FILE, scan_metrics_lines

__all__ = ["METRICS_FILE", "MetricsPoint", "MetricsTail", "ParsedMetrics", "RouterLayer", "dedupe_by_step", "parse_metrics"]

# Numeric fields that are coordinates or bookkeeping, not series worth a chart.
NOT_SERIES = {"step", "time", "metrics_version"}


@dataclass
class RouterLayer:
    """One MoE layer's routing statistics at one step."""

    layer: int
    load: list[float]
    max_vio: float | None
    dead_experts: int | None


@dataclass
class MetricsPoint:
    """One parsed metrics line: its step, its numeric fields and its router stats."""

    step: float
    values: dict[str, float]
    router: list[RouterLayer] = field(default_factory=list)
    kind: str | None = None


@dataclass
class ParsedMetrics:
    """The readable part of one metrics file, plus what could not be read and why."""

    points: list[MetricsPoint]
    problems: list[str]
    incomplete_tail: bool = False


def _finite_number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _router_layers(raw: object) -> list[RouterLayer]:
    if not isinstance(raw, list):
        return []
    layers = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("load"), list):
            continue
        load = [_finite_number(v) for v in item["load"]]
        if not load or any(v is None for v in load):
            continue
        layer = item.get("layer", index)
        dead = item.get("dead_experts")
        layers.append(RouterLayer(
            layer=layer if isinstance(layer, int) else index,
            load=[float(v) for v in load],  # type: ignore[arg-type]
            max_vio=_finite_number(item.get("max_vio")),
            dead_experts=dead if isinstance(dead, int) and not isinstance(dead, bool) else None,
        ))
    return layers


def parse_metrics(raw: bytes, where: str, *, max_problems: int = 20, first_lineno: int = 1,
                  first_index: int = 0) -> ParsedMetrics:
    """Parse `raw` metrics.jsonl bytes; `where` names the file in every problem reported.
    `first_lineno` / `first_index` continue the line numbers and step-less indices of an earlier chunk."""
    scanned = scan_metrics_lines(raw.decode("utf-8", errors="replace"), where, first_lineno=first_lineno,
                                 reader="dashboard", max_problems=max_problems)
    points: list[MetricsPoint] = []
    problems = scanned.problems
    stepless = 0
    for line in scanned.lines:
        data = line.data
        step = _finite_number(data.get("step"))
        if step is None:
            stepless += 1
            step = float(first_index + len(points))
        values = {key: num for key, value in data.items()
                  if key not in NOT_SERIES and (num := _finite_number(value)) is not None}
        kind = data.get("kind") if isinstance(data.get("kind"), str) else None
        points.append(MetricsPoint(step=step, values=values, router=_router_layers(data.get("router")), kind=kind))
    if stepless and len(problems) < max_problems:
        problems.append(f"{where}: {stepless} line(s) have no numeric 'step'; their line order is used as the step")
    elif stepless and len(problems) == max_problems:
        problems.append(f"{where}: more problems not shown")
    return ParsedMetrics(points=dedupe_by_step(points), problems=problems, incomplete_tail=scanned.incomplete_tail)


def dedupe_by_step(points: list[MetricsPoint]) -> list[MetricsPoint]:
    """Sorted by step; a step logged twice (a resumed run re-logging it) keeps its last record."""
    by_step: dict[float, MetricsPoint] = {}
    for point in points:
        by_step[point.step] = point
    return [by_step[s] for s in sorted(by_step)]


class MetricsTail:
    """A growing metrics.jsonl (the live run), parsed incrementally: each `read()` parses only the
    complete lines appended since the previous one. A file that shrank or was replaced (a resumed
    trainer rewrites it atomically) is read again from the start. Raises OSError if unreadable."""

    def __init__(self, path: str | os.PathLike, where: str):
        self.path = path
        self.where = where
        self._reset(None)

    def _reset(self, ident: tuple[int, int] | None) -> None:
        self._ident = ident
        self._offset = 0
        self._lines = 0
        self._by_step: dict[float, MetricsPoint] = {}
        self._problems: list[str] = []

    def read(self) -> ParsedMetrics:
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            ident = (st.st_dev, st.st_ino)
            if ident != self._ident or st.st_size < self._offset:
                self._reset(ident)
            f.seek(self._offset)
            data = f.read()
        complete = data.rfind(b"\n") + 1  # parse whole lines only; the rest is still being written
        if complete:
            chunk = parse_metrics(data[:complete], self.where, first_lineno=self._lines + 1,
                                  first_index=len(self._by_step))
            self._lines += data[:complete].count(b"\n")
            self._offset += complete
            self._by_step.update((p.step, p) for p in chunk.points)
            self._problems = (self._problems + chunk.problems)[:21]
        points = [self._by_step[s] for s in sorted(self._by_step)]
        return ParsedMetrics(points=points, problems=list(self._problems), incomplete_tail=complete < len(data))
