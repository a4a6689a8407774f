"""HubStore's writes: prepare, the ONE compare-and-swap commit, its outcome and its verification.
`HubCasCommit` reads what it checks through the store's `HubReader` (reader.py).

Rules this file enforces (why: see RELAY.md, "Why these rules"):

* every write is ONE `HfApi.create_commit(parent_commit=<full 40-hex sha>)`; never
  `upload_folder` / `upload_large_folder` (they split commits and only the first gets the parent);
* every write carries a nonce in its title. `create_commit` returns the *current head* without a
  server call when no file changed, so after each commit we check that the returned sha is new and
  that its parent (first page of the commit listing) is the parent we named;
* 412 -> CasLost, 409 -> CommitLockBusy, 429 -> RateLimited(retry_after_s),
  5xx / timeout / dropped connection -> look for the nonce in the commits newer than the parent:
  found -> the write landed (return its sha); not found -> OutcomeUnknown;
* the touched paths are read back at the new sha: a tree that lacks what was sent is
  CommitNotVerified (why the client can drop files: commit.py).

The operations themselves (relay operations as huggingface_hub ones, prepared once, and the
check of a landed tree) are commit.py's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from ..errors import (
    CasLost,
    CommitLockBusy,
    CommitNotVerified,
    OutcomeUnknown,
    PathIgnored,
    RateLimited,
    RevisionNotFound,
    StoreError,
    StoreNotFound,
)
from ..store import CopyFile, Operation, PutFile, check_full_sha, title_with_nonce
from .commit import PreparedOps, file_size, ignored_paths, inline_bytes, landed_problems, to_hub_ops
from .errors import first_line, retry_after
from .reader import HubReader


class HubCasCommit:
    """`prepare`, `inline_bytes` and `commit` of the RelayStore interface on the Hub repo of
    `reader`, through `api`; what it checks after a commit is read through `reader`."""

    def __init__(self, api: HfApi, reader: HubReader):
        self.api = api
        self.reader = reader
        self.repo_id = reader.repo_id
        self.spec = reader.spec
        self._prepared = PreparedOps()

    def prepare(self, operations: Sequence[Operation]) -> None:
        """Fetch upload modes for every added file and upload the LFS ones now (no visible change);
        the commit reuses these operations, so a retry uploads nothing again. Paths the repo's
        .gitignore matches would be dropped from the commit without a word: PathIgnored."""
        self._prepared.clear()
        adds = [self._prepared.add(op) for op in operations if isinstance(op, PutFile)]
        if not adds:
            return
        try:
            self.api.preupload_lfs_files(self.repo_id, additions=adds, revision="main")
        except Exception as exc:  # noqa: BLE001
            self._prepared.clear()
            raise self.reader.error(exc, "pre-upload") from None
        for add in adds:
            # The answer's oid describes the branch head of that moment (maybe a stale one), not the
            # parent we will commit on; with it the client would drop the file as "unchanged"
            # (huggingface_hub#2389). A prepared file always travels: at worst it rewrites the same bytes.
            # NOTE: `_remote_oid` is the client's own private field; it offers no public way to say so.
            add._remote_oid = None
        ignored = ignored_paths(adds)
        if ignored:
            self._prepared.clear()
            raise PathIgnored(f"{self.spec}: the repo's .gitignore matches {', '.join(ignored[:5])}: the Hub would "
                              f"leave {'them' if len(ignored) > 1 else 'it'} out of the commit", ignored)

    def inline_bytes(self, operations: Sequence[Operation]) -> int:
        ops = [op for op in operations if isinstance(op, PutFile)]
        hub_ops = [self._prepared.get(op) for op in ops]
        known = inline_bytes([h for h in hub_ops if h is not None])
        # Not prepared: the Hub decides at commit time; count them as inline (the safe side).
        return known + sum(file_size(op) * 4 // 3 for op, h in zip(ops, hub_ops, strict=True) if h is None)

    def commit(self, operations: Sequence[Operation], *, parent: str, message: str, nonce: str) -> str:
        check_full_sha(parent)
        title = title_with_nonce(message, nonce)
        hub_ops = to_hub_ops(operations, self._prepared)
        try:
            info = self.api.create_commit(self.repo_id, hub_ops, commit_message=title,
                                          parent_commit=parent, revision="main")
        except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
            # Before HfHubHTTPError: both are subclasses of it, and a 404 on commit means no repo.
            raise self.reader.error(exc, "commit") from None
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            if status == 412:
                raise CasLost(f"{self.spec}: head moved away from parent {parent[:12]} (HTTP 412)") from None
            if status == 409:
                raise CommitLockBusy(f"{self.spec}: commit lock busy (HTTP 409)") from None
            if status == 429:
                raise RateLimited(f"{self.spec}: commit rate limited (HTTP 429): {first_line(exc)}",
                                  retry_after(exc)) from None
            if status is not None and status < 500:
                raise StoreError(f"{self.spec}: commit refused (HTTP {status}): {first_line(exc)}") from None
            sha = self._resolve_unknown(parent, nonce, f"HTTP {status}")
        except (OSError, ValueError, RuntimeError) as exc:
            if isinstance(exc, ValueError) and "parent_commit" in str(exc):
                raise
            sha = self._resolve_unknown(parent, nonce, f"{type(exc).__name__}")
        except Exception as exc:  # noqa: BLE001 - transport errors of the HTTP library (timeouts, resets)
            sha = self._resolve_unknown(parent, nonce, f"{type(exc).__name__}")
        else:
            sha = info.oid
            if sha == parent:
                # create_commit skipped the server (no file changed) and returned the head.
                raise StoreError(f"{self.spec}: commit made no change (every relay write must carry a nonce)")
            self._check_parent(sha, parent)
        self._verify_landed(sha, operations, hub_ops)
        return sha

    def _verify_landed(self, sha: str, operations: Sequence[Operation], hub_ops: list) -> None:
        """Read the touched paths back at `sha`; CommitNotVerified if the tree lacks what we sent."""
        paths = [op.path for op in operations]
        copies = [op for op in operations if isinstance(op, CopyFile)]
        for attempt in range(3):
            try:
                tree = self.reader.paths_info(paths, sha)
                sources = {}
                for op in copies:
                    sources.update(self.reader.paths_info([op.path], op.src_revision))
                break
            except StoreError as exc:
                last = exc
                time.sleep(0.2 * (attempt + 1))
        else:
            raise OutcomeUnknown(f"{self.spec}: commit {sha[:12]} landed but its tree could not be read back "
                                 f"to check it ({last})")
        problems = landed_problems(operations, hub_ops, tree, sources)
        if problems:
            raise CommitNotVerified(f"{self.spec}: commit {sha[:12]} landed without what was sent: "
                                    f"{'; '.join(problems[:5])}", sha, problems)

    def _check_parent(self, sha: str, parent: str) -> None:
        # The server enforces parentCommit too; this read is the client's own proof. If it keeps
        # failing, say the outcome is unknown: the lease writer then looks for its nonce.
        for attempt in range(3):
            try:
                items, _ = self.reader.commits_page(sha, limit=2)  # the commit and its parent
                break
            except Exception as exc:  # noqa: BLE001 - any transport or server error: retry
                last = exc
                time.sleep(0.2 * (attempt + 1))
        else:
            raise OutcomeUnknown(f"{self.spec}: commit {sha[:12]} landed but its parent could not be read "
                                 f"back to check it ({last})")
        if len(items) < 2 or items[0]["id"] != sha or items[1]["id"] != parent:
            got = items[1]["id"] if len(items) > 1 else None
            raise CasLost(f"{self.spec}: new commit {sha[:12]} has parent {str(got)[:12]}, not {parent[:12]}")

    def _resolve_unknown(self, parent: str, nonce: str, why: str) -> str:
        """The write may have landed: look for our nonce among the commits newer than `parent`.

        Head reads may be stale, so "not found" only counts when the walk from the head reached
        `parent` (the head is at or past it): then a head past `parent` without our nonce means
        our commit can no longer land (CasLost). Otherwise we cannot tell (OutcomeUnknown)."""
        for attempt in range(4):
            try:
                recs = self.reader.history(stop_at=parent)
            except (StoreNotFound, RevisionNotFound, RateLimited, StoreError):
                recs = []
            for rec in recs:
                if rec.nonce == nonce:
                    if rec.parent != parent:
                        raise CasLost(f"{self.spec}: our commit {rec.sha[:12]} landed on an unexpected parent")
                    return rec.sha
            if recs and recs[-1].sha == parent and recs[0].sha != parent:
                raise CasLost(f"{self.spec}: head moved past {parent[:12]} without our commit ({why})")
            time.sleep(0.1 * (attempt + 1))
        raise OutcomeUnknown(f"{self.spec}: commit outcome unknown ({why}); nonce {nonce} not found in history")
