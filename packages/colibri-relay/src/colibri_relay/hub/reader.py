"""`HubReader`: the reads of one Hub repo, as HubStore and its commit side (cas_commit.py) use them.

Head and revisions, trees (`list_repo_tree`, paths-info in batches), downloads pinned to a full sha
and verified (sha256 for LFS files, the git blob sha1 for regular files) before they replace
anything in the destination, the commit listing (paged by its `Link` header) and the tags. Every
failure is a typed error (errors.py).

The token goes to the client's requests only; it is never printed or logged, and no repr shows it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from ..errors import ChecksumMismatch, FileNotFoundInStore, StoreError
from ..store import SHA_RE, CommitRecord, FileInfo, git_blob_sha1
from .commit import PATHS_INFO_BATCH
from .errors import read_error


class HubReader:
    """Reads of the Hub model repo `repo_id` through `api` (see the module docstring).

    Attributes:
        api: the huggingface_hub client (shared with the store's writes).
        repo_id: OWNER/REPO.
        spec: `hf://OWNER/REPO`, for messages.
    """

    def __init__(self, api: HfApi, repo_id: str, *, token: str | None = None):
        self.api = api
        self.repo_id = repo_id
        self.spec = f"hf://{repo_id}"
        self._token = token

    def __repr__(self) -> str:  # never show the token
        return f"HubReader({self.repo_id!r}, endpoint={self.api.endpoint!r})"

    def error(self, exc: Exception, what: str, path: str | None = None, revision: str | None = None) -> StoreError:
        """The typed error for a failed request `what` on this repo (errors.read_error)."""
        return read_error(exc, what, repo_id=self.repo_id, endpoint=self.api.endpoint, path=path, revision=revision)

    def head(self) -> str:
        try:
            return self.api.model_info(self.repo_id, revision="main").sha
        except Exception as exc:  # noqa: BLE001 - mapped to typed errors
            raise self.error(exc, "read head", revision="main") from None

    def resolve(self, revision: str) -> str:
        """The full sha of `revision` (a full sha is returned as is, without a request)."""
        if SHA_RE.match(revision):
            return revision
        try:
            return self.api.model_info(self.repo_id, revision=revision).sha
        except Exception as exc:  # noqa: BLE001
            raise self.error(exc, "resolve revision", revision=revision) from None

    def list_files(self, revision: str) -> dict[str, FileInfo]:
        sha = self.resolve(revision)
        try:
            entries = self.api.list_repo_tree(self.repo_id, revision=sha, recursive=True)
            out = {}
            for e in entries:
                if hasattr(e, "blob_id"):
                    out[e.path] = FileInfo(e.path, e.size, e.lfs.sha256 if e.lfs else None, e.blob_id)
            return out
        except Exception as exc:  # noqa: BLE001
            raise self.error(exc, "list files", revision=sha) from None

    def file_info(self, path: str, sha: str) -> FileInfo:
        """One file's entry at `sha` (paths-info); FileNotFoundInStore if the tree has none."""
        try:
            infos = self.api.get_paths_info(self.repo_id, [path], revision=sha)
        except Exception as exc:  # noqa: BLE001
            raise self.error(exc, "paths-info", path, sha) from None
        for e in infos:
            if e.path == path and hasattr(e, "blob_id"):
                return FileInfo(path, e.size, e.lfs.sha256 if e.lfs else None, e.blob_id)
        raise FileNotFoundInStore(path, sha)

    def paths_info(self, paths: list[str], sha: str) -> dict[str, FileInfo]:
        """The entries of `paths` at `sha` that exist, `PATHS_INFO_BATCH` paths per request."""
        out: dict[str, FileInfo] = {}
        for i in range(0, len(paths), PATHS_INFO_BATCH):
            try:
                infos = self.api.get_paths_info(self.repo_id, paths[i:i + PATHS_INFO_BATCH], revision=sha)
            except Exception as exc:  # noqa: BLE001
                raise self.error(exc, "paths-info", revision=sha) from None
            for e in infos:
                if hasattr(e, "blob_id"):
                    out[e.path] = FileInfo(e.path, e.size, e.lfs.sha256 if e.lfs else None, e.blob_id)
        return out

    def _download_one(self, path: str, sha: str, staging: Path) -> Path:
        info = self.file_info(path, sha)
        try:
            local = Path(hf_hub_download(self.repo_id, path, revision=sha, local_dir=staging,
                                         endpoint=self.api.endpoint, token=self._token))
        except Exception as exc:  # noqa: BLE001
            raise self.error(exc, f"download {path}", path, sha) from None
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
        sha = self.resolve(revision)
        staging = Path(tempfile.mkdtemp(prefix="relay-read-"))
        try:
            return self._download_one(path, sha, staging).read_bytes()
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def download(self, paths: list[str], revision: str, dest_dir: Path) -> dict[str, Path]:
        sha = self.resolve(revision)
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

    def commits_page(self, revision: str, url: str | None = None, limit: int | None = None) -> tuple[list[dict], str | None]:
        """One page of the commit listing and the next page's URL from the `Link` header (the
        public client only offers the whole list, which a parent check does not need)."""
        url = url or f"{self.api.endpoint}/api/models/{self.repo_id}/commits/{revision}" + (
            f"?limit={limit}" if limit else "")
        resp = get_session().get(url, headers=build_hf_headers(token=self._token))
        hf_raise_for_status(resp)
        return resp.json(), resp.links.get("next", {}).get("url")

    def history(self, revision: str | None = None, *, stop_at: str | None = None) -> list[CommitRecord]:
        rev = self.resolve(revision) if revision else self.head()
        out: list[CommitRecord] = []
        next_url: str | None = None
        try:
            while True:
                items, next_url = self.commits_page(rev, next_url)
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
            raise self.error(exc, "list commits", revision=rev) from None

    def list_tags(self) -> dict[str, str]:
        try:
            refs = self.api.list_repo_refs(self.repo_id)
        except Exception as exc:  # noqa: BLE001
            raise self.error(exc, "list refs") from None
        return {t.name: t.target_commit for t in refs.tags}


__all__ = ["HubReader"]
