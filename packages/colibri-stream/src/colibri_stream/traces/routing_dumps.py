"""Routing dumps of other runtimes, imported as colibri routing traces (ROUTING_TRACE.md).

Three shapes, as router hooks and patched runtimes write them (`colibri-stream trace-import`):

- `jsonl`: one JSON object per token and layer, as vLLM / SGLang forward hooks dump them:
  `{"request": 0, "token": 12, "layer": 3, "topk_ids": [5, 9]}`. Keys: "token" | "token_idx" |
  "step", "layer" | "layer_id", "topk_ids" | "experts" | "expert_ids" (a list of ids, or a list
  of such lists, one per token of a chunk), optional "request" | "request_id" (int or string).
- `llama-cpp`: log lines `route <step> <layer> <e1> <e2> ...`; every other line is ignored, so
  the dump may be a log mixed with other output.
- `csv`: a header naming a step column (step | token | token_idx), a layer column (layer |
  layer_id) and either one expert per row (expert | expert_id) or a list column (topk_ids |
  experts | expert_ids, ids separated by ";", spaces or quoted commas), optional request column.

How a dump becomes steps (the trace's forward passes, what the cache sees in order):

- Each distinct (request, token index) is one step. A request's steps follow its token
  indices; requests that a server batched side by side interleave as their tokens first appear
  in the dump, so they are replayed one token after another, in the order the server ran them.
  Steps are numbered 0, 1, ... in that order.
- Records with the same (request, token index, layer) belong to one forward pass: a hook that
  numbers passes ("step") writes one record per token of a prefill chunk under one index. Their
  experts are merged, in order of first appearance (the union a batched pass asks the cache
  for, as colibri's own prefill does). So a prefill dumped token by token with its positions
  becomes one step per token (decode-shaped), and dumped under one pass number, one step.
- Records may come token-major or layer-major; within one request and layer the index must not
  go back (that is how two runs glued together without request ids show). A llama.cpp log is
  in time order: its step must not decrease at all.
- Layers are kept as numbered (vLLM, SGLang and llama.cpp number the model's blocks, which is
  what the trace wants); `layer_offset` fixes a hook that counted MoE layers from 0 instead.
- Requests: integer ids are kept; string ids (vLLM's "cmpl-...") are numbered 0, 1, ... in
  order of first appearance. Either every record names a request or none does.

Not given, n_moe_layers is the number of distinct layers, n_experts the largest id + 1 and top_k
the most common number of experts per token selection; `ImportedDump.notes` says which were
inferred (the CLI writes that into the trace's `source`). A malformed record raises one
DumpFormatError naming the file, the line and what is wrong.
"""

from __future__ import annotations

import csv
import gzip
import heapq
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..errors import DumpFormatError
from .events import TraceEvent

FORMATS = ("jsonl", "llama-cpp", "csv")
TOKEN_KEYS = ("token", "token_idx", "step")
LAYER_KEYS = ("layer", "layer_id")
EXPERTS_KEYS = ("topk_ids", "experts", "expert_ids")
EXPERT_KEYS = ("expert", "expert_id")  # csv: one expert per row
REQUEST_KEYS = ("request", "request_id")
_LIST_SEPARATORS = re.compile(r"[;,\s]+")


@dataclass(frozen=True)
class ImportedDump:
    """A dump's events (ROUTING_TRACE.md order) and the trace shape, given or inferred."""

    events: list[TraceEvent]
    n_moe_layers: int
    n_experts: int
    top_k: int
    format: str
    notes: list[str] = field(default_factory=list)  # what was inferred, for the trace's source

    @property
    def steps(self) -> int:
        return self.events[-1].step + 1 if self.events else 0

    @property
    def requests(self) -> int:
        return len({e.request for e in self.events if e.request is not None})


@dataclass
class _Record:
    """One record of a dump: the token selections (one tuple each) of a (request, index, layer)."""

    where: str
    request: int | str | None
    index: int
    layer: int
    selections: list[tuple[int, ...]]


def _open(path: Path) -> IO[str]:
    # errors="replace": a log's odd bytes must not stop an import; malformed records still fail
    try:
        if path.name.endswith(".gz"):
            return gzip.open(path, "rt", encoding="utf-8", errors="replace")
        return open(path, encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DumpFormatError(f"{path}: cannot open ({exc.strerror or exc})") from None


def _natural(value, what: str, where: str) -> int:
    # bool is an int subclass in Python; true/false are not layer or expert numbers
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DumpFormatError(f"{where}: {what} must be an integer, got {value!r}")
    if value < 0:
        raise DumpFormatError(f"{where}: {what} must be >= 0, got {value}")
    return value


def _expert(value, where: str, n_experts: int | None) -> int:
    expert = _natural(value, "an expert id", where)
    if n_experts is not None and expert >= n_experts:
        raise DumpFormatError(f"{where}: expert {expert} is not in [0, {n_experts})")
    return expert


def _selection(ids: Iterable, where: str, n_experts: int | None) -> tuple[int, ...]:
    experts = tuple(_expert(e, where, n_experts) for e in ids)
    if not experts:
        raise DumpFormatError(f"{where}: no experts")
    if len(set(experts)) != len(experts):
        raise DumpFormatError(f"{where}: a token's experts repeat an expert ({list(experts)})")
    return experts


def _one_of(names: Iterable[str], keys: tuple[str, ...], where: str, what: str, required: bool = True):
    found = [k for k in keys if k in names]
    if len(found) > 1:
        raise DumpFormatError(f"{where}: both {found[0]!r} and {found[1]!r} given: which is the {what}?")
    if not found and required:
        raise DumpFormatError(f"{where}: no {what} (one of {', '.join(map(repr, keys))})")
    return found[0] if found else None


def _request(value, where: str):
    if isinstance(value, str) and not value.strip().isdigit():
        if not value.strip():
            raise DumpFormatError(f"{where}: empty request id")
        return value.strip()
    return _natural(value, "the request id", where)


# --- the three shapes ------------------------------------------------------------------------


def _jsonl_records(lines: Iterable[str], path: Path, n_experts: int | None) -> Iterator[_Record]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DumpFormatError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise DumpFormatError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
        index = _natural(obj[_one_of(obj, TOKEN_KEYS, where, "token index")], "the token index", where)
        layer = _natural(obj[_one_of(obj, LAYER_KEYS, where, "layer")], "the layer", where)
        ids = obj[_one_of(obj, EXPERTS_KEYS, where, "expert list")]
        if not isinstance(ids, list) or not ids:
            raise DumpFormatError(f"{where}: the expert list must be a non-empty list, got {ids!r}")
        chunk = ids if all(isinstance(e, list) for e in ids) else [ids]  # a chunk: one list per token
        request_key = _one_of(obj, REQUEST_KEYS, where, "request", required=False)
        request = _request(obj[request_key], where) if request_key else None
        yield _Record(where, request, index, layer, [_selection(s, where, n_experts) for s in chunk])


def _llama_records(lines: Iterable[str], path: Path, n_experts: int | None) -> Iterator[_Record]:
    for number, line in enumerate(lines, start=1):
        parts = line.split()
        if not parts or parts[0] != "route":
            continue
        where = f"{path}:{number}"
        if len(parts) < 4:
            raise DumpFormatError(f"{where}: a route line is 'route <step> <layer> <expert> ...', got {line.strip()!r}")
        step, layer = _natural(parts[1], "the step", where), _natural(parts[2], "the layer", where)
        yield _Record(where, None, step, layer, [_selection(parts[3:], where, n_experts)])


def _csv_records(lines: Iterable[str], path: Path, n_experts: int | None) -> Iterator[_Record]:
    lines = iter(lines)
    head = next(lines, "")
    dialect = "excel-tab" if "\t" in head and "," not in head else "excel"
    rows = csv.reader(_chain(head, lines), dialect)
    names = [n.strip().lower() for n in next(rows, [])]
    where = f"{path}:1"
    token_col = names.index(_one_of(names, TOKEN_KEYS, where, "token index column"))
    layer_col = names.index(_one_of(names, LAYER_KEYS, where, "layer column"))
    list_key = _one_of(names, EXPERTS_KEYS, where, "expert list column", required=False)
    single_key = _one_of(names, EXPERT_KEYS, where, "expert column", required=list_key is None)
    if list_key and single_key:
        raise DumpFormatError(f"{where}: both an expert list column {list_key!r} and a one-expert column "
                              f"{single_key!r}: keep one")
    experts_col = names.index(list_key or single_key)
    request_key = _one_of(names, REQUEST_KEYS, where, "request column", required=False)
    request_col = names.index(request_key) if request_key else None
    pending: _Record | None = None  # one-expert rows of one token, gathered
    for row in rows:
        where = f"{path}:{rows.line_num}"
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(names):
            raise DumpFormatError(f"{where}: {len(row)} fields, the header has {len(names)}")
        request = _request(row[request_col], where) if request_col is not None else None
        index = _natural(row[token_col].strip(), "the token index", where)
        layer = _natural(row[layer_col].strip(), "the layer", where)
        cell = row[experts_col].strip().strip("[]()")
        if list_key:
            yield _Record(where, request, index, layer, [_selection([i for i in _LIST_SEPARATORS.split(cell) if i], where, n_experts)])
            continue
        expert = _expert(cell, where, n_experts)
        same = pending is not None and (pending.request, pending.index, pending.layer) == (request, index, layer)
        if same and expert not in pending.selections[-1]:
            pending.selections[-1] += (expert,)
            continue
        if same:  # the expert again under one index: the next token of the same pass
            pending.selections.append((expert,))
            continue
        if pending is not None:
            yield pending
        pending = _Record(where, request, index, layer, [(expert,)])
    if pending is not None:
        yield pending


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


_PARSERS = {"jsonl": _jsonl_records, "llama-cpp": _llama_records, "csv": _csv_records}


# --- detection and assembly ------------------------------------------------------------------


def detect_format(path: str | os.PathLike) -> str:
    """The dump's shape from its content: "jsonl" (the first line is a JSON object), "csv" (the
    first line is a header with a layer column) or "llama-cpp" (some line starts with 'route')."""
    path = Path(path)
    try:
        return _detect(path)
    except (OSError, EOFError) as exc:  # a damaged gzip stream
        raise DumpFormatError(f"{path}: unreadable ({exc})") from None


def _detect(path: Path) -> str:
    with _open(path) as lines:
        first = next((line for line in lines if line.strip()), None)
        if first is None:
            raise DumpFormatError(f"{path}: empty file")
        if first.lstrip().startswith("{"):
            try:
                header = json.loads(first)
            except json.JSONDecodeError:
                return "jsonl"  # its parser names the line and what is wrong
            if isinstance(header, dict) and header.get("format") == "colibri-routing-trace":
                raise DumpFormatError(f"{path}: already a colibri routing trace: use it as it is")
            return "jsonl"
        names = {n.strip().lower() for n in re.split(r"[,\t]", first)}
        if names & set(LAYER_KEYS) and names & set(TOKEN_KEYS):
            return "csv"
        for line in _chain(first, lines):
            if line.split()[:1] == ["route"]:
                return "llama-cpp"
    raise DumpFormatError(f"{path}: cannot tell the dump's format (not JSON Lines, no CSV header naming a "
                          f"layer and a token column, no llama.cpp 'route' line): pass --format")


def import_dump(path: str | os.PathLike, format: str = "auto", *, n_experts: int | None = None,
                top_k: int | None = None, n_moe_layers: int | None = None, layer_offset: int = 0) -> ImportedDump:
    """Read a routing dump (`format`: one of FORMATS, or "auto") as routing trace events.

    >>> dump = import_dump("route.log", "llama-cpp", n_experts=8)   # doctest: +SKIP
    >>> write_trace("t.jsonl.gz", dump.events, n_moe_layers=dump.n_moe_layers,
    ...             n_experts=dump.n_experts, top_k=dump.top_k)    # doctest: +SKIP
    """
    path = Path(path)
    if format == "auto":
        format = detect_format(path)
    if format not in _PARSERS:
        raise DumpFormatError(f"unknown dump format {format!r} (one of {', '.join(FORMATS)}, auto)")
    if top_k is not None and n_experts is not None and top_k > n_experts:
        raise DumpFormatError(f"top_k ({top_k}) exceeds n_experts ({n_experts})")
    assembly = _Assembly(n_experts, n_moe_layers, layer_offset, ordered=format == "llama-cpp")
    try:
        with _open(path) as lines:
            for record in _PARSERS[format](lines, path, n_experts):
                assembly.add(record)
    except (OSError, EOFError) as exc:  # a damaged gzip stream
        raise DumpFormatError(f"{path}: unreadable ({exc})") from None
    if not assembly.passes:
        what = "no 'route <step> <layer> <expert> ...' line" if format == "llama-cpp" else "no records"
        raise DumpFormatError(f"{path}: {what}")
    return assembly.result(format, top_k)


class _Assembly:
    """Records in, events out: one pass per (request, index), one union per layer and pass."""

    def __init__(self, n_experts: int | None, n_moe_layers: int | None, layer_offset: int, ordered: bool):
        self.n_experts, self.n_moe_layers = n_experts, n_moe_layers
        self.layer_offset, self.ordered = layer_offset, ordered
        self.pass_of: dict[tuple, int] = {}  # (request, index) -> pass, numbered by first appearance
        self.passes: list[tuple[int | None, int, dict[int, dict[int, None]]]] = []  # request, index, layer -> experts
        self.last_index: dict[tuple, int] = {}  # (request, layer) -> the last index seen
        self.request_numbers: dict[str, int] = {}
        self.layers_seen: set[int] = set()
        self.first: _Record | None = None
        self.selection_sizes: Counter[int] = Counter()
        self.max_expert = -1

    def add(self, r: _Record) -> None:
        if self.first is None:
            self.first = r
        elif (self.first.request is None) != (r.request is None):
            has = "names a request" if r.request is not None else "names no request"
            raise DumpFormatError(f"{r.where}: this record {has}, unlike the first ({self.first.where}): "
                                  f"either every record names its request or none does")
        elif isinstance(self.first.request, str) != isinstance(r.request, str):
            raise DumpFormatError(f"{r.where}: request id {r.request!r} mixes integer and string request ids")
        request = self.request_numbers.setdefault(r.request, len(self.request_numbers)) \
            if isinstance(r.request, str) else r.request
        layer = r.layer + self.layer_offset
        if layer < 0:
            raise DumpFormatError(f"{r.where}: layer {r.layer} + offset {self.layer_offset} is negative")
        order_key = None if self.ordered else (request, layer)
        last = self.last_index.get(order_key, -1)
        if r.index < last:
            if self.ordered:
                raise DumpFormatError(f"{r.where}: step {r.index} comes after step {last} (steps must not decrease)")
            scope = f"request {r.request!r}" if request is not None else "the dump (no request ids: two runs in one file?)"
            raise DumpFormatError(f"{r.where}: token {r.index} comes after token {last} in layer {r.layer} of "
                                  f"{scope}: a layer's tokens must not go back")
        self.last_index[order_key] = r.index
        for selection in r.selections:  # ids were checked against n_experts where they were read
            self.max_expert = max(self.max_expert, max(selection))
            self.selection_sizes[len(selection)] += 1
        number = self.pass_of.setdefault((request, r.index), len(self.pass_of))
        if number == len(self.passes):
            self.passes.append((request, r.index, {}))
        layers = self.passes[number][2]
        if layer not in layers:
            self.layers_seen.add(layer)
            if self.n_moe_layers is not None and len(self.layers_seen) > self.n_moe_layers:
                raise DumpFormatError(f"{r.where}: more distinct layers ({len(self.layers_seen)}) than "
                                      f"n_moe_layers ({self.n_moe_layers})")
            layers[layer] = {}
        for selection in r.selections:
            layers[layer].update(dict.fromkeys(selection))  # an ordered union

    def result(self, format: str, top_k: int | None) -> ImportedDump:
        notes = []
        n_moe_layers, n_experts = self.n_moe_layers, self.n_experts
        if n_moe_layers is None:
            n_moe_layers = len(self.layers_seen)
            notes.append(f"n_moe_layers {n_moe_layers} inferred (distinct layers in the dump)")
        if n_experts is None:
            n_experts = self.max_expert + 1
            notes.append(f"n_experts {n_experts} inferred (largest expert id + 1; the model may have more)")
        if top_k is None:
            # the most common selection size (a prefill chunk's union is rarer); ties: the larger
            top_k = max(self.selection_sizes.items(), key=lambda item: (item[1], item[0]))[0]
            notes.append(f"top_k {top_k} inferred (most common experts per token)")
        events = [TraceEvent(step, layer, tuple(experts), request)
                  for step, (request, _, layers) in enumerate(self._in_time_order()) for layer, experts in layers.items()]
        return ImportedDump(events, n_moe_layers, n_experts, top_k, format, notes)

    def _in_time_order(self) -> Iterator[tuple]:
        """The passes, each request's by token index, requests merged by first appearance.

        NOTE: first appearance alone would misplace a token missing from a layer-major dump's
        first layer (it first shows up a whole layer later); within a request the index is the
        clock, and across requests the dump's order is the only one there is."""
        streams: dict = {}
        for number, (request, index, _) in enumerate(self.passes):
            streams.setdefault(request, []).append((index, number))
        queues = [sorted(stream, reverse=True) for stream in streams.values()]  # pop() takes the lowest index
        heads = [(queue[-1][1], k) for k, queue in enumerate(queues)]
        heapq.heapify(heads)
        while heads:
            _, k = heapq.heappop(heads)
            yield self.passes[queues[k].pop()[1]]
            if queues[k]:
                heapq.heappush(heads, (queues[k][-1][1], k))
