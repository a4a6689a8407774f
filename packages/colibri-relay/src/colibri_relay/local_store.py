"""`LocalStore`: the RelayStore semantics on a plain directory (local disk or a shared filesystem).

Layout (spec: RELAY.md, "LocalStore layout"):

    ROOT/store.json              {"store_version": "1.0"}
    ROOT/blobs/ab/<sha256>       content-addressed file contents (immutable)
    ROOT/commits/<sha>.json      one commit: parent, message, timestamp, tree {path: {sha256, size}}
    ROOT/refs/main               the head sha (replaced by atomic rename)
    ROOT/refs/tags/<name>        one file per tag (created with O_EXCL: never overwritten)
    ROOT/lock                    the commit lock (filelock; released by the OS if the holder dies)

A commit writes its blobs first (outside the lock, atomic renames), then under the lock checks the
head, writes the commit file and swaps `refs/main`. A process killed at any point leaves either the
old head or the new one, plus perhaps unreferenced blobs/commits (harmless garbage).
Trade-off: every commit stores the full tree (a few hundred bytes per file), which keeps reads at a
revision one file open; relays have tens of files, so this is cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from colibri_spec import require_major
from filelock import FileLock, Timeout

from .errors import (
    CasLost,
    ChecksumMismatch,
    CommitLockBusy,
    FileNotFoundInStore,
    OutcomeUnknown,
    RevisionNotFound,
    StoreError,
    StoreNotFound,
    TagExists,
)
from .store import (
    SHA_RE,
    CommitRecord,
    CopyFile,
    DeleteFile,
    FileInfo,
    Operation,
    PutFile,
    RelayStore,
    title_with_nonce,
)

STORE_VERSION = "1.0"


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(RelayStore):
    """A relay store in a directory. `lock_timeout_s` bounds the wait for the commit lock."""

    def __init__(self, root: Path | str, *, lock_timeout_s: float = 10.0):
        self.root = Path(root)
        self.spec = str(self.root)
        self.lock_timeout_s = lock_timeout_s
        self._prepared: dict[tuple, dict] = {}
        self._checked = False

    def __repr__(self) -> str:
        return f"LocalStore({self.spec!r})"

    # --- layout --------------------------------------------------------------------------------
    def _blob(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256[:2] / sha256

    def _check_exists(self) -> None:
        if self._checked:
            return
        meta = self.root / "store.json"
        if not meta.is_file():
            raise StoreNotFound(f"{self.root} is not a relay store (no store.json); run `colibri-relay init`")
        try:
            found = json.loads(meta.read_text())["store_version"]
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{meta} is corrupt ({exc!r})") from None
        require_major(found, STORE_VERSION, key="store_version", where=str(meta), reader="colibri-relay",
                      error=StoreError)
        self._checked = True

    def create(self) -> str:
        for sub in ("blobs", "commits", "refs/tags", "tmp"):
            try:
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"{self.root}: cannot create a store here ({exc.strerror})") from None
        with FileLock(str(self.root / "lock")):
            if not (self.root / "refs" / "main").exists():
                sha = self._write_commit(None, {}, "initial commit")
                _atomic_write(self.root / "refs" / "main", sha.encode())
            if not (self.root / "store.json").exists():
                _atomic_write(self.root / "store.json", json.dumps({"store_version": STORE_VERSION}).encode())
        return self.head()

    def head(self) -> str:
        self._check_exists()
        try:
            sha = (self.root / "refs" / "main").read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise StoreError(f"{self.root}/refs/main is unreadable ({exc})") from None
        if not SHA_RE.match(sha):
            raise StoreError(f"{self.root}/refs/main is corrupt: {sha[:60]!r}")
        return sha

    def _resolve(self, revision: str) -> str:
        self._check_exists()
        if revision == "main":
            return self.head()
        if SHA_RE.match(revision):
            if (self.root / "commits" / f"{revision}.json").exists():
                return revision
            raise RevisionNotFound(f"revision {revision} not found in {self.root}")
        tag = self.root / "refs" / "tags" / revision
        if tag.is_file():
            return tag.read_text().strip()
        raise RevisionNotFound(f"revision {revision!r} not found in {self.root}")

    def _load_commit(self, sha: str) -> dict:
        path = self.root / "commits" / f"{sha}.json"
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise RevisionNotFound(f"commit {sha} not found in {self.root}") from None
        except ValueError as exc:
            raise StoreError(f"{path} is corrupt: {exc}") from None
        except OSError as exc:
            raise StoreError(f"{path} is unreadable ({exc.strerror})") from None
        # A hand-edited or partly copied store must fail here, in one line, not deep in a reader.
        tree = data.get("tree") if isinstance(data, dict) else None
        if not isinstance(tree, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("size"), int)
            for e in tree.values()
        ):
            raise StoreError(f"{path} is corrupt: not a commit with a tree of {{path: {{sha256, size}}}}")
        return data

    def _write_commit(self, parent: str | None, tree: dict, title: str) -> str:
        body = {
            "parent": parent,
            "title": title,
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "tree": tree,
        }
        raw = json.dumps(body, sort_keys=True).encode()
        sha = hashlib.sha1(raw).hexdigest()
        _atomic_write(self.root / "commits" / f"{sha}.json", raw)
        return sha

    # --- reads ---------------------------------------------------------------------------------
    def list_files(self, revision: str) -> dict[str, FileInfo]:
        tree = self._load_commit(self._resolve(revision))["tree"]
        return {p: FileInfo(p, e["size"], sha256=e["sha256"]) for p, e in tree.items()}

    def _entry(self, path: str, revision: str) -> tuple[str, dict]:
        sha = self._resolve(revision)
        entry = self._load_commit(sha)["tree"].get(path)
        if entry is None:
            raise FileNotFoundInStore(path, revision)
        return sha, entry

    def read_file(self, path: str, revision: str) -> bytes:
        sha, entry = self._entry(path, revision)
        try:
            data = self._blob(entry["sha256"]).read_bytes()
        except OSError as exc:
            raise StoreError(f"{self.root}: blob of {path} at {sha[:12]} is missing or unreadable "
                             f"({exc.strerror}); the store is damaged") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != entry["sha256"]:
            raise ChecksumMismatch(path, f"{self.root}@{sha[:12]}", entry["sha256"], actual, len(data))
        return data

    def download(self, paths: list[str], revision: str, dest_dir: Path) -> dict[str, Path]:
        dest_dir = Path(dest_dir)
        out = {}
        for path in paths:
            sha, entry = self._entry(path, revision)
            target = dest_dir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".relay-dl-")
            try:
                h = hashlib.sha256()
                try:
                    src = open(self._blob(entry["sha256"]), "rb")  # noqa: SIM115 - closed below
                except OSError as exc:
                    os.close(fd)
                    raise StoreError(f"{self.root}: blob of {path} at {sha[:12]} is missing or unreadable "
                                     f"({exc.strerror}); the store is damaged") from None
                with src, os.fdopen(fd, "wb") as dst:
                    while block := src.read(1 << 20):
                        h.update(block)
                        dst.write(block)
                if h.hexdigest() != entry["sha256"]:
                    raise ChecksumMismatch(path, f"{self.root}@{sha[:12]}", entry["sha256"], h.hexdigest())
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            out[path] = target
        return out

    def history(self, revision: str | None = None, *, stop_at: str | None = None) -> list[CommitRecord]:
        sha: str | None = self._resolve(revision) if revision else self.head()
        out = []
        while sha:
            c = self._load_commit(sha)
            out.append(CommitRecord(sha, c["title"], c["timestamp"], c["parent"]))
            if sha == stop_at:
                break
            sha = c["parent"]
        return out

    # --- writes --------------------------------------------------------------------------------
    def _store_blob(self, op: PutFile) -> dict:
        """Copy the content into blobs/ (atomic rename); return its tree entry."""
        tmp_dir = self.root / "tmp"
        fd, tmp = tempfile.mkstemp(dir=tmp_dir, prefix="blob-")
        try:
            h = hashlib.sha256()
            size = 0
            with os.fdopen(fd, "wb") as dst:
                if isinstance(op.source, bytes):
                    h.update(op.source)
                    dst.write(op.source)
                    size = len(op.source)
                else:
                    with open(op.source, "rb") as src:
                        while block := src.read(1 << 20):
                            h.update(block)
                            dst.write(block)
                            size += len(block)
                dst.flush()
                os.fsync(dst.fileno())
            digest = h.hexdigest()
            blob = self._blob(digest)
            if not blob.exists():
                blob.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, blob)
            return {"sha256": digest, "size": size}
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @staticmethod
    def _source_key(op: PutFile) -> tuple | None:
        if isinstance(op.source, bytes):
            return None
        st = os.stat(op.source)
        return (str(op.source), st.st_size, st.st_mtime_ns)

    def prepare(self, operations: Sequence[Operation]) -> None:
        """Copy large file contents into blobs/ now, so the commit itself is quick."""
        self._check_exists()
        for op in operations:
            if isinstance(op, PutFile) and (key := self._source_key(op)) is not None:
                self._prepared[key] = self._store_blob(op)

    def _entry_for(self, op: PutFile) -> dict:
        key = self._source_key(op)
        entry = self._prepared.pop(key, None) if key is not None else None
        if entry is not None and self._blob(entry["sha256"]).exists():
            return entry
        return self._store_blob(op)

    def commit(self, operations: Sequence[Operation], *, parent: str, message: str, nonce: str) -> str:
        self._check_exists()
        try:
            return self._commit_locked(operations, parent, message, nonce)
        except OSError as exc:
            # An I/O error may come after refs/main was renamed (the directory fsync, a flaky NFS
            # reply): the commit may have landed. Like a 5xx on the Hub, resolve it by the nonce.
            return self._resolve_unknown(parent, nonce, f"{type(exc).__name__}: {exc}")

    def _resolve_unknown(self, parent: str, nonce: str, why: str) -> str:
        try:
            recs = self.history(stop_at=parent)
        except (OSError, StoreError) as exc:
            recs, why = [], f"{why}; reading the history back failed too ({exc})"
        for rec in recs:
            if rec.nonce == nonce:
                if rec.parent != parent:
                    raise CasLost(f"{self.root}: our commit {rec.sha[:12]} landed on an unexpected parent")
                return rec.sha
        raise OutcomeUnknown(f"{self.root}: commit outcome unknown ({why}); nonce {nonce} not found")

    def _commit_locked(self, operations: Sequence[Operation], parent: str, message: str, nonce: str) -> str:
        entries = {op.path: self._entry_for(op) for op in operations if isinstance(op, PutFile)}
        try:
            lock = FileLock(str(self.root / "lock"), timeout=self.lock_timeout_s)
            lock.acquire()
        except Timeout:
            raise CommitLockBusy(f"commit lock of {self.root} busy for {self.lock_timeout_s}s") from None
        try:
            head = self.head()
            if head != parent:
                raise CasLost(f"head of {self.root} is {head[:12]}, not the expected parent {parent[:12]}")
            tree = dict(self._load_commit(head)["tree"])
            for op in operations:
                if isinstance(op, DeleteFile):
                    if tree.pop(op.path, None) is None:
                        raise StoreError(f"cannot delete {op.path}: not in the tree at {head[:12]}")
                elif isinstance(op, CopyFile):
                    source = self._load_commit(self._resolve(op.src_revision))["tree"].get(op.path)
                    if source is None:
                        raise StoreError(f"cannot copy {op.path}: not in the tree at {op.src_revision[:12]}")
                    tree[op.path] = source  # blobs are immutable and content-addressed: share it
                else:
                    tree[op.path] = entries[op.path]
            # A timestamp in the body keeps two identical commits apart (nonce already does too).
            sha = self._write_commit(head, tree, title_with_nonce(message, nonce))
            _atomic_write(self.root / "refs" / "main", sha.encode())
            _fsync_dir(self.root / "refs")  # the rename itself is durable only once its directory is
            return sha
        finally:
            lock.release()

    def create_tag(self, tag: str, revision: str) -> None:
        sha = self._resolve(revision)
        path = self.root / "refs" / "tags" / tag
        if "/" in tag or tag in ("", ".", ".."):
            raise StoreError(f"bad tag name {tag!r}")
        tmp = self.root / "tmp" / f"tag-{tag}-{os.getpid()}-{time.monotonic_ns()}"
        tmp.write_text(sha)
        try:
            # link() fails if the tag exists: creation is atomic and never overwrites.
            os.link(tmp, path)
        except FileExistsError:
            target = path.read_text().strip()
            if target != sha:
                raise TagExists(tag, target) from None
        finally:
            tmp.unlink()

    def list_tags(self) -> dict[str, str]:
        self._check_exists()
        tags_dir = self.root / "refs" / "tags"
        return {p.name: p.read_text().strip() for p in sorted(tags_dir.iterdir()) if not p.name.startswith(".")}

    def destroy(self) -> None:
        """Remove the whole store directory (tests)."""
        shutil.rmtree(self.root, ignore_errors=True)
