"""Repair: a head whose payload does not verify is rolled back to the last payload that does, as ONE
new CAS commit by the lease holder (RELAY.md, "Repair").

How a head can be unreadable: a push by an older client that hashed and uploaded in two reads, a
store that dropped a file from a commit, a damaged blob. Nothing in the history is rewritten: the
repair commit copies the good commit's payload files back (`CopyFile`: no re-upload of large files),
deletes the files the bad manifest added, and writes RELAY.json with the good manifest. The leg
count, the ledger and the tags are left alone (legs stay numbered once; leg N's ledger line and tag
keep naming the commit that pushed it), so the next leg simply trains on the restored payload.

Trade-off: finding the last verified payload walks the history back from the head, reading
RELAY.json at each push / repair commit and checking its tree (sizes and sha256 from one listing per
candidate; small regular files are read). Repairs are rare; this is not on any hot path.
"""

from __future__ import annotations

from .errors import RelayError, StoreError
from .lease import Lease, log
from .payload import tree_problems
from .relay_state import PayloadFile, RelayState, read_relay_state
from .store import CopyFile, DeleteFile, Operation, RelayStore

PAYLOAD_TITLES = ("relay: push leg ", "relay: repair ", "relay: init")
REPAIR_TITLE = "relay: repair by {holder}: payload restored from {good} ({bad} did not verify)"


def last_verified_payload(store: RelayStore, start: str, *, skip: str | None = None) -> tuple[str, RelayState]:
    """The newest commit at or before `start` whose tree holds its RELAY.json manifest."""
    checked: set[tuple] = set()
    for rec in store.history(start):
        if rec.sha == skip or not (rec.sha == start or rec.title.startswith(PAYLOAD_TITLES)):
            continue
        try:
            state = read_relay_state(store, rec.sha)
        except RelayError:
            continue
        key = tuple(sorted((p, m.sha256, m.size) for p, m in state.payload.items()))
        if key in checked:
            continue
        checked.add(key)
        try:
            if not tree_problems(store, rec.sha, state.payload):
                return rec.sha, state
        except StoreError as exc:
            log.warning("repair: cannot check %s: %s", rec.sha[:12], exc)
    raise RelayError(f"{store.spec}: no commit at or before {start[:12]} holds its own payload manifest")


def restore_verified_payload(store: RelayStore, lease: Lease, *, holder: str, bad: str) -> str:
    """As `holder` of `lease`, roll the payload at the lease's last commit back to the last verified
    one; `bad` is the commit named as the one that did not verify. Returns the repair commit."""
    good, good_state = last_verified_payload(store, lease.commit, skip=lease.commit)
    head_files, good_files = store.list_files(lease.commit), store.list_files(good)
    ops: list[Operation] = [CopyFile(p, good) for p in sorted(good_state.payload) if head_files.get(p) != good_files.get(p)]
    ops += [DeleteFile(p) for p in sorted(lease.state.payload) if p not in good_state.payload and p in head_files]

    def make(state: RelayState) -> tuple[RelayState, list[Operation]]:
        return state.next_write(payload=good_state.payload, lease_duration_s=lease.base_duration_s), ops

    title = REPAIR_TITLE.format(holder=holder, good=good[:12], bad=bad[:12])
    sha = lease.write(make, title)
    log.warning("relay payload at %s did not verify; restored the payload of %s in %s", bad[:12], good[:12], sha[:12])
    return sha


def payload_origin(store: RelayStore, start: str, manifest: dict[str, PayloadFile]) -> str:
    """The commit that wrote `manifest` (as carried by `start`): the oldest of the commits just before
    `start` whose RELAY.json names the same manifest (heartbeats, claims, releases copy it)."""
    origin = start
    for rec in store.history(start)[1:]:
        try:
            if read_relay_state(store, rec.sha).payload != manifest:
                break
        except RelayError:
            break
        origin = rec.sha
    return origin


def repair_payload(store: RelayStore, lease: Lease, *, holder: str) -> str | None:
    """`Leg.repair`: None if the payload at the lease's last commit verifies, else the repair commit."""
    lease.check()
    if not tree_problems(store, lease.commit, lease.state.payload):
        return None
    # Name the push that wrote the bad manifest (not our claim on top of it): readers of the history
    # (history_check) can then tell which leg's payload was rolled back.
    return restore_verified_payload(store, lease, holder=holder,
                                    bad=payload_origin(store, lease.commit, lease.state.payload))
