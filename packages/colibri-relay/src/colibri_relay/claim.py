"""Claiming the baton: from a free state at once, or by takeover after a watched expiry.

A held lease may be taken over only after the claimant has seen (epoch, seq) unchanged for the
holder's declared `lease_duration_s` plus a margin on its OWN monotonic clock (wall clocks of two
machines are never compared; commit timestamps are for display). The claim itself is one CAS write
whose parent is the head at which that state was read, so two claimants can never both win.
"""

from __future__ import annotations

import secrets
import time
from datetime import datetime, timezone

from .errors import CasLost, CommitLockBusy, LeaseHeld, OutcomeUnknown, RateLimited, StoreError, TagExists
from .lease import Lease, default_margin, log
from .relay_state import RELAY_FILE, RelayState
from .store import PutFile, RelayStore


def _repair_leg_tag(store: RelayStore, leg: int, commit: str) -> None:
    """A holder may die between its push commit and the `leg-N` tag: the next claimant adds it."""
    try:
        store.create_tag(f"leg-{leg}", commit)
    except TagExists as exc:
        if exc.target != commit:
            log.error("tag leg-%d points at %s but RELAY.json says %s", leg, exc.target, commit)
    except StoreError as exc:
        log.warning("could not check tag leg-%d: %s", leg, exc)


def claim_lease(relay, *, wait: bool = True, timeout_s: float | None = None, poll_s: float | None = None) -> Lease:
    """See `Relay.claim`."""
    store: RelayStore = relay.store
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    watched: tuple[int, int] | None = None
    first_seen = 0.0
    my_nonces: dict[str, tuple[RelayState, float, str]] = {}
    while True:
        try:
            head, state = relay.status()
        except (RateLimited, OutcomeUnknown, CommitLockBusy, StoreError) as exc:
            if not wait or (deadline is not None and time.monotonic() > deadline):
                raise
            log.warning("claim: reading the relay failed, retrying: %s", exc)
            time.sleep(poll_s or 0.5)
            continue
        # A claim whose outcome was unknown may have landed: adopt it.
        if state.status == "held" and state.nonce in my_nonces:
            mine, sent_at, parent = my_nonces[state.nonce]
            return relay._adopt(state, head, sent_at)
        now = time.monotonic()
        takeover = False
        if state.status == "held":
            key = (state.epoch, state.seq)
            if key != watched:
                watched, first_seen = key, now
            expiry = state.lease_duration_s + default_margin(state.lease_duration_s)
            takeover = now - first_seen >= expiry
            if not takeover and not wait:
                raise LeaseHeld(f"lease held by {state.holder} (epoch {state.epoch}, seq {state.seq}); "
                                f"a takeover needs it unchanged for {expiry:.0f}s")
        if state.status == "free" or takeover:
            leg_commit = state.leg_commit if (state.leg == 0 or state.leg_commit) else head
            new = state.next_write(
                status="held", epoch=state.epoch + 1, lease_id=secrets.token_hex(8), holder=relay.holder,
                lease_duration_s=relay.lease_duration_s, heartbeat_s=relay.heartbeat_s, leg_commit=leg_commit,
            )
            sent_at = time.monotonic()
            my_nonces[new.nonce] = (new, sent_at, head)
            what = "takeover from " + str(state.holder) if takeover else "claim"
            try:
                sha = store.commit([PutFile(RELAY_FILE, new.to_bytes())], parent=head,
                                   message=f"relay: {what} by {relay.holder} (epoch {new.epoch} seq {new.seq})",
                                   nonce=new.nonce)
                return relay._adopt(new, sha, sent_at)
            except (CasLost, CommitLockBusy, OutcomeUnknown) as exc:
                log.info("claim attempt did not win: %s", exc)
                watched = None
            except RateLimited as exc:
                time.sleep(min(exc.retry_after_s, 30))
        if deadline is not None and time.monotonic() > deadline:
            raise LeaseHeld(f"could not claim within {timeout_s}s: held by {state.holder} (epoch {state.epoch})")
        time.sleep(poll_s if poll_s is not None else max(0.05, min(state.heartbeat_s, relay.heartbeat_s) / 2))


def repair_after_claim(relay, state: RelayState) -> str:
    """After a claim landed: repair a missing leg tag; return the wall-clock start (display only)."""
    if state.leg > 0 and state.leg_commit:
        _repair_leg_tag(relay.store, state.leg, state.leg_commit)
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
