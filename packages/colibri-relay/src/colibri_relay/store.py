"""The `RelayStore` interface: a git-like, single-branch store with compare-and-swap commits.

Two implementations share it and the same test-suite: `HubStore` (a Hugging Face Hub model repo,
through the unmodified huggingface_hub client) and `LocalStore` (a directory: content-addressed
blobs, a commit log, a head file swapped under a file lock). The relay protocol only needs:

* `head()` - the full 40-hex sha of branch `main`;
* `commit(ops, parent=, message=, nonce=)` - lands all files or none, and raises `CasLost` when
  the head is not `parent`. The `nonce` is written into the commit title so an unknown outcome
  (5xx, timeout) can be resolved by finding it in the history;
* reads pinned to a full sha: `read_file`, `list_files`, `download` (all checksum-verified);
* `history()` (newest first, with display timestamps) and tags (`create_tag` fails if it exists).

Trade-off: only one branch (`main`) exists; that is all a relay needs and keeps both stores small.
"""

from __future__ import annotations

import hashlib
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SHA_RE = re.compile(r"^[0-9a-f]{40}$")
NONCE_TAG = "nonce:"


@dataclass(frozen=True)
class PutFile:
    """Add or replace `path` with `source` (bytes, or a local file path read at commit time)."""

    path: str
    source: bytes | Path

    def size(self) -> int:
        return len(self.source) if isinstance(self.source, bytes) else os.path.getsize(self.source)


@dataclass(frozen=True)
class DeleteFile:
    """Remove `path` from the tree."""

    path: str


@dataclass(frozen=True)
class CopyFile:
    """Set `path` to the file of the same path at `src_revision` (a full sha), without re-uploading
    large files: how a repair restores an older payload."""

    path: str
    src_revision: str


Operation = PutFile | DeleteFile | CopyFile


@dataclass(frozen=True)
class FileInfo:
    """One file of a tree. `sha256` is known for LFS files (Hub) and for every LocalStore file;
    `git_oid` (git blob sha1) is known for every Hub file."""

    path: str
    size: int
    sha256: str | None = None
    git_oid: str | None = None


@dataclass(frozen=True)
class CommitRecord:
    """One commit as listed by `history()`. `timestamp` is the server's clock: display only."""

    sha: str
    title: str
    timestamp: str
    parent: str | None = None

    @property
    def nonce(self) -> str | None:
        return nonce_in(self.title)


def nonce_in(title: str) -> str | None:
    """Extract the relay nonce written in a commit title as `[nonce:XXXX]`."""
    m = re.search(r"\[nonce:([0-9a-f]+)\]", title)
    return m.group(1) if m else None


def title_with_nonce(message: str, nonce: str) -> str:
    return f"{message} [{NONCE_TAG}{nonce}]"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as `oid` for regular files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_full_sha(revision: str) -> str:
    if not SHA_RE.match(revision or ""):
        raise ValueError(f"expected a full 40-hex commit sha, got {revision!r}")
    return revision


class RelayStore(ABC):
    """A single-branch store with compare-and-swap commits. See the module docstring."""

    spec: str

    @abstractmethod
    def create(self) -> str:
        """Create the store if it does not exist (idempotent); return the head sha."""

    @abstractmethod
    def head(self) -> str:
        """Full sha of branch main."""

    @abstractmethod
    def list_files(self, revision: str) -> dict[str, FileInfo]:
        """Every file of the tree at `revision` (a full sha or a tag)."""

    @abstractmethod
    def read_file(self, path: str, revision: str) -> bytes:
        """Content of `path` at `revision`, verified against its checksum."""

    @abstractmethod
    def download(self, paths: list[str], revision: str, dest_dir: Path) -> dict[str, Path]:
        """Download `paths` at `revision` into `dest_dir` (verified, each file replaced atomically)."""

    def prepare(self, operations: Sequence[Operation]) -> None:  # noqa: B027 - optional hook
        """Upload what can travel ahead of the commit (no visible change). Optional. Raises
        PathIgnored for paths the store would silently leave out of the commit."""

    def inline_bytes(self, operations: Sequence[Operation]) -> int:
        """Bytes of `operations` that will travel INSIDE the commit request (after `prepare`): what a
        holder must budget lease time for, since no renewal can land while its commit is in flight."""
        return 0

    @abstractmethod
    def commit(self, operations: Sequence[Operation], *, parent: str, message: str, nonce: str) -> str:
        """One atomic commit on main whose parent must be `parent`; returns the new sha.

        Raises CasLost, CommitLockBusy, RateLimited, OutcomeUnknown (after trying to resolve it)."""

    @abstractmethod
    def history(self, revision: str | None = None, *, stop_at: str | None = None) -> list[CommitRecord]:
        """Commits reachable from `revision` (default: head), newest first; stops after `stop_at`."""

    @abstractmethod
    def create_tag(self, tag: str, revision: str) -> None:
        """Create `tag` at `revision`; raises TagExists if it already exists."""

    @abstractmethod
    def list_tags(self) -> dict[str, str]:
        """Tag name -> commit sha."""

