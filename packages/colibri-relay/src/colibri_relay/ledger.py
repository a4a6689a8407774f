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


def parse_ledger(raw: bytes, where: str) -> list[LedgerEntry]:
    entries: list[LedgerEntry] = []
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
        check_major(data.get("ledger_version"), LEDGER_VERSION, "ledger_version", f"{where} line {lineno}")
        try:
            entry = LedgerEntry.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise RelayFileCorrupt(f"{where} line {lineno}: field {'.'.join(map(str, first['loc']))!r}: "
                                   f"{first['msg']}") from None
        expected = entries[-1].leg + 1 if entries else 1
        if entry.leg != expected:
            raise RelayFileCorrupt(f"{where} line {lineno}: leg {entry.leg}, expected {expected}")
        entries.append(entry)
    return entries


def append_entry(raw: bytes, entry: LedgerEntry) -> bytes:
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
