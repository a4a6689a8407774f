"""`RoundRelay`: a relay of parallel rounds (ROUNDS.md) on top of the lease of `Relay`.

    relay = Relay("hf://me/run", holder="alice@box")
    rounds = RoundRelay(relay)
    view = rounds.view()                      # head, RELAY.json (2.x), round R, base digest
    rounds.pull_base(view, "base/")           # round R's base, verified
    ack = rounds.post(view, slot=0, src_dir="delta/", summary={...})   # one companion commit
    # the lease holder (the merger): close R, fetch, merge, ONE CAS commit on main:
    rounds.merge(leg, closed, entry, "new-base/")

The main repo holds the lease, the base (payload) and the ledger, exactly as for sequential legs;
only the merger writes it, always with parent = its own last commit (`Lease.write`), so two merges
of one round can never both land, and a deposed merger is fenced by its next write. Contributions
go to the companion repo (contribution.py), which never touches the lease's chain.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .claim import read_settled
from .contribution import Ack, ClosedRound, init_companion, post_contribution
from .errors import CommitNotVerified, FileNotFoundInStore, LeaseLost, ModeMismatch, PathIgnored, PayloadError
from .lease import log
from .ledger import LEDGER_JSONL, LEDGER_MD
from .payload import pull_payload, scan_payload, snapshot_payload, tree_problems
from .relay import Leg, Relay
from .relay_state import PARALLEL_RELAY_VERSION, PayloadFile, RelayState, is_parallel
from .round_state import (
    RoundEntry,
    RoundsConfig,
    append_round,
    parse_round_ledger,
    render_round_ledger_md,
    rounds_of,
    with_rounds,
)
from .store import DeleteFile, Operation, PutFile, RelayStore
from .stores import open_store

# Builds RELAY.json (and extra operations) of a payload commit from the current state.
PayloadWrite = Callable[[RelayState], tuple[RelayState, list[Operation]]]


def payload_digest(manifest: dict[str, PayloadFile]) -> str:
    """One sha256 over a payload manifest: what a contribution names as its base."""
    body = json.dumps({k: v.model_dump() for k, v in sorted(manifest.items())}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


@dataclass(frozen=True)
class RoundView:
    """The main repo at one commit: its RELAY.json and the round it is training."""

    head: str
    state: RelayState
    rounds: RoundsConfig

    @property
    def round(self) -> int:
        return self.rounds.round

    @property
    def base_digest(self) -> str:
        return payload_digest(self.state.payload)


class RoundRelay:
    """Parallel rounds on one `Relay` (main repo) and its companion repo."""

    def __init__(self, relay: Relay, *, token: str | None = None):
        self.relay = relay
        self._token = token
        self._companions: dict[str, RelayStore] = {}

    def companion(self, rounds: RoundsConfig) -> RelayStore:
        if rounds.companion not in self._companions:
            self._companions[rounds.companion] = open_store(rounds.companion, token=self._token)
        return self._companions[rounds.companion]

    # --- reads ---------------------------------------------------------------------------------
    def view(self) -> RoundView:
        """The head of the main repo as a round (head reads may lag: a lagging view is only older)."""
        head, state = read_settled(self.relay.store)
        return RoundView(head, state, rounds_of(state, f"{self.relay.store.spec}@{head[:12]} RELAY.json"))

    def lease_view(self, leg: Leg) -> RoundView:
        """The merger's own view: its last commit, never a lagging read."""
        lease = leg.lease
        return RoundView(lease.commit, lease.state, rounds_of(lease.state))

    def ledger(self, revision: str | None = None) -> list[RoundEntry]:
        store = self.relay.store
        rev = revision or store.head()
        try:
            raw = store.read_file(LEDGER_JSONL, rev)
        except FileNotFoundInStore:
            raw = b""
        return parse_round_ledger(raw, f"{store.spec}@{rev[:12]} {LEDGER_JSONL}")

    def pull_base(self, view: RoundView, dest: str | os.PathLike) -> dict[str, Path]:
        return pull_payload(self.relay.store, view.head, view.state.payload, Path(dest))

    # --- worker --------------------------------------------------------------------------------
    def post(self, view: RoundView, *, slot: int, worker: str, src_dir: str | os.PathLike, summary: dict,
             timeout_s: float | None = 600.0) -> Ack:
        """Publish a contribution to `view`'s round (contribution.post_contribution)."""
        if not 0 <= slot < view.rounds.workers:
            raise ModeMismatch(f"slot {slot} is outside this run's slots 0..{view.rounds.workers - 1}")
        return post_contribution(self.companion(view.rounds), round=view.round, slot=slot, worker=worker,
                                 base_commit=view.head, base_digest=view.base_digest, src_dir=Path(src_dir),
                                 summary=summary, timeout_s=timeout_s)

    # --- the lease holder ----------------------------------------------------------------------
    def start(self, leg: Leg, config: RoundsConfig, payload_dir: str | os.PathLike) -> str:
        """Turn an empty relay (no leg, no payload) into a run of parallel rounds at round 0, whose
        base is `payload_dir`: one CAS commit by the lease holder. Creates the companion repo."""
        state = leg.lease.state
        if is_parallel(state):
            raise ModeMismatch(f"{self.relay.store.spec} already runs parallel rounds (round "
                               f"{rounds_of(state).round})")
        if state.leg > 0 or state.payload:
            raise ModeMismatch(f"{self.relay.store.spec} holds {state.leg} sequential legs: parallel rounds start on "
                               "an empty relay (a run cannot mix legs and rounds)")
        init_companion(self.companion(config), config.run_id, self.relay.store.spec)
        config = config.model_copy(update={"round": 0})

        def make(s: RelayState) -> tuple[RelayState, list[Operation]]:
            new = with_rounds(s.model_copy(update={"relay_version": PARALLEL_RELAY_VERSION}), config)
            return new, []

        return self._commit_payload(leg, payload_dir, make, "relay: start parallel rounds", ledger=b"")

    def merge(self, leg: Leg, closed: ClosedRound, entry: RoundEntry, payload_dir: str | os.PathLike) -> str:
        """Commit round `closed.round`'s merge: the new base `payload_dir`, RELAY.json at round + 1,
        one ledger entry; ONE CAS commit with parent = the merger's last commit."""
        r = closed.round
        current = rounds_of(leg.lease.state)
        if current.round != r:
            raise ModeMismatch(f"cannot merge round {r}: this merger's RELAY.json is at round {current.round}")
        raw = self._ledger_raw(leg)

        def make(s: RelayState) -> tuple[RelayState, list[Operation]]:
            now = rounds_of(s)
            if now.round != r:  # our own chain moved on (an unknown outcome that landed): never merge twice
                raise LeaseLost(f"round {r} is already merged on this merger's chain (round {now.round})")
            entry.finished_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
            return with_rounds(s, now.model_copy(update={"round": r + 1})), [
                PutFile(LEDGER_JSONL, append_round(raw, entry))]

        entries = parse_round_ledger(raw, LEDGER_JSONL)
        md = render_round_ledger_md([*entries, entry])
        return self._commit_payload(leg, payload_dir, make, f"relay: merge round {r} ({len(entry.contributions)} "
                                    f"merged, {len(entry.rejected)} rejected)", ledger_md=md)

    def base_problems(self, view: RoundView) -> list[str]:
        """What the tree at `view.head` lacks of its own manifest (empty: the base verifies)."""
        return tree_problems(self.relay.store, view.head, view.state.payload)

    def reupload_base(self, leg: Leg, payload_dir: str | os.PathLike) -> str:
        """Upload again the files of the lease's base that its tree lacks, from `payload_dir` (the
        same base, rebuilt): for a merge commit the store landed without a file whose merger died
        before its own re-upload. Refuses a directory that is not that base."""
        manifest = leg.lease.state.payload
        snap = snapshot_payload(scan_payload(Path(payload_dir)), Path(payload_dir))
        try:
            if snap.manifest != manifest:
                differ = sorted(k for k in {*manifest, *snap.manifest} if manifest.get(k) != snap.manifest.get(k))
                raise PayloadError(f"{payload_dir}: the rebuilt base differs from round {rounds_of(leg.lease.state).round}'s "
                                   f"manifest in {differ[:3]}; nothing was uploaded")
            problems = tree_problems(self.relay.store, leg.lease.commit, manifest)
            return _reupload(leg.lease, self.relay.store, snap, problems) if problems else leg.lease.commit
        finally:
            snap.close()

    def _ledger_raw(self, leg: Leg) -> bytes:
        try:
            return self.relay.store.read_file(LEDGER_JSONL, leg.lease.commit)
        except FileNotFoundInStore:
            return b""

    def _commit_payload(self, leg: Leg, payload_dir: str | os.PathLike, make: PayloadWrite, message: str, *,
                        ledger: bytes | None = None, ledger_md: bytes | None = None) -> str:
        lease, store = leg.lease, self.relay.store
        files = scan_payload(Path(payload_dir))
        snap = snapshot_payload(files, Path(payload_dir))
        try:
            manifest, before = snap.manifest, lease.state.payload
            puts = [PutFile(rel, snap.sources[rel]) for rel, meta in manifest.items() if before.get(rel) != meta]
            try:
                store.prepare(puts)
            except PathIgnored as exc:
                raise PayloadError(f"{exc}; rename the file(s) (nothing was committed)") from None
            extra: list[Operation] = [] if ledger is None else [PutFile(LEDGER_JSONL, ledger)]
            if ledger_md is not None or ledger is not None:
                extra.append(PutFile(LEDGER_MD, ledger_md if ledger_md is not None else render_round_ledger_md([])))

            def write(s: RelayState) -> tuple[RelayState, list[Operation]]:
                new, ops = make(s)
                stale = [DeleteFile(p) for p in s.payload if p not in manifest]
                return new.next_write(payload=manifest, leg_commit=new.leg_commit), [*puts, *stale, *ops, *extra]

            try:
                sha = lease.write(write, message)
            except CommitNotVerified as exc:
                sha = exc.sha
            problems = tree_problems(store, sha, manifest)
            if problems:
                # The commit stands (the round advanced); the tree must hold its manifest again.
                log.warning("%s at %s lacks %s: uploading those files again", message, sha[:12], problems[:2])
                sha = _reupload(lease, store, snap, problems)
            return sha
        finally:
            snap.close()


# the title the round history checker knows a re-upload by (testing/round_history_check.py)
REUPLOAD_TITLE = "relay: re-upload of the base"


def _reupload(lease, store: RelayStore, snap, problems: list[str]) -> str:
    """Commit again the files of `snap` that `problems` (tree_problems' "path: why") name."""
    missing: list[Operation] = [PutFile(rel, snap.sources[rel]) for rel in snap.manifest
                                if any(p.startswith(rel + ":") for p in problems)]
    store.prepare(missing)
    return lease.write(lambda s: (s.next_write(), missing), REUPLOAD_TITLE)


__all__ = ["REUPLOAD_TITLE", "RoundRelay", "RoundView", "payload_digest"]
