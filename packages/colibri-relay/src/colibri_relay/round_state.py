"""The schemas of parallel rounds (spec: ROUNDS.md): RELAY.json's `rounds` section and the ledger's
round entries.

A run of parallel rounds is a relay whose RELAY.json says `relay_version` 2.x and carries
`rounds` (`RoundsConfig`): which round is being trained, how many worker slots, the inner steps,
the merger's deadline and the outer optimizer's settings. Its LEDGER.jsonl holds one `RoundEntry`
(`ledger_version` 2.x) per merged round: the base, every contribution merged (who, data slice,
inner steps, tokens, loss), every one rejected with its reason, and who merged it.

A 1.x reader meets both files with `SchemaVersionError` naming both versions; the sequential
ledger reader (`parse_ledger`) refuses round entries the same way.
"""

from __future__ import annotations

import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ModeMismatch, RelayFileCorrupt
from .ledger import append_entry, parse_numbered_lines
from .relay_state import RelayState, is_parallel

ROUND_LEDGER_VERSION = "2.0"
REJECT_REASONS = ("stale base", "corrupt", "failed check")


class RoundsConfig(BaseModel):
    """RELAY.json `rounds`: the run's round position and its fixed settings.

    Attributes:
        run_id: random at init; with (round, slot) it fixes each worker's data slice.
        companion: store spec of the companion repo that holds the contributions.
        round: the round being trained now; its base is the payload of the commit that says so.
        workers: worker slots 0..workers-1; the merger merges early once all have contributed.
        inner_steps: H, optimizer steps each worker trains per round.
        round_s: the merger's deadline, counted on its own clock from when it first sees the round.
        min_round_s: the merger never closes a round sooner (what the commit plan counts on).
        outer_lr, outer_momentum: the outer Nesterov SGD (DiLoCo's 0.7 / 0.9).
        staleness: "reject": a contribution trained on another base is never merged (ROUNDS.md).
    """

    model_config = ConfigDict(extra="allow")
    run_id: str = Field(default_factory=lambda: secrets.token_hex(8), pattern=r"^[0-9a-f]{8,64}$")
    companion: str
    round: int = Field(0, ge=0)
    workers: int = Field(ge=1, le=1024)
    inner_steps: int = Field(ge=1)
    round_s: float = Field(gt=0)
    min_round_s: float = Field(0.0, ge=0)
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    staleness: Literal["reject"] = "reject"


class ContributionRecord(BaseModel):
    """One merged contribution, as the ledger keeps it."""

    model_config = ConfigDict(extra="allow")
    slot: int = Field(ge=0)
    worker: str
    nonce: str
    base_commit: str
    data_slice: dict = Field(default_factory=dict)
    inner_steps: int = Field(0, ge=0)
    tokens: int = Field(0, ge=0)
    loss_start: float | None = None
    loss_end: float | None = None
    train_s: float = Field(0.0, ge=0)
    bytes: int = Field(0, ge=0)


class Rejection(BaseModel):
    """A contribution that landed but was not merged, and why."""

    model_config = ConfigDict(extra="allow")
    slot: int = Field(ge=0)
    worker: str = ""
    nonce: str = ""
    reason: Literal["stale base", "corrupt", "failed check"]
    detail: str = ""


class RoundEntry(BaseModel):
    """One line of a parallel run's LEDGER.jsonl: round `round` merged into the next base."""

    model_config = ConfigDict(extra="allow")
    ledger_version: str = ROUND_LEDGER_VERSION
    kind: Literal["round"] = "round"
    round: int = Field(ge=0)
    merger: str
    lease_id: str
    epoch: int
    base_commit: str = Field(description="a commit whose payload is this round's base")
    base_digest: str
    close_commit: str = Field(description="the companion commit that closed the round")
    contributions: list[ContributionRecord] = Field(default_factory=list)
    rejected: list[Rejection] = Field(default_factory=list)
    tokens: int = Field(0, ge=0)
    round_s: float = Field(0.0, ge=0, description="merger's clock: first sight of the round -> merge commit sent")
    utilisation: float | None = Field(None, description="mean worker training time / round_s")
    finished_at: str = ""
    stats: dict = Field(default_factory=dict, description="the merge function's report (e.g. MoE balance)")


def rounds_of(state: RelayState, where: str = "RELAY.json") -> RoundsConfig:
    """The `rounds` section of a 2.x RELAY.json; ModeMismatch for a sequential relay."""
    if not is_parallel(state):
        raise ModeMismatch(f"{where}: relay_version {state.relay_version} is a relay of sequential legs, not "
                           "parallel rounds: run `colibri train` without --parallel on it (a run cannot mix the two)")
    raw = (state.model_extra or {}).get("rounds")
    try:
        return RoundsConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise RelayFileCorrupt(f"{where}: field 'rounds.{'.'.join(map(str, first['loc']))}': {first['msg']}") from None


def with_rounds(state: RelayState, rounds: RoundsConfig) -> RelayState:
    """`state` with its `rounds` section replaced (no new seq/nonce: pass it through next_write)."""
    data = state.model_dump()
    data["rounds"] = rounds.model_dump()
    return RelayState.model_validate(data)


def parse_round_ledger(raw: bytes, where: str) -> list[RoundEntry]:
    """A parallel run's LEDGER.jsonl: round entries 0, 1, 2, ... with no gap."""
    return parse_numbered_lines(raw, where, RoundEntry, ROUND_LEDGER_VERSION, "round", 0)


append_round = append_entry  # one more round line, as a leg's


def render_round_ledger_md(entries: list[RoundEntry]) -> bytes:
    lines = [
        "# Relay ledger (parallel rounds)",
        "",
        "Generated from LEDGER.jsonl by colibri-relay on every merge; do not edit by hand.",
        "",
        "| round | merger | merged | rejected | tokens | round s | utilisation | base commit |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for e in entries:
        util = "" if e.utilisation is None else f"{e.utilisation:.0%}"
        lines.append(f"| {e.round} | {e.merger} | {len(e.contributions)} | {len(e.rejected)} | {e.tokens} | "
                     f"{e.round_s:.1f} | {util} | {e.base_commit[:12]} |")
    total = sum(e.tokens for e in entries)
    lines += ["", f"Total: {len(entries)} rounds, {total} tokens.", ""]
    return "\n".join(lines).encode()
