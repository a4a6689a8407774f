"""`HubStore`: the RelayStore interface on a Hugging Face Hub model repo, via the unmodified client.

Rules this file enforces (why: see RELAY.md, "Why these rules"):

* every write is ONE `HfApi.create_commit(parent_commit=<full 40-hex sha>)`; never
  `upload_folder` / `upload_large_folder` (they split commits and only the first gets the parent);
* every write carries a nonce in its title. `create_commit` returns the *current head* without a
  server call when no file changed, so after each commit we check that the returned sha is new and
  that its parent (first page of the commit listing) is the parent we named;
* 412 -> CasLost, 409 -> CommitLockBusy, 429 -> RateLimited(retry_after_s),
  5xx / timeout / dropped connection -> look for the nonce in the commits newer than the parent:
  found -> the write landed (return its sha); not found -> OutcomeUnknown;
* downloads are pinned to a full sha and verified: sha256 for LFS files, the git blob sha1 for
  regular files, before they replace anything in the destination.

The token is handed to HfApi only; it is never printed, logged or stored by this package.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from .errors import (
    CasLost,
    ChecksumMismatch,
    CommitLockBusy,
    CommitNotVerified,
    FileNotFoundInStore,
    OutcomeUnknown,
    PathIgnored,
    RateLimited,
    RevisionNotFound,
    StoreError,
    StoreNotFound,
    TagExists,
)
from .hub_commit import (
    PATHS_INFO_BATCH,
    PreparedOps,
    file_size,
    ignored_paths,
    inline_bytes,
    landed_problems,
    to_hub_ops,
)
from .hub_errors import error_text, first_line, retry_after_s
from .store import (
    SHA_RE,
    CommitRecord,
    CopyFile,
    FileInfo,
    Operation,
    PutFile,
    RelayStore,
    check_full_sha,
    git_blob_sha1,
    title_with_nonce,
)


def _retry_after(err: HfHubHTTPError) -> float:
    return retry_after_s(err.response.headers if err.response is not None else {}, error_text(err))


class HubStore(RelayStore):
    """A relay store in the Hub model repo `repo_id`.

    >>> store = HubStore("me/my-run", endpoint="http://127.0.0.1:8123")   # doctest: +SKIP
    >>> store.create(); store.head()                                       # doctest: +SKIP
    """

    def __init__(self, repo_id: str, *, endpoint: str | None = None, token: str | None = None,
                 api: HfApi | None = None):
        self.repo_id = repo_id
        self.spec = f"hf://{repo_id}"
        self.api = api or HfApi(endpoint=endpoint, token=token)
        self._token = token
        self._prepared = PreparedOps()

    def __repr__(self) -> str:  # never show the token
        return f"HubStore({self.repo_id!r}, endpoint={self.api.endpoint!r})"

    def _read_error(self, exc: Exception, what: str, path: str | None = None, revision: str | None = None):
        if isinstance(exc, RepositoryNotFoundError):
            return StoreNotFound(f"Hub repo {self.repo_id} not found at {self.api.endpoint}")
        if isinstance(exc, RevisionNotFoundError):
            return RevisionNotFound(f"revision {revision} not found in {self.repo_id}")
        if isinstance(exc, EntryNotFoundError) and path is not None:
            return FileNotFoundInStore(path, revision or "?")
        if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code == 429:
            return RateLimited(f"{what}: rate limited by the Hub", _retry_after(exc))
        return StoreError(f"{what} on {self.repo_id} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")

    # --- reads ---------------------------------------------------------------------------------
    def create(self) -> str:
        try:
            self.api.create_repo(self.repo_id, repo_type="model", exist_ok=True)
        except HfHubHTTPError as exc:
            raise self._read_error(exc, "create repo") from None
        return self.head()

    def head(self) -> str:
        try:
            return self.api.model_info(self.repo_id, revision="main").sha
        except Exception as exc:  # noqa: BLE001 - mapped to typed errors
            raise self._read_error(exc, "read head", revision="main") from None

    def _resolve(self, revision: str) -> str:
        if SHA_RE.match(revision):
            return revision
        try:
            return self.api.model_info(self.repo_id, revision=revision).sha
        except Exception as exc:  # noqa: BLE001
            raise self._read_error(exc, "resolve revision", revision=revision) from None

    def list_files(self, revision: str) -> dict[str, FileInfo]:
        sha = self._resolve(revision)
        try:
            entries = self.api.list_repo_tree(self.repo_id, revision=sha, recursive=True)
            out = {}
            for e in entries:
                if hasattr(e, "blob_id"):
                    out[e.path] = FileInfo(e.path, e.size, e.lfs.sha256 if e.lfs else None, e.blob_id)
            return out
        except Exception as exc:  # noqa: BLE001
            raise self._read_error(exc, "list files", revision=sha) from None

    def _info(self, path: str, sha: str) -> FileInfo:
        try:
            infos = self.api.get_paths_info(self.repo_id, [path], revision=sha)
        except Exception as exc:  # noqa: BLE001
            raise self._read_error(exc, "paths-info", path, sha) from None
        for e in infos:
            if e.path == path and hasattr(e, "blob_id"):
                return FileInfo(path, e.size, e.lfs.sha256 if e.lfs else None, e.blob_id)
        raise FileNotFoundInStore(path, sha)

    def _download_one(self, path: str, sha: str, staging: Path) -> Path:
        info = self._info(path, sha)
        try:
            local = Path(hf_hub_download(self.repo_id, path, revision=sha, local_dir=staging,
                                         endpoint=self.api.endpoint, token=self._token))
        except Exception as exc:  # noqa: BLE001
            raise self._read_error(exc, f"download {path}", path, sha) from None
        where = f"{self.spec}@{sha[:12]}"
        if info.sha256:
            h = hashlib.sha256()
            with open(local, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
            if h.hexdigest() != info.sha256:
                raise ChecksumMismatch(path, where, info.sha256, h.hexdigest(), local.stat().st_size)
        else:
            actual = git_blob_sha1(local.read_bytes())
            if actual != info.git_oid:
                raise ChecksumMismatch(path, where, str(info.git_oid), actual, local.stat().st_size)
        return local

    def read_file(self, path: str, revision: str) -> bytes:
        sha = self._resolve(revision)
        staging = Path(tempfile.mkdtemp(prefix="relay-read-"))
        try:
            return self._download_one(path, sha, staging).read_bytes()
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def download(self, paths: list[str], revision: str, dest_dir: Path) -> dict[str, Path]:
        sha = self._resolve(revision)
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".relay-download-", dir=dest_dir))
        try:
            fetched = {p: self._download_one(p, sha, staging) for p in paths}
            out = {}
            for p, local in fetched.items():  # only after every file verified
                target = dest_dir / p
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(local, target)
                out[p] = target
            return out
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _commits_page(self, revision: str, url: str | None = None, limit: int | None = None) -> tuple[list[dict], str | None]:
        """One page of the commit listing and the next page's URL from the `Link` header (the
        public client only offers the whole list, which a parent check does not need)."""
        url = url or f"{self.api.endpoint}/api/models/{self.repo_id}/commits/{revision}" + (
            f"?limit={limit}" if limit else "")
        resp = get_session().get(url, headers=build_hf_headers(token=self._token))
        hf_raise_for_status(resp)
        return resp.json(), resp.links.get("next", {}).get("url")

    def history(self, revision: str | None = None, *, stop_at: str | None = None) -> list[CommitRecord]:
        rev = self._resolve(revision) if revision else self.head()
        out: list[CommitRecord] = []
        next_url: str | None = None
        try:
            while True:
                items, next_url = self._commits_page(rev, next_url)
                for item in items:
                    rec = CommitRecord(item["id"], item.get("title", ""), item.get("date", ""))
                    if out:  # the listing is linear: each commit's parent is the next one
                        prev = out[-1]
                        out[-1] = CommitRecord(prev.sha, prev.title, prev.timestamp, rec.sha)
                    out.append(rec)
                    if rec.sha == stop_at:
                        return out
                if not next_url:
                    return out
        except Exception as exc:  # noqa: BLE001
            raise self._read_error(exc, "list commits", revision=rev) from None

    # --- writes --------------------------------------------------------------------------------
    def prepare(self, operations: list[Operation]) -> None:
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
            raise self._read_error(exc, "pre-upload") from None
        for add in adds:
            # The answer's oid describes the branch head of that moment (maybe a stale one), not the
            # parent we will commit on; with it the client would drop the file as "unchanged"
            # (huggingface_hub#2389). A prepared file always travels: at worst it rewrites the same bytes.
            add._remote_oid = None
        ignored = ignored_paths(adds)
        if ignored:
            self._prepared.clear()
            raise PathIgnored(f"{self.spec}: the repo's .gitignore matches {', '.join(ignored[:5])}: the Hub would "
                              f"leave {'them' if len(ignored) > 1 else 'it'} out of the commit", ignored)

    def inline_bytes(self, operations: list[Operation]) -> int:
        ops = [op for op in operations if isinstance(op, PutFile)]
        hub_ops = [self._prepared.get(op) for op in ops]
        known = inline_bytes([h for h in hub_ops if h is not None])
        # Not prepared: the Hub decides at commit time; count them as inline (the safe side).
        return known + sum(file_size(op) * 4 // 3 for op, h in zip(ops, hub_ops, strict=True) if h is None)

    def commit(self, operations: list[Operation], *, parent: str, message: str, nonce: str) -> str:
        check_full_sha(parent)
        title = title_with_nonce(message, nonce)
        hub_ops = to_hub_ops(operations, self._prepared)
        try:
            info = self.api.create_commit(self.repo_id, hub_ops, commit_message=title,
                                          parent_commit=parent, revision="main")
        except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
            # Before HfHubHTTPError: both are subclasses of it, and a 404 on commit means no repo.
            raise self._read_error(exc, "commit") from None
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            if status == 412:
                raise CasLost(f"{self.spec}: head moved away from parent {parent[:12]} (HTTP 412)") from None
            if status == 409:
                raise CommitLockBusy(f"{self.spec}: commit lock busy (HTTP 409)") from None
            if status == 429:
                raise RateLimited(f"{self.spec}: commit rate limited (HTTP 429): {first_line(exc)}",
                                  _retry_after(exc)) from None
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

    def _verify_landed(self, sha: str, operations: list[Operation], hub_ops: list) -> None:
        """Read the touched paths back at `sha`; CommitNotVerified if the tree lacks what we sent."""
        paths = [op.path for op in operations]
        copies = [op for op in operations if isinstance(op, CopyFile)]
        for attempt in range(3):
            try:
                tree = self._paths_info(paths, sha)
                sources = {}
                for op in copies:
                    sources.update(self._paths_info([op.path], op.src_revision))
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

    def _paths_info(self, paths: list[str], sha: str) -> dict[str, FileInfo]:
        out: dict[str, FileInfo] = {}
        for i in range(0, len(paths), PATHS_INFO_BATCH):
            try:
                infos = self.api.get_paths_info(self.repo_id, paths[i:i + PATHS_INFO_BATCH], revision=sha)
            except Exception as exc:  # noqa: BLE001
                raise self._read_error(exc, "paths-info", revision=sha) from None
            for e in infos:
                if hasattr(e, "blob_id"):
                    out[e.path] = FileInfo(e.path, e.size, e.lfs.sha256 if e.lfs else None, e.blob_id)
        return out

    def _check_parent(self, sha: str, parent: str) -> None:
        # The server enforces parentCommit too; this read is the client's own proof. If it keeps
        # failing, say the outcome is unknown: the lease writer then looks for its nonce.
        for attempt in range(3):
            try:
                items, _ = self._commits_page(sha, limit=2)  # the commit and its parent
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
                recs = self.history(stop_at=parent)
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

    def create_tag(self, tag: str, revision: str) -> None:
        """Create `tag`; done if it already points at `revision`. The Hub answers 409 both for an
        existing tag and while its ref lock is busy, and tag listings may be stale, so a 409 is
        re-read and retried: only a tag seen pointing ELSEWHERE is TagExists."""
        for attempt in range(6):
            try:
                self.api.create_tag(self.repo_id, tag=tag, revision=revision)
                return
            except HfHubHTTPError as exc:
                if exc.response is None or exc.response.status_code != 409:
                    raise self._read_error(exc, f"create tag {tag}") from None
            try:
                target = self.list_tags().get(tag)
            except StoreError:
                target = None
            if target == revision:
                return
            if target is not None:
                raise TagExists(tag, target)
            time.sleep(0.1 * (attempt + 1))
        raise StoreError(f"{self.spec}: tag {tag} answered 409 six times and is not listed; try again later")

    def list_tags(self) -> dict[str, str]:
        try:
            refs = self.api.list_repo_refs(self.repo_id)
        except Exception as exc:  # noqa: BLE001
            raise self._read_error(exc, "list refs") from None
        return {t.name: t.target_commit for t in refs.tags}
