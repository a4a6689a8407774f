"""The companion repo of a parallel run: contributions, and the marker that closes a round.

Layout (ROUNDS.md):

    COMPANION.json                          {"contribution_version", "run_id", "relay"}
    rounds/000007/slot-0002/contribution.json   ContributionMeta: who, base, manifest, summary
    rounds/000007/slot-0002/<files>             the worker's files (opaque: e.g. an int8 delta)
    rounds/000007/CLOSED.json                   ClosedRound: the contributions the merge takes

Every write is one CAS commit whose parent is the head the writer just read, and whose tree it
checked first: a contribution lands only if its round has no CLOSED.json and its slot is empty;
the close lands only on the tree it lists. So once CLOSED.json is in, nothing more can land for
that round, and the close names exactly the contributions that did land: none is ever silently
dropped. A late worker is told (`RoundClosed`) and its contribution never lands. Retries of one
write keep its nonce, so a write whose reply was lost is found (in the tree, or in the history by
the store) instead of being written twice. A stale head read only costs a 412 and a re-read.

The close of round R also deletes round R-1's files, its CLOSED.json too (merged by then: main
shows round R only after R-1's merge): the tree, and every listing of it, stays O(workers); history
keeps them. Rounds close in order, so a contribution is refused when the tree holds the CLOSED.json
of its round OR OF ANY LATER ONE: a worker with a lagging view of an old round cannot land in it.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from .errors import (
    CasLost,
    CommitLockBusy,
    CommitNotVerified,
    FileNotFoundInStore,
    ModeMismatch,
    OutcomeUnknown,
    PathIgnored,
    PayloadError,
    RateLimited,
    RelayFileCorrupt,
    RoundClosed,
    SlotTaken,
    StoreError,
)
from .lease import log
from .payload import build_manifest, pull_payload, scan_payload, tree_problems
from .relay_state import PayloadFile, parse_versioned_object
from .store import DeleteFile, PutFile, RelayStore

COMPANION_FILE = "COMPANION.json"
CONTRIBUTION_FILE = "contribution.json"
CLOSED_FILE = "CLOSED.json"
CONTRIBUTION_VERSION = "1.0"
_SLOT_META = re.compile(r"^rounds/(\d{6})/slot-(\d{4})/contribution\.json$")
_CLOSED = re.compile(r"^rounds/(\d{6})/CLOSED\.json$")


def round_dir(round: int) -> str:
    return f"rounds/{round:06d}"


def slot_dir(round: int, slot: int) -> str:
    return f"{round_dir(round)}/slot-{slot:04d}"


class ContributionMeta(BaseModel):
    """`contribution.json`: one worker's contribution to one round."""

    model_config = ConfigDict(extra="allow")
    contribution_version: str = CONTRIBUTION_VERSION
    round: int = Field(ge=0)
    slot: int = Field(ge=0)
    worker: str
    nonce: str
    base_commit: str = Field(description="the main-repo commit the worker pulled its base from")
    base_digest: str = Field(description="payload_digest of that base (what the merger compares)")
    files: dict[str, PayloadFile]
    summary: dict = Field(default_factory=dict)
    posted_at: str = ""


class ClosedSlot(BaseModel):
    slot: int
    nonce: str = ""
    worker: str = ""
    problem: str = ""  # contribution.json itself did not parse: the merger rejects it as corrupt


class ClosedRound(BaseModel):
    """`CLOSED.json`: the contributions that landed before the round closed (all of them)."""

    model_config = ConfigDict(extra="allow")
    contribution_version: str = CONTRIBUTION_VERSION
    round: int
    closed_by: str
    nonce: str
    contributions: list[ClosedSlot]


@dataclass(frozen=True)
class Ack:
    """A contribution that landed: its commit in the companion repo. `verified` is False when the
    store reported the commit landed without all its files (the merger will reject it as corrupt)."""

    round: int
    slot: int
    nonce: str
    commit: str
    verified: bool = True


CompanionFile = TypeVar("CompanionFile", ContributionMeta, ClosedRound)


def parse_companion_file(model: type[CompanionFile], raw: bytes, where: str) -> CompanionFile:
    """`contribution.json` or `CLOSED.json` bytes as `model`; `where` goes into the errors (a major
    `contribution_version` other than ours is SchemaVersionError)."""
    return parse_versioned_object(raw, where, model, "contribution_version", CONTRIBUTION_VERSION)


def _dumps(model: BaseModel) -> bytes:
    return (json.dumps(model.model_dump(), indent=2, sort_keys=True) + "\n").encode()


class _Retry:
    """Pacing of one write's retries: 409 / 412 / unknown outcomes back off; a 429 waits what the
    server asked, or raises if that is past the deadline (nothing to gain from re-posting early)."""

    def __init__(self, timeout_s: float | None):
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.pause = 0.05

    def again(self, exc: Exception) -> None:
        now = time.monotonic()
        wait = exc.retry_after_s if isinstance(exc, RateLimited) else self.pause
        if self.deadline is not None and now + wait > self.deadline:
            raise exc
        time.sleep(wait)
        if not isinstance(exc, RateLimited):
            self.pause = min(self.pause * 2, 1.0)


def _commit_of(store: RelayStore, head: str, nonce: str) -> str:
    for rec in store.history(head):
        if rec.nonce == nonce:
            return rec.sha
    return head  # the tree at head holds it; the listing of its commit lagged


def init_companion(store: RelayStore, run_id: str, relay_spec: str) -> str:
    """Create the companion repo for `run_id` (idempotent); ModeMismatch if it belongs to another run."""
    head = store.create()
    retry = _Retry(120.0)
    while True:
        try:
            raw = store.read_file(COMPANION_FILE, head)
        except FileNotFoundInStore:
            raw = None
        if raw is not None:
            data = json.loads(raw)
            if data.get("run_id") != run_id:
                raise ModeMismatch(f"{store.spec} is the companion repo of run {data.get('run_id')}, not of run "
                                   f"{run_id}: give each run its own companion repo")
            return head
        body = {"contribution_version": CONTRIBUTION_VERSION, "run_id": run_id, "relay": relay_spec}
        nonce = secrets.token_hex(8)
        try:
            return store.commit([PutFile(COMPANION_FILE, json.dumps(body, indent=2).encode() + b"\n")], parent=head,
                                message="rounds: init companion", nonce=nonce)
        except (CasLost, CommitLockBusy, OutcomeUnknown, RateLimited) as exc:
            retry.again(exc)
            head = store.head()


def post_contribution(store: RelayStore, *, round: int, slot: int, worker: str, base_commit: str,
                      base_digest: str, src_dir: Path, summary: dict, timeout_s: float | None = 600.0) -> Ack:
    """Publish `src_dir` as the contribution of `slot` to `round`: ONE commit, landed at most once.

    Raises RoundClosed (late: nothing landed), SlotTaken (another worker holds the slot this round),
    PayloadError (unusable directory), RateLimited / StoreError past `timeout_s`."""
    files = scan_payload(Path(src_dir))
    manifest = build_manifest(files)
    nonce = secrets.token_hex(8)
    meta = ContributionMeta(round=round, slot=slot, worker=worker, nonce=nonce, base_commit=base_commit,
                            base_digest=base_digest, files=manifest, summary=summary,
                            posted_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    prefix = slot_dir(round, slot)
    puts = [PutFile(f"{prefix}/{rel}", path) for rel, path in files.items()]
    puts.append(PutFile(f"{prefix}/{CONTRIBUTION_FILE}", _dumps(meta)))
    try:
        store.prepare(puts)  # LFS blobs travel now, once, whatever the retries of the commit below
    except PathIgnored as exc:
        raise PayloadError(f"{exc}; rename the file(s) (nothing was posted)") from None
    retry = _Retry(timeout_s)
    mine = f"{prefix}/{CONTRIBUTION_FILE}"
    while True:
        try:
            head = store.head()
            tree = store.list_files(head)
            if mine in tree:
                theirs = parse_companion_file(ContributionMeta, store.read_file(mine, head), f"{store.spec}@{head[:12]} {mine}")
                if theirs.nonce == nonce:  # an earlier attempt landed after all
                    ok = not tree_problems(store, head, {f"{prefix}/{rel}": m for rel, m in manifest.items()}, tree)
                    return Ack(round, slot, nonce, _commit_of(store, head, nonce), verified=ok)
                raise SlotTaken(f"{store.spec}: slot {slot} of round {round} already holds the contribution of "
                                f"{theirs.worker}; give each worker its own --slot (0..workers-1)", theirs.worker)
            newest = newest_closed(tree)
            if newest is not None and newest >= round:
                raise RoundClosed(f"{store.spec}: round {round} closed before this contribution landed (late; "
                                  f"rounds up to {newest} are closed): train the next round from the new base", round)
            sha = store.commit(puts, parent=head, message=f"rounds: contribution round {round} slot {slot} by {worker}",
                               nonce=nonce)
        except CommitNotVerified as exc:
            # Landed without a file. Without its contribution.json the slot still reads empty and
            # the next pass posts again; with it, the next pass acknowledges an unverified
            # contribution, which the merger records as rejected (corrupt).
            log.warning("contribution %s landed without all its files: %s", nonce, "; ".join(exc.problems[:2]))
            retry.again(exc)
            continue
        except StoreError as exc:  # 409 / 412 / 429 / unknown outcomes / failed reads: read again
            retry.again(exc)
            continue
        return Ack(round, slot, nonce, sha)


def newest_closed(tree) -> int | None:
    """The newest round with a CLOSED.json in `tree`. Rounds close in order and a close deletes the
    previous round's files (its marker too), so every round up to this one is closed."""
    return max((int(m.group(1)) for p in tree if (m := _CLOSED.match(p))), default=None)


def read_slots(store: RelayStore, round: int, revision: str) -> tuple[list[int], bool, dict]:
    """(slots holding a contribution to `round`, whether the round is closed, the tree) at `revision`."""
    tree = store.list_files(revision)
    slots = sorted(int(m.group(2)) for p in tree if (m := _SLOT_META.match(p)) and int(m.group(1)) == round)
    return slots, f"{round_dir(round)}/{CLOSED_FILE}" in tree, tree


def close_round(store: RelayStore, round: int, closed_by: str, *, timeout_s: float | None = 600.0
                ) -> tuple[ClosedRound, str]:
    """Close `round` (or read the close that already landed): returns (CLOSED.json, its commit)."""
    retry = _Retry(timeout_s)
    path = f"{round_dir(round)}/{CLOSED_FILE}"
    while True:
        try:
            head = store.head()
            slots, is_closed, tree = read_slots(store, round, head)
            if is_closed:
                closed = parse_companion_file(ClosedRound, store.read_file(path, head), f"{store.spec}@{head[:12]} {path}")
                return closed, _commit_of(store, head, closed.nonce)
            entries = []
            for slot in slots:
                where = f"{slot_dir(round, slot)}/{CONTRIBUTION_FILE}"
                try:
                    meta = parse_companion_file(ContributionMeta, store.read_file(where, head), f"{store.spec}@{head[:12]} {where}")
                    entries.append(ClosedSlot(slot=slot, nonce=meta.nonce, worker=meta.worker))
                except RelayFileCorrupt as exc:  # it landed: the close names it, the merger rejects it
                    entries.append(ClosedSlot(slot=slot, problem=str(exc)))
            closed = ClosedRound(round=round, closed_by=closed_by, nonce=secrets.token_hex(8), contributions=entries)
            old = [DeleteFile(p) for p in tree if round > 0 and p.startswith(round_dir(round - 1) + "/")]
            sha = store.commit([PutFile(path, _dumps(closed)), *old], parent=head,
                               message=f"rounds: close round {round} by {closed_by} ({len(entries)} contributions)",
                               nonce=closed.nonce)
            return closed, sha
        except CommitNotVerified as exc:
            log.warning("the close of round %d landed unverified (%s); reading it back", round, exc)
        except StoreError as exc:  # 409 / 412 / 429 / unknown outcomes / failed reads: read again
            retry.again(exc)


def fetch_contribution(store: RelayStore, close_commit: str, round: int, slot: int, dest: Path
                       ) -> tuple[ContributionMeta, Path]:
    """Download one closed contribution, verified against its own manifest, into `dest`. Raises
    RelayFileCorrupt / ChecksumMismatch / FileNotFoundInStore when it does not verify (corrupt)."""
    prefix = slot_dir(round, slot)
    where = f"{store.spec}@{close_commit[:12]} {prefix}/{CONTRIBUTION_FILE}"
    meta = parse_companion_file(ContributionMeta, store.read_file(f"{prefix}/{CONTRIBUTION_FILE}", close_commit), where)
    if (meta.round, meta.slot) != (round, slot):
        raise RelayFileCorrupt(f"{where}: says round {meta.round} slot {meta.slot}")
    manifest = {f"{prefix}/{rel}": m for rel, m in meta.files.items()}
    problems = tree_problems(store, close_commit, manifest)
    if problems:
        raise RelayFileCorrupt(f"{where}: the tree does not hold its files: {'; '.join(problems[:3])}")
    pull_payload(store, close_commit, manifest, Path(dest))
    return meta, Path(dest) / prefix


__all__ = ["Ack", "ClosedRound", "ClosedSlot", "ContributionMeta", "close_round", "fetch_contribution",
           "init_companion", "parse_companion_file", "post_contribution", "read_slots", "round_dir", "slot_dir"]
