"""Pushing a leg: snapshot, upload, ONE CAS commit, verify, tag (RELAY.md, "Push").

1. Snapshot the payload (payload.py): each file read once, hashed as read, uploaded from what was read.
2. Keep unchanged files: a file whose sha256 and size equal the current manifest's entry is not sent
   at all (the tree keeps it); only changed files upload, and dropped ones are deleted.
3. `store.prepare`: LFS files upload now, outside the write lock, while heartbeats keep landing.
   Paths the store would silently drop (the Hub repo's .gitignore) are refused here: PayloadError.
4. Files the store keeps inline travel inside the commit request, when no renewal can land. If that
   upload could outlast the lease, the holder first renews with a longer declared lease duration
   (claimants wait for the duration declared in the state they watch), budgeted at
   `min_upload_bytes_per_s`; every write declares it until the push is done (the push commit too:
   the holder's own fence counts from when a write was sent), then heartbeats declare the claim's
   duration again.
5. ONE commit with parent = our last commit: changed payload files, deletions, RELAY.json (leg + 1,
   new manifest), LEDGER.jsonl (+1 line), LEDGER.md.
6. Verify the new tree against the manifest (sizes, sha256 / git oid) before reporting success. If it
   does not hold the manifest, the holder rolls the payload back to the last verified one (repair.py)
   and raises PushNotVerified: no later claimant ever meets a head it cannot pull.
7. Tag `leg-N` (bookkeeping: a tag that cannot be made now is made by the next claimant).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from .errors import (
    CommitNotVerified,
    FileNotFoundInStore,
    ModeMismatch,
    PathIgnored,
    PayloadError,
    PushNotVerified,
    RelayError,
    RelayFileCorrupt,
    StoreError,
    StoreNotFound,
    TagExists,
)
from .lease import Lease, log
from .ledger import (
    LEDGER_JSONL,
    LEDGER_MD,
    LedgerEntry,
    LegSummary,
    append_entry,
    parse_ledger,
    render_ledger_md,
)
from .payload import Snapshot, entry_matches, scan_payload, snapshot_payload
from .relay_state import RELAY_FILE, RelayState, is_parallel
from .repair import restore_verified_payload
from .store import DeleteFile, Operation, PutFile, RelayStore, git_blob_sha1

# RELAY.json + one ledger line + LEDGER.md grow with the legs; a generous bound for the budget.
RELAY_FILES_INLINE_BYTES = 64 * 1024


@dataclass(frozen=True)
class PushResult:
    leg: int
    commit: str
    tag: str


def push_leg(store: RelayStore, lease: Lease, src_dir: str | Path, summary: LegSummary | dict | None, *,
             holder: str, min_upload_bytes_per_s: float) -> PushResult:
    """Push `src_dir` as the next leg on `lease` (held on `store` by `holder`; see `Leg.push`).
    `min_upload_bytes_per_s` is the slowest upload the lease time is budgeted for (step 4)."""
    lease.check()
    if is_parallel(lease.state):
        raise ModeMismatch(f"{store.spec} runs parallel rounds (relay_version {lease.state.relay_version}): "
                           "a sequential leg cannot be pushed into it; join with `colibri train --parallel`")
    summary = summary if isinstance(summary, LegSummary) else LegSummary.model_validate(summary or {})
    files = scan_payload(Path(src_dir))
    snap = snapshot_payload(files, Path(src_dir))
    try:
        return _push(store, lease, snap, summary, holder, min_upload_bytes_per_s)
    finally:
        snap.close()


def _push(store: RelayStore, lease: Lease, snap: Snapshot, summary: LegSummary, holder: str,
          min_rate: float) -> PushResult:
    manifest, before = snap.manifest, lease.state.payload
    puts = [PutFile(rel, snap.sources[rel]) for rel, meta in manifest.items() if before.get(rel) != meta]
    try:
        store.prepare(puts)  # LFS blobs upload here, outside the write lock: heartbeats continue
    except PathIgnored as exc:
        raise PayloadError(f"{exc}; rename the file(s) or change the repo's .gitignore (nothing was pushed)") from None
    with _inline_budget(lease, store.inline_bytes(puts) + RELAY_FILES_INLINE_BYTES, min_rate):
        return _commit_push(store, lease, snap, summary, puts, holder)


def read_lease_ledger(store: RelayStore, lease: Lease) -> bytes:
    """LEDGER.jsonl at the lease's last commit (read errors retried a few times), checked to hold
    one entry per leg of its RELAY.json."""
    rev = lease.commit
    last: Exception | None = None
    for attempt in range(5):
        try:
            raw = store.read_file(LEDGER_JSONL, rev)
            break
        except FileNotFoundInStore:
            raw = b""
            break
        except (StoreError, StoreNotFound) as exc:
            last = exc
            time.sleep(0.2 * (attempt + 1))
    else:
        raise StoreError(f"cannot read {LEDGER_JSONL} at {rev[:12]}: {last}")
    entries = parse_ledger(raw, f"{store.spec}@{rev[:12]} {LEDGER_JSONL}")
    if len(entries) != lease.state.leg:
        raise RelayFileCorrupt(f"{store.spec}@{rev[:12]} {LEDGER_JSONL}: {len(entries)} entries but "
                               f"{RELAY_FILE} says leg {lease.state.leg}")
    return raw


def _commit_push(store: RelayStore, lease: Lease, snap: Snapshot, summary: LegSummary, puts: list[PutFile],
                 holder: str) -> PushResult:
    manifest = snap.manifest
    ledger_raw = read_lease_ledger(store, lease)
    entries = parse_ledger(ledger_raw, LEDGER_JSONL)
    number = lease.state.leg + 1

    def make(state: RelayState) -> tuple[RelayState, list[Operation]]:
        n = state.leg + 1
        entry = LedgerEntry(
            **summary.model_dump(), leg=n, holder=str(state.holder), lease_id=str(state.lease_id),
            epoch=state.epoch, started_at=lease.started_at,
            finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            hours=(time.monotonic() - lease.claimed_mono) / 3600, base_commit=lease.claim_commit,
            payload_files=len(manifest), payload_bytes=sum(m.size for m in manifest.values()),
        )
        stale = [DeleteFile(p) for p in state.payload if p not in manifest]
        ops: list[Operation] = [*puts, *stale, PutFile(LEDGER_JSONL, append_entry(ledger_raw, entry)),
               PutFile(LEDGER_MD, render_ledger_md([*entries, entry]))]
        # The duration declared now (extended by _inline_budget, if it was) stays: the holder's fence
        # counts from when this write was SENT, so a long inline upload needs it too.
        new = state.next_write(leg=n, leg_commit=None, payload=manifest)
        return new, ops

    try:
        sha = lease.write(make, f"relay: push leg {number}")
        problems = _tree_problems(store, sha, snap)
    except CommitNotVerified as exc:  # landed, and the lease now stands on it
        sha, problems = exc.sha, exc.problems
    tag = f"leg-{lease.state.leg}"
    _tag(store, tag, sha)
    if problems:
        restored = restore_verified_payload(store, lease, holder=holder, bad=sha)
        raise PushNotVerified(f"leg {number}: commit {sha[:12]} did not verify ({'; '.join(problems[:3])}); the "
                              f"payload was rolled back to commit {str(restored)[:12]}: push again", number, sha, restored)
    return PushResult(lease.state.leg, sha, tag)


def _tree_problems(store: RelayStore, sha: str, snap: Snapshot) -> list[str]:
    """The new tree against the manifest, from one listing: sha256 where the store lists it, else the
    git oid of the very bytes we uploaded (kept files included: no download needed)."""
    try:
        files = store.list_files(sha)
    except StoreError as exc:
        log.warning("could not list %s to verify the push, trusting the store's own check: %s", sha[:12], exc)
        return []
    problems = []
    for rel, meta in snap.manifest.items():
        info = files.get(rel)
        ok = entry_matches(info, meta)
        if ok is None and info is not None:  # a listed regular file: compare the git oid
            src = snap.sources[rel]
            ok = info.git_oid == git_blob_sha1(src if isinstance(src, bytes) else Path(src).read_bytes())
        if not ok:
            problems.append(f"{rel} is " + ("missing" if info is None else "not the bytes pushed"))
    return problems


def _inline_budget(lease: Lease, inline_bytes: int, min_rate: float) -> AbstractContextManager[None]:
    """No renewal can land while the commit request is in flight: if its inline body could outlast
    what is left of the lease, renew first declaring a lease duration that covers it."""
    need_s = inline_bytes / min_rate
    if need_s <= lease.time_left_s() / 2:
        return nullcontext()
    return lease.extended(lease.base_duration_s + 2 * need_s, f"an inline upload of {inline_bytes} bytes")


def _tag(store: RelayStore, tag: str, sha: str) -> None:
    try:
        store.create_tag(tag, sha)
    except TagExists as exc:
        if exc.target is not None and exc.target != sha:
            raise RelayError(f"{tag} already points at {exc.target}, ours is {sha}: leg pushed twice") from None
    except StoreError as exc:  # bookkeeping only: the next claimant repairs a missing tag
        log.warning("could not create tag %s (the next claim will): %s", tag, exc)
