"""Claiming the baton: from a free state at once, or by takeover after a watched expiry.

A held lease may be taken over only after the claimant has seen (epoch, seq) unchanged for the
holder's declared `lease_duration_s` plus a margin on its OWN monotonic clock (wall clocks of two
machines are never compared; commit timestamps are for display). The claim itself is one CAS write
whose parent is the head at which that state was read, so two claimants can never both win.

The watch (`HeldStateWatch`) belongs to the `Relay`, not to one `claim()` call: a caller that
retries `claim(wait=False)` or `claim(timeout_s=T)` with T shorter than the lease still takes over a
dead holder once the state has stayed unchanged long enough in total. That is safe because `seq`
grows with every write: the same (epoch, seq) seen twice means nothing landed in between.

A server that asks to wait (HTTP 429; the Hub's commit quota says "about 1 hour") is obeyed: the
claim waits the asked time if the caller's timeout allows it, else raises `RateLimited` at once,
naming the wait. A head read that shows no RELAY.json is read again for `HEAD_LAG_S`: the Hub's
head reads lag, and right after `init` they may still show the repo's first, empty commit.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from .errors import (
    CasLost,
    CommitLockBusy,
    LeaseHeld,
    NotInitialized,
    OutcomeUnknown,
    RateLimited,
    StoreError,
    TagExists,
)
from .lease import default_margin, log
from .relay_state import RELAY_FILE, RelayState, read_relay_status
from .store import PutFile, RelayStore

# How long a head without RELAY.json is read again before the relay counts as uninitialised.
HEAD_LAG_S = 3.0


@dataclass(frozen=True)
class LeaseTimers:
    """The timers a claimant declares in RELAY.json: the lease it asks for and its renewal period.

    Attributes:
        lease_duration_s: how long a claimant must see the lease unchanged before a takeover.
        heartbeat_s: how often the holder renews (well under `lease_duration_s`).
    """

    lease_duration_s: float
    heartbeat_s: float


@dataclass(frozen=True)
class Claim:
    """A claim that landed: what it read and what it wrote (the start of a `Lease`).

    Attributes:
        state: RELAY.json as the claim wrote it (status "held", our holder, epoch and lease id).
        commit: the claim commit (the parent of the holder's next write).
        parent: the head the claim read and was written on.
        sent_at: `time.monotonic()` when the claim was sent: the holder's fence counts from it.
    """

    state: RelayState
    commit: str
    parent: str
    sent_at: float


class HeldStateWatch:
    """How long one claimant has seen a held lease's (epoch, seq) unchanged, on its monotonic clock.

    Kept by `Relay` across `claim()` calls. Any other pair restarts it; so does a free baton.

    Attributes:
        key: the (epoch, seq) watched, or None.
        since: `time.monotonic()` when `key` was first seen.
    """

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.since = 0.0
        self._lock = threading.Lock()

    def observe(self, key: tuple[int, int] | None, now: float) -> float:
        """Record a read of `key` (None: not held) at `now`; return how long it has been watched."""
        with self._lock:
            if key != self.key:
                self.key, self.since = key, now
            return now - self.since

    def reset(self) -> None:
        with self._lock:
            self.key = None


def describe_wait(seconds: float) -> str:
    """A server's wait in words: "12 seconds", "43 minutes", "about 1 hour"."""
    if seconds < 90:
        return f"{seconds:.0f} seconds"
    if seconds < 50 * 60:
        return f"{seconds / 60:.0f} minutes"
    hours = max(1, round(seconds / 3600))
    return f"about {hours} hour{'s' if hours > 1 else ''}"


def _repair_leg_tag(store: RelayStore, leg: int, commit: str) -> None:
    """A holder may die between its push commit and the `leg-N` tag: the next claimant adds it."""
    try:
        store.create_tag(f"leg-{leg}", commit)
    except TagExists as exc:
        if exc.target != commit:
            log.error("tag leg-%d points at %s but RELAY.json says %s", leg, exc.target, commit)
    except StoreError as exc:
        log.warning("could not check tag leg-%d: %s", leg, exc)


def read_settled(store: RelayStore, deadline: float | None = None) -> tuple[str, RelayState]:
    """(head, RELAY.json at head), read again while the head shows no RELAY.json, for up to
    `HEAD_LAG_S` (and never past `deadline`): a lagging head read is not an uninitialised relay."""
    give_up = time.monotonic() + HEAD_LAG_S
    if deadline is not None:
        give_up = min(give_up, deadline)
    pause = 0.1
    while True:
        try:
            return read_relay_status(store)
        except NotInitialized:
            if time.monotonic() + pause > give_up:
                raise
            log.info("no %s at the head read; reading again (head reads may lag)", RELAY_FILE)
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


def _wait_or_raise(exc: RateLimited, what: str, spec: str, wait: bool, deadline: float | None) -> None:
    """Sleep the wait a 429 asked for, or raise RateLimited now if the claim cannot wait that long."""
    asked = exc.retry_after_s
    left = None if deadline is None else deadline - time.monotonic()
    if wait and (left is None or asked < left):
        log.warning("claim: %s rate limited; waiting %s as the server asked", what, describe_wait(asked))
        time.sleep(asked)
        return
    why = "a claim without waiting" if not wait else f"the {max(left or 0.0, 0):.1f}s left of this claim's timeout"
    raise RateLimited(f"{spec}: {what} was refused by the server's rate limit, which asks to wait "
                      f"{describe_wait(asked)} ({asked:.0f}s), longer than {why}; nothing was written: "
                      "claim again after that", asked) from None


def _lease_held(state: RelayState, watched_s: float, expiry_s: float, prefix: str = "") -> LeaseHeld:
    return LeaseHeld(
        f"{prefix}lease held by {state.holder} (epoch {state.epoch}, seq {state.seq}), which declares a "
        f"{state.lease_duration_s:g}s lease: its state was watched unchanged for {watched_s:.1f}s (across "
        f"this Relay's claims) of the {expiry_s:.1f}s a takeover needs",
        holder=state.holder, lease_duration_s=state.lease_duration_s, watched_s=watched_s, takeover_after_s=expiry_s)


def claim_lease(store: RelayStore, holder: str, timers: LeaseTimers, *, watch: HeldStateWatch, wait: bool = True,
                timeout_s: float | None = None, poll_s: float | None = None) -> Claim:
    """Claim the baton of `store` for `holder` (see `Relay.claim`); `watch` is the caller's, kept
    across its claims. Returns the claim that landed; starting the lease on it is the caller's."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    my_nonces: dict[str, tuple[RelayState, float, str]] = {}
    while True:
        try:
            head, state = read_settled(store, deadline)
        except RateLimited as exc:
            _wait_or_raise(exc, "reading the relay", store.spec, wait, deadline)
            continue
        except (OutcomeUnknown, CommitLockBusy, StoreError) as exc:
            if not wait or (deadline is not None and time.monotonic() > deadline):
                raise
            log.warning("claim: reading the relay failed, retrying: %s", exc)
            time.sleep(poll_s or 0.5)
            continue
        # A claim whose outcome was unknown may have landed: adopt it.
        if state.status == "held" and state.nonce in my_nonces:
            watch.reset()
            _mine, sent_at, parent = my_nonces[state.nonce]
            return Claim(state, head, parent, sent_at)
        takeover = False
        held = state.status == "held"
        watched_s = watch.observe((state.epoch, state.seq) if held else None, time.monotonic())
        expiry = state.lease_duration_s + default_margin(state.lease_duration_s)
        if held:
            takeover = watched_s >= expiry
            if not takeover and not wait:
                raise _lease_held(state, watched_s, expiry)
        if not held or takeover:
            leg_commit = state.leg_commit if (state.leg == 0 or state.leg_commit) else head
            new = state.next_write(
                status="held", epoch=state.epoch + 1, lease_id=secrets.token_hex(8), holder=holder,
                lease_duration_s=timers.lease_duration_s, heartbeat_s=timers.heartbeat_s, leg_commit=leg_commit,
            )
            sent_at = time.monotonic()
            my_nonces[new.nonce] = (new, sent_at, head)
            kind = "takeover" if takeover else "claim"
            what = f"takeover from {state.holder}" if takeover else "claim"
            try:
                sha = store.commit([PutFile(RELAY_FILE, new.to_bytes())], parent=head,
                                   message=f"relay: {what} by {holder} (epoch {new.epoch} seq {new.seq})",
                                   nonce=new.nonce)
                watch.reset()
                return Claim(new, sha, head, sent_at)
            except (CasLost, CommitLockBusy, OutcomeUnknown) as exc:
                log.info("claim attempt did not win: %s", exc)
                watch.reset()
            except RateLimited as exc:
                _wait_or_raise(exc, f"the {kind} commit", store.spec, wait, deadline)
                continue
        now = time.monotonic()
        if deadline is not None and now > deadline:
            if held:
                raise _lease_held(state, watched_s, expiry, prefix=f"could not claim within {timeout_s:g}s: ")
            raise LeaseHeld(f"could not claim within {timeout_s:g}s: every claim of the free baton lost its race")
        pause = poll_s if poll_s is not None else max(0.05, min(state.heartbeat_s, timers.heartbeat_s) / 2)
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - now + 0.01)))


def repair_after_claim(store: RelayStore, state: RelayState) -> str:
    """After a claim landed: repair a missing leg tag; return the wall-clock start (display only)."""
    if state.leg > 0 and state.leg_commit:
        _repair_leg_tag(store, state.leg, state.leg_commit)
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
