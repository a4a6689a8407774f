"""The ledger: append-only LEDGER.jsonl (one JSON object per pushed leg) and LEDGER.md rendered from it.

LEDGER.jsonl is the truth (machine-readable, read by dashboards); LEDGER.md is regenerated in full by
every push, so a hand edit of the .md never leaks back. Each push appends exactly one line whose
`leg` is the previous last leg + 1, in the same commit as the payload and RELAY.json.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import RelayFileCorrupt
from .relay_state import check_major

LEDGER_JSONL = "LEDGER.jsonl"
LEDGER_MD = "LEDGER.md"
LEDGER_VERSION = "1.0"


class LegSummary(BaseModel):
    """What a trainer reports for its leg (the relay adds who/when/leg/commit)."""

    model_config = ConfigDict(extra="allow")
    steps: int = Field(0, ge=0)
    tokens: int = Field(0, ge=0)
    loss_start: float | None = None
    loss_end: float | None = None
    hardware: str = ""
    notes: str = ""


class LedgerEntry(LegSummary):
    """One line of LEDGER.jsonl."""

    ledger_version: str = LEDGER_VERSION
    leg: int = Field(ge=1)
    holder: str
    lease_id: str
    epoch: int
    started_at: str
    finished_at: str
    hours: float = Field(ge=0)
    base_commit: str = Field(description="the commit the leg pulled its payload from")
    payload_files: int = 0
    payload_bytes: int = 0


def parse_numbered_lines(raw: bytes, where: str, model: type[BaseModel], version: str, number: str,
                         first: int) -> list:
    """JSON lines of `model` at `version`'s major, numbered by field `number` from `first` with no
    gap (a sequential run's legs, a parallel run's rounds); one error naming the line otherwise."""
    entries: list = []
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RelayFileCorrupt(f"{where}: not UTF-8 ({exc})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RelayFileCorrupt(f"{where} line {lineno}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise RelayFileCorrupt(f"{where} line {lineno}: expected a JSON object")
        check_major(data.get("ledger_version"), version, "ledger_version", f"{where} line {lineno}")
        try:
            entry = model.model_validate(data)
        except ValidationError as exc:
            first_error = exc.errors()[0]
            raise RelayFileCorrupt(f"{where} line {lineno}: field {'.'.join(map(str, first_error['loc']))!r}: "
                                   f"{first_error['msg']}") from None
        expected = getattr(entries[-1], number) + 1 if entries else first
        if getattr(entry, number) != expected:
            raise RelayFileCorrupt(f"{where} line {lineno}: {number} {getattr(entry, number)}, expected {expected}")
        entries.append(entry)
    return entries


def parse_ledger(raw: bytes, where: str) -> list[LedgerEntry]:
    return parse_numbered_lines(raw, where, LedgerEntry, LEDGER_VERSION, "leg", 1)


def append_entry(raw: bytes, entry: BaseModel) -> bytes:
    """`raw` (a JSON-lines ledger) with `entry` as one more line."""
    line = json.dumps(entry.model_dump(), sort_keys=True).encode() + b"\n"
    if raw and not raw.endswith(b"\n"):
        raw += b"\n"
    return raw + line


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def render_ledger_md(entries: list[LedgerEntry]) -> bytes:
    lines = [
        "# Relay ledger",
        "",
        "Generated from LEDGER.jsonl by colibri-relay on every push; do not edit by hand.",
        "Leg N's checkpoint is the commit tagged `leg-N`.",
        "",
        "| leg | holder | finished (UTC) | steps | tokens | hours | hardware | loss start | loss end | base commit |",
        "|---:|---|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for e in entries:
        lines.append(
            f"| {e.leg} | {e.holder} | {e.finished_at} | {e.steps} | {e.tokens} | {e.hours:.3f} | "
            f"{e.hardware} | {_fmt(e.loss_start)} | {_fmt(e.loss_end)} | {e.base_commit[:12]} |"
        )
    total_tokens = sum(e.tokens for e in entries)
    total_hours = sum(e.hours for e in entries)
    lines += ["", f"Total: {len(entries)} legs, {total_tokens} tokens, {total_hours:.3f} hours.", ""]
    return "\n".join(lines).encode()
