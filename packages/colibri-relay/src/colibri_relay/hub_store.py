"""`HubStore`: the RelayStore interface on a Hugging Face Hub model repo, via the unmodified client.

- hub_store.py       the store: reads (head, files, downloads, the commit listing) and tags
- hub_cas_commit.py  its writes: prepare, the one CAS commit on a named parent, the nonce look-up
                     after an unknown outcome, the checks of what landed (the rules are listed there)
- hub_commit.py      relay operations as huggingface_hub ones; the check of a landed tree
- hub_errors.py      what the Hub's error answers mean (429 waits, messages)

Reads: downloads are pinned to a full sha and verified (sha256 for LFS files, the git blob sha1
for regular files) before they replace anything in the destination.

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
    ChecksumMismatch,
    FileNotFoundInStore,
    RateLimited,
    RevisionNotFound,
    StoreError,
    StoreNotFound,
    TagExists,
)
from .hub_cas_commit import HubCasCommits, retry_after
from .hub_commit import PATHS_INFO_BATCH, PreparedOps
from .store import SHA_RE, CommitRecord, FileInfo, RelayStore, git_blob_sha1


class HubStore(HubCasCommits, RelayStore):
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
            return RateLimited(f"{what}: rate limited by the Hub", retry_after(exc))
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

    # --- tags ----------------------------------------------------------------------------------
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
