"""Routing trace files (spec: ROUTING_TRACE.md): write the engine's trace, read anyone's.

A trace on disk lets a cache policy be studied without the model that produced it: ours
(`colibri-stream generate --trace-out`) or another runtime's, dumped with a router hook. The
reader validates everything a replay relies on (steps in order, distinct experts in range, a
layer once per step) and names the file and line of the first problem, so a malformed dump
fails loudly rather than skewing hit rates. Version 1.1 adds an optional `request` per event;
1.0 files (no requests) read as before, and a 1.0 reader reads 1.1 files, ignoring requests.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from colibri_spec import require_major

from ..errors import TraceFormatError, TraceVersionError
from .events import TraceEvent

TRACE_FORMAT = "colibri-routing-trace"
TRACE_VERSION = "1.1"


@dataclass(frozen=True)
class TraceHeader:
    n_moe_layers: int
    n_experts: int
    top_k: int
    model: str = ""
    source: str = ""
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as read
    version: str = TRACE_VERSION  # as read from the file

    @property
    def has_requests(self) -> bool:
        """Whether events may carry `request` (version 1.1 on; a 1.0 file's unknown keys are ignored)."""
        minor = self.version.split(".")[1] if "." in self.version else "0"
        return not minor.isdigit() or int(minor) >= 1

    @property
    def total_experts(self) -> int:
        return self.n_moe_layers * self.n_experts


@dataclass(frozen=True)
class RoutingTrace:
    header: TraceHeader
    events: list[TraceEvent]

    @property
    def requests(self) -> list[int]:
        """The distinct requests of the events, in order of first appearance ([] when the
        trace carries none)."""
        return list(dict.fromkeys(e.request for e in self.events if e.request is not None))

    def split(self, fraction: float = 0.5) -> tuple[list[TraceEvent], list[TraceEvent]]:
        """(first part, rest). A trace of two requests or more is cut between requests: the first
        `fraction` of them (in order of first appearance, at least one each side) against the
        rest, so no request is half tuning and half held out. Otherwise the cut is at a step
        boundary near `fraction` of the steps."""
        requests = self.requests
        if len(requests) > 1:
            first_requests = set(requests[:min(len(requests) - 1, max(1, round(fraction * len(requests))))])
            first = [e for e in self.events if e.request in first_requests]
            return first, [e for e in self.events if e.request not in first_requests]
        steps = sorted({e.step for e in self.events})
        cut = steps[min(len(steps) - 1, max(1, round(fraction * len(steps))))] if len(steps) > 1 else None
        first = [e for e in self.events if cut is None or e.step < cut]
        return first, [e for e in self.events if cut is not None and e.step >= cut]


def _open_text(path: Path, mode: str) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8", newline="\n")
    return open(path, mode, encoding="utf-8", newline="\n")


def write_trace(path: str | os.PathLike, events: Iterable[TraceEvent], *, n_moe_layers: int, n_experts: int,
                top_k: int, model: str = "", source: str = "") -> Path:
    """Write `events` as a routing trace file, atomically (a temporary file, then a rename)."""
    path = Path(path)
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "n_moe_layers": n_moe_layers,
              "n_experts": n_experts, "top_k": top_k}
    if model:
        header["model"] = model
    if source:
        header["source"] = source
    tmp = path.with_name(path.name + ".tmp" + (".gz" if path.name.endswith(".gz") else ""))
    try:
        with _open_text(tmp, "w") as f:
            f.write(json.dumps(header) + "\n")
            for e in events:
                line = {"step": e.step, "layer": e.layer, "experts": list(e.experts)}
                if e.request is not None:
                    line["request"] = e.request
                f.write(json.dumps(line) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _int(obj: dict, key: str, where: str, minimum: int) -> int:
    value = obj.get(key)
    # bool is an int subclass in Python; true/false are not layer or expert numbers
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceFormatError(f"{where}: {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceFormatError(f"{where}: {key!r} must be >= {minimum}, got {value}")
    return value


def _header(line: str, where: str) -> TraceHeader:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: header is not JSON ({exc.msg})") from None
    if not isinstance(obj, dict) or obj.get("format") != TRACE_FORMAT:
        raise TraceFormatError(f"{where}: not a routing trace (the header's 'format' must be {TRACE_FORMAT!r})")
    version = obj.get("version")
    if not isinstance(version, str):
        raise TraceFormatError(f"{where}: version {version!r} is not a version string like {TRACE_VERSION!r}")
    require_major(version, TRACE_VERSION, key="version", where=where, reader="colibri-stream",
                  error=TraceVersionError)
    known = {"format", "version", "n_moe_layers", "n_experts", "top_k", "model", "source"}
    if _int(obj, "top_k", where, 1) > _int(obj, "n_experts", where, 1):
        raise TraceFormatError(f"{where}: top_k ({obj['top_k']}) exceeds n_experts ({obj['n_experts']})")
    return TraceHeader(
        n_moe_layers=_int(obj, "n_moe_layers", where, 1),
        n_experts=_int(obj, "n_experts", where, 1),
        top_k=_int(obj, "top_k", where, 1),
        model=str(obj.get("model", "")),
        source=str(obj.get("source", "")),
        extra={k: v for k, v in obj.items() if k not in known},
        version=version,
    )


def read_trace(path: str | os.PathLike) -> RoutingTrace:
    """Read and validate a routing trace file; raises TraceFormatError naming path and line."""
    path = Path(path)
    try:
        handle = _open_text(path, "r")
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot open ({exc.strerror or exc})") from None
    events: list[TraceEvent] = []
    layers: set[int] = set()
    header = None
    step, step_layers = -1, set()
    step_request = has_requests = None  # the current step's request; whether events carry one
    try:
        with handle:
            for number, line in enumerate(handle, start=1):
                where = f"{path}:{number}"
                line = line.rstrip("\n")
                if not line.strip():
                    raise TraceFormatError(f"{where}: blank line")
                if header is None:
                    header = _header(line, where)
                    continue
                events.append(_event(line, where, header, step, step_layers))
                event = events[-1]
                if has_requests is None:
                    has_requests = event.request is not None
                elif has_requests != (event.request is not None):
                    raise TraceFormatError(f"{where}: 'request' must be on every event or on none "
                                           f"(this event {'has' if event.request is not None else 'lacks'} it, "
                                           f"the first event {'has' if has_requests else 'lacks'} it)")
                if event.step != step:
                    step, step_layers, step_request = event.step, set(), event.request
                elif event.request != step_request:
                    raise TraceFormatError(f"{where}: step {step} mixes requests {step_request} and "
                                           f"{event.request} (a step serves one request)")
                step_layers.add(event.layer)
                layers.add(event.layer)
                if len(layers) > header.n_moe_layers:
                    raise TraceFormatError(f"{where}: more distinct layers ({len(layers)}) than the header's "
                                           f"n_moe_layers ({header.n_moe_layers})")
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # gzip damage, bad bytes
        raise TraceFormatError(f"{path}: unreadable ({exc})") from None
    if header is None:
        raise TraceFormatError(f"{path}: empty file (no header)")
    if not events:
        raise TraceFormatError(f"{path}: no events after the header")
    return RoutingTrace(header, events)


def _event(line: str, where: str, header: TraceHeader, last_step: int, step_layers: set[int]) -> TraceEvent:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: an event must be a JSON object")
    step = _int(obj, "step", where, 0)
    layer = _int(obj, "layer", where, 0)
    if step < last_step:
        raise TraceFormatError(f"{where}: step {step} comes after step {last_step} (steps must not decrease)")
    if step == last_step and layer in step_layers:
        raise TraceFormatError(f"{where}: layer {layer} appears twice in step {step}")
    experts = obj.get("experts")
    if not isinstance(experts, list) or not experts:
        raise TraceFormatError(f"{where}: 'experts' must be a non-empty list")
    for expert in experts:
        if not isinstance(expert, int) or isinstance(expert, bool) or not 0 <= expert < header.n_experts:
            raise TraceFormatError(f"{where}: expert {expert!r} is not in [0, {header.n_experts})")
    if len(set(experts)) != len(experts):
        raise TraceFormatError(f"{where}: 'experts' repeats an expert ({experts})")
    request = _int(obj, "request", where, 0) if header.has_requests and "request" in obj else None
    return TraceEvent(step, layer, tuple(experts), request)
