"""A held lease: the write primitive, the heartbeat thread and self-fencing.

Safety comes from the compare-and-swap alone: every write names the holder's OWN last commit as
parent, so any foreign write (a takeover) makes all later writes fail with CasLost and the holder
fences itself. Timers only give liveness:

* the heartbeat thread renews every `heartbeat_s` (RELAY.json seq + 1, fresh nonce);
* the holder is fenced once its last successful renewal was SENT more than
  `lease_duration_s - margin_s` ago on its own monotonic clock, or on the first CasLost;
* a claimant takes over only after seeing (epoch, seq) unchanged for `lease_duration_s + margin_s`
  on ITS monotonic clock (claim.py), i.e. strictly after the holder has stopped.

Unknown outcomes (the store could not find the nonce yet) are retried with a fresh nonce and the
SAME parent; if a later attempt then gets CasLost, the history is searched for every nonce we
sent before fencing, because an earlier attempt may have landed after all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .errors import (
    CasLost,
    CommitLockBusy,
    CommitNotVerified,
    LeaseLost,
    OutcomeUnknown,
    RateLimited,
    StoreError,
)
from .relay_state import RELAY_FILE, RelayState
from .store import Operation, PutFile, RelayStore

log = logging.getLogger("colibri_relay")

# A write builds (new state, extra operations) from the current state; called once per attempt.
MakeWrite = Callable[[RelayState], tuple[RelayState, list[Operation]]]


def default_margin(lease_duration_s: float) -> float:
    return lease_duration_s / 6


class Lease:
    """A lease we hold, from the claim commit on. Not created directly: use `Relay.claim()`."""

    def __init__(self, store: RelayStore, state: RelayState, commit: str, sent_at: float, *, started_at: str = ""):
        self.store = store
        self.state = state
        self.commit = commit  # our last landed write: the parent of the next one
        self.claim_commit = commit
        self.claim_state = state
        self.started_at = started_at
        self.claimed_mono = sent_at
        self._renewed_at = sent_at
        # The duration declared at claim; a push may declare a longer one while it runs (extended()).
        self.base_duration_s = state.lease_duration_s
        self._declared_s = state.lease_duration_s
        self._write_lock = threading.Lock()
        self._fence_reason: str | None = None
        self._superseded = False  # a CasLost proved someone else wrote on top of our commit
        self._done = False  # released (or closed): nothing more to write
        self._stop = threading.Event()
        self.heartbeats = 0
        self._thread = threading.Thread(target=self._heartbeat_loop, name="relay-heartbeat", daemon=True)
        self._thread.start()

    # --- fencing -------------------------------------------------------------------------------
    @property
    def margin_s(self) -> float:
        # Follows the duration our last landed write declared: claimants use that one too.
        return default_margin(self.state.lease_duration_s)

    @property
    def lease_id(self) -> str:
        return str(self.state.lease_id)

    @property
    def fenced(self) -> bool:
        self._check_clock()
        return self._fence_reason is not None

    def time_left_s(self) -> float:
        """Seconds until we fence ourselves if no renewal lands."""
        return self._renewed_at + self.state.lease_duration_s - self.margin_s - time.monotonic()

    def _check_clock(self) -> None:
        if self._fence_reason is None and self.time_left_s() <= 0:
            self._fence(f"no successful renewal for {self.state.lease_duration_s - self.margin_s:.1f}s")

    def _fence(self, reason: str, *, expected: bool = False) -> None:
        if self._fence_reason is None:
            self._fence_reason = reason
            (log.info if expected else log.warning)("relay lease %s stopped: %s", self.state.lease_id, reason)
        self._stop.set()

    def check(self) -> None:
        """Raise LeaseLost once fenced. Cheap (no I/O): call it every training step."""
        self._check_clock()
        if self._fence_reason is not None:
            raise LeaseLost(f"lease {self.state.lease_id} lost: {self._fence_reason}")

    # --- the write primitive -------------------------------------------------------------------
    def write(self, make: MakeWrite, message: str, *, until: float | None = None) -> str:
        """One CAS write on top of our last commit; returns the new commit. Raises LeaseLost.

        `until` (a monotonic deadline) replaces the self-fence check: only `release()` uses it, to
        free a baton whose lease we stopped trusting by the clock. The CAS keeps that safe."""
        def alive() -> None:
            if until is None:
                self.check()
            elif self._superseded or time.monotonic() > until:
                raise LeaseLost(f"lease {self.state.lease_id} lost: {self._fence_reason}")

        with self._write_lock:
            alive()
            attempts: dict[str, tuple[RelayState, float]] = {}
            backoff = 0.05
            while True:
                alive()
                new_state, ops = make(self.state)
                attempts[new_state.nonce] = (new_state, time.monotonic())
                try:
                    sha = self.store.commit(
                        [*ops, PutFile(RELAY_FILE, new_state.to_bytes())],
                        parent=self.commit, message=f"{message} (epoch {new_state.epoch} seq {new_state.seq})",
                        nonce=new_state.nonce,
                    )
                    landed = new_state.nonce
                except CommitLockBusy:
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
                    continue
                except RateLimited as exc:
                    left = self.time_left_s() if until is None else until - time.monotonic()
                    if exc.retry_after_s >= left:
                        # Re-posting sooner than the server asked only burns quota; the lease ends first.
                        reason = f"rate limited for {exc.retry_after_s:.0f}s, past the {max(left, 0):.1f}s left: {exc}"
                        self._fence(reason)
                        raise LeaseLost(f"lease {self.state.lease_id} lost: {reason}") from None
                    time.sleep(exc.retry_after_s)
                    continue
                except OutcomeUnknown:
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
                    continue
                except CommitNotVerified as exc:
                    # It landed on our parent, so it is our last commit now, whatever its tree lacks.
                    state, sent_at = attempts[new_state.nonce]
                    self.commit, self.state, self._renewed_at = exc.sha, state, sent_at
                    raise
                except CasLost as exc:
                    found = self._find_own(attempts) if len(attempts) > 1 else None
                    if found is None:
                        self._superseded = True
                        self._fence(f"CAS lost on {message}: {exc}")
                        raise LeaseLost(f"lease {self.state.lease_id} lost: {exc}") from None
                    sha, landed = found
                state, sent_at = attempts[landed]
                self.commit, self.state, self._renewed_at = sha, state, sent_at
                return sha

    def _find_own(self, attempts: dict[str, tuple[RelayState, float]]) -> tuple[str, str] | None:
        """An earlier attempt whose outcome was unknown may have landed: look for its nonce."""
        try:
            for rec in self.store.history(stop_at=self.commit):
                nonce = rec.nonce
                if nonce is not None and nonce in attempts and rec.parent == self.commit:
                    return rec.sha, nonce
        except StoreError:
            return None
        return None

    # --- heartbeat -----------------------------------------------------------------------------
    def _heartbeat_write(self, state: RelayState) -> tuple[RelayState, list[Operation]]:
        return state.next_write(leg_commit=self._leg_commit(state), lease_duration_s=self._declared_s), []

    @contextmanager
    def extended(self, duration_s: float, why: str) -> Iterator[None]:
        """Renew now declaring `duration_s`, and keep declaring it (heartbeats included) until the
        block ends: a claimant waits that long after reading such a write, which covers a commit
        no renewal can interrupt. Timers only: the CAS keeps it safe either way."""
        log.info("relay lease %s: declaring %.1fs for %s", self.state.lease_id, duration_s, why)
        self._declared_s = duration_s
        try:
            self.renew()
            yield
        finally:
            self._declared_s = self.base_duration_s

    def _leg_commit(self, state: RelayState) -> str | None:
        # After a push, RELAY.json cannot name its own commit; the next write fills it in.
        if state.leg > 0 and state.leg_commit is None:
            return self.commit
        return state.leg_commit

    def renew(self) -> str:
        sha = self.write(self._heartbeat_write, "relay: heartbeat")
        self.heartbeats += 1
        return sha

    def _heartbeat_loop(self) -> None:
        period = self.state.heartbeat_s
        while not self._stop.wait(period):
            try:
                self.renew()
                period = self.state.heartbeat_s
            except LeaseLost:
                return
            except StoreError as exc:  # transient (network, 5xx on reads): retry sooner
                log.warning("relay heartbeat failed, retrying: %s", exc)
                period = max(0.05, self.state.heartbeat_s / 4)
            except Exception as exc:  # noqa: BLE001 - the heartbeat must never die silently
                log.exception("relay heartbeat error: %s", exc)
                period = max(0.05, self.state.heartbeat_s / 4)

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    def close(self) -> None:
        """Stop the heartbeat without releasing: the baton stays held until the lease lapses."""
        self._fence("closed", expected=True)
        self.stop_heartbeat()

    # --- release -------------------------------------------------------------------------------
    def release(self) -> bool:
        """Free the baton (one CAS write). Returns False if nothing was released.

        A lease we stopped trusting by the clock is still released: a heartbeat in flight when the
        trainer was told LeaseLost may have landed since, and then the baton would sit "held" for a
        whole lease duration with nobody behind it. The write names our own last commit as parent, so
        if anyone took over meanwhile it is refused (CasLost) and nothing changes."""
        self._check_clock()
        if self._superseded or self._done or self._fence_reason == "closed":
            self.stop_heartbeat()
            return False
        fenced = self._fence_reason is not None
        self.stop_heartbeat()  # an in-flight heartbeat lands (or fails) before we write on top of it

        def make(state: RelayState):
            return state.next_write(status="free", holder=None, lease_id=None, lease_duration_s=self.base_duration_s,
                                    leg_commit=self._leg_commit(state)), []

        try:
            self.write(make, "relay: release", until=time.monotonic() + self.margin_s if fenced else None)
            return True
        except LeaseLost:
            return False
        finally:
            self._done = True
            self._fence("released", expected=True)
