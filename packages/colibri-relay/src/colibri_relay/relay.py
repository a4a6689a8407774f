"""`Relay`: the trainer-facing API (init, status, claim, the `leg()` context, pull, push, release).

    relay = Relay("hf://me/run", holder="alice@box", lease_duration_s=1200, heartbeat_s=300)
    with relay.leg() as leg:               # claim (waits for the baton), heartbeat starts
        leg.pull("ckpt/")                  # payload at OUR claim commit, checksums verified
        for step in range(n):
            leg.check()                    # raises LeaseLost once fenced: stop, push nothing
            ...
        leg.push("ckpt/", LegSummary(steps=n, tokens=t, loss_start=a, loss_end=b, hardware="1xH100"))
    # leaving the block releases the baton (unless fenced)

Push = blob upload (heartbeat keeps running) + ONE commit {payload, RELAY.json (leg + 1), LEDGER.jsonl
+ 1 line, LEDGER.md} whose parent is our last commit, then the tag `leg-N`.
"""

from __future__ import annotations

import getpass
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .claim import Claim, HeldStateWatch, LeaseTimers, claim_lease, read_settled, repair_after_claim
from .errors import (
    CasLost,
    ChecksumMismatch,
    CommitLockBusy,
    FileNotFoundInStore,
    LeaseHeld,
    LeaseLost,
    NotInitialized,
    OutcomeUnknown,
    RelayError,
)
from .lease import Lease, log
from .ledger import (
    LEDGER_JSONL,
    LEDGER_MD,
    LedgerEntry,
    LegSummary,
    parse_ledger,
    render_ledger_md,
)
from .payload import pull_payload
from .push import PushResult, push_leg
from .relay_state import RELAY_FILE, RelayState, read_relay_state, read_relay_status
from .repair import repair_payload
from .store import PutFile, RelayStore
from .stores import open_store

# An init that meets a busy commit lock (or an unknown outcome) reads and tries again this often.
INIT_ATTEMPTS = 12


def default_holder() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        user = "unknown"
    return f"{user}@{socket.gethostname()}:{os.getpid()}"


class Relay:
    """A relay on one store. Timers default to the Hub's commit limits (heartbeat 5 min, lease 20 min)."""

    def __init__(self, store: RelayStore | str | os.PathLike, *, holder: str | None = None, lease_duration_s: float = 1200.0,
                 heartbeat_s: float = 300.0, token: str | None = None, min_upload_bytes_per_s: float = 256 * 1024):
        if isinstance(store, (str, os.PathLike)):
            store = open_store(os.fspath(store), token=token)
        self.store = store
        self.holder = holder or default_holder()
        if heartbeat_s >= lease_duration_s / 2:
            raise ValueError(f"heartbeat_s ({heartbeat_s}) must be well under lease_duration_s ({lease_duration_s})")
        self.lease_duration_s = lease_duration_s
        self.heartbeat_s = heartbeat_s
        # The slowest upload a push budgets lease time for (bytes that travel inside a commit).
        self.min_upload_bytes_per_s = min_upload_bytes_per_s
        # How long a held (epoch, seq) has stayed unchanged: kept across claim() calls (claim.py).
        self.held_watch = HeldStateWatch()

    # --- reads ---------------------------------------------------------------------------------
    def read_state(self, revision: str) -> RelayState:
        """RELAY.json at `revision`; NotInitialized if the tree has none."""
        return read_relay_state(self.store, revision)

    def status(self) -> tuple[str, RelayState]:
        """(head sha, RELAY.json at head)."""
        return read_relay_status(self.store)

    def ledger(self, revision: str | None = None) -> list[LedgerEntry]:
        rev = revision or self.store.head()
        try:
            raw = self.store.read_file(LEDGER_JSONL, rev)
        except FileNotFoundInStore:
            raise NotInitialized(f"{self.store.spec} has no {LEDGER_JSONL} at {rev[:12]}") from None
        return parse_ledger(raw, f"{self.store.spec}@{rev[:12]} {LEDGER_JSONL}")

    # --- init ----------------------------------------------------------------------------------
    def init(self) -> tuple[str, RelayState]:
        """Create the store and an empty relay (baton free, leg 0, empty ledger). Idempotent: an
        existing valid relay is left alone; an existing corrupt RELAY.json is an error (nothing lost)."""
        head = self.store.create()
        backoff, attempt = 0.05, 0
        while True:
            attempt += 1
            try:
                return head, self.read_state(head)
            except NotInitialized:
                pass
            state = RelayState(lease_duration_s=self.lease_duration_s, heartbeat_s=self.heartbeat_s).next_write()
            ops = [PutFile(LEDGER_JSONL, b""), PutFile(LEDGER_MD, render_ledger_md([])),
                   PutFile(RELAY_FILE, state.to_bytes())]
            try:
                return self.store.commit(ops, parent=head, message="relay: init", nonce=state.nonce), state
            except CasLost:
                # The head read may have lagged behind a relay that exists (or another init won).
                try:
                    return read_settled(self.store)
                except NotInitialized:
                    raise CasLost(f"{self.store.spec}: init lost its race to a write that is not a relay") from None
            except (CommitLockBusy, OutcomeUnknown) as exc:
                # Workers started together all init at once: the others' commit holds the lock, or
                # ours may have landed unseen. Either way a relay may exist now: read, then retry.
                if attempt == INIT_ATTEMPTS:
                    raise
                log.info("relay init: %s; reading again", exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                head = self.store.head()

    def force_release(self, lease_id: str | None = None) -> tuple[str, RelayState]:
        """Free the baton from outside the holder: one CAS write on the head. If `lease_id` is
        given, only that lease is released. A live holder is fenced by its next heartbeat."""
        head, state = self.status()
        if state.status == "free":
            return head, state
        if lease_id is not None and state.lease_id != lease_id:
            raise LeaseHeld(f"baton held by lease {state.lease_id} ({state.holder}), not {lease_id}")
        leg_commit = state.leg_commit if (state.leg == 0 or state.leg_commit) else head
        new = state.next_write(status="free", holder=None, lease_id=None, leg_commit=leg_commit)
        sha = self.store.commit([PutFile(RELAY_FILE, new.to_bytes())], parent=head,
                                message=f"relay: forced release of {state.holder} by {self.holder}", nonce=new.nonce)
        return sha, new

    # --- the lease -----------------------------------------------------------------------------
    def claim(self, *, wait: bool = True, timeout_s: float | None = None, poll_s: float | None = None) -> Leg:
        """Take the baton: at once if free; if held, after watching it unchanged for the lease
        duration + margin. Starts the heartbeat thread.

        The watch continues across calls on this Relay, so repeated short claims (wait=False, or a
        `timeout_s` below the lease) take over a dead holder once the state has stayed unchanged
        that long in total. Raises LeaseHeld (naming the declared lease and how long it was
        watched) when the baton is still held at the timeout, or at once with wait=False;
        RateLimited (naming the server's wait) when the server asks to wait longer than the
        timeout leaves; NotInitialized when the head still holds no RELAY.json after a few
        re-reads (head reads lag)."""
        claim = claim_lease(self.store, self.holder, self.timers, watch=self.held_watch, wait=wait,
                            timeout_s=timeout_s, poll_s=poll_s)
        return self._start_leg(claim)

    def repair(self, *, wait: bool = True, timeout_s: float | None = None) -> str | None:
        """Claim, roll a head whose payload does not verify back to the last verified payload (one CAS
        commit), release. Returns the repair commit, or None if the head verifies."""
        with self.leg(wait=wait, timeout_s=timeout_s) as leg:
            return leg.repair()

    @property
    def timers(self) -> LeaseTimers:
        """The timers this relay's claims declare."""
        return LeaseTimers(self.lease_duration_s, self.heartbeat_s)

    def _start_leg(self, claim: Claim) -> Leg:
        started = repair_after_claim(self.store, claim.state)
        return Leg(self, Lease(self.store, claim.state, claim.commit, claim.sent_at, started_at=started))

    @contextmanager
    def leg(self, *, wait: bool = True, timeout_s: float | None = None, poll_s: float | None = None) -> Iterator[Leg]:
        """Claim, yield the Leg, release on exit (also on errors; not when fenced)."""
        leg = self.claim(wait=wait, timeout_s=timeout_s, poll_s=poll_s)
        try:
            yield leg
        finally:
            try:
                leg.release()
            except RelayError as exc:
                log.warning("release failed (the lease will expire): %s", exc)


class Leg:
    """One held lease seen from the trainer. `number` is the leg a push will create."""

    def __init__(self, relay: Relay, lease: Lease):
        self.relay = relay
        self.lease = lease

    @property
    def number(self) -> int:
        return self.lease.state.leg + 1

    @property
    def state(self) -> RelayState:
        return self.lease.state

    @property
    def claim_commit(self) -> str:
        return self.lease.claim_commit

    def check(self) -> None:
        """Raise LeaseLost once fenced (no I/O)."""
        self.lease.check()

    def time_left_s(self) -> float:
        return self.lease.time_left_s()

    def pull(self, dest_dir: str | Path, *, repair: bool = True) -> dict[str, Path]:
        """Download the payload at our lease commit into `dest_dir` (verified; {} at leg 0).

        A head whose tree does not hold its own manifest (a holder killed between a bad push and its
        rollback, an older client) would stop every claimant: with `repair` (the default) the holder
        rolls it back to the last verified payload (`Leg.repair`, one CAS commit) and pulls that.
        A download that merely failed to verify (a damaged transfer) is re-raised, never repaired."""
        self.check()
        lease, store = self.lease, self.relay.store
        try:
            return pull_payload(store, lease.commit, lease.state.payload, Path(dest_dir))
        except (ChecksumMismatch, FileNotFoundInStore):
            if not repair or self.repair() is None:
                raise
        log.warning("pulled the payload restored at %s instead", lease.commit[:12])
        return pull_payload(store, lease.commit, lease.state.payload, Path(dest_dir))

    def push(self, src_dir: str | Path, summary: LegSummary | dict | None = None) -> PushResult:
        """Publish `src_dir` as leg `number`: one CAS commit, verified, then the tag leg-N (push.py).
        Raises LeaseLost, PayloadError, or PushNotVerified (payload rolled back; push again)."""
        relay = self.relay
        return push_leg(relay.store, self.lease, src_dir, summary, holder=relay.holder,
                        min_upload_bytes_per_s=relay.min_upload_bytes_per_s)

    def repair(self) -> str | None:
        """Roll a payload that does not verify at our lease commit back to the last verified one (one
        CAS commit; repair.py). Returns that commit, or None if the payload verifies."""
        return repair_payload(self.relay.store, self.lease, holder=self.relay.holder)

    def release(self) -> bool:
        """Free the baton. Returns False if we were already fenced (nothing written)."""
        return self.lease.release()

    def close(self) -> None:
        """Stop the heartbeat without releasing (the lease then expires)."""
        self.lease.close()


__all__ = ["Relay", "Leg", "PushResult", "LeaseLost"]
