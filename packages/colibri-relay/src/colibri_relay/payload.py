"""The payload: a directory of files (e.g. a checkpoint dir) pushed and pulled as one unit.

A push scans the directory (every regular file, recursively; names starting with '.' are skipped,
so tool caches and our own staging dirs never travel) and takes a SNAPSHOT: each file is read once,
hashed while it is read, and what was read is what gets uploaded (in memory up to
`SNAPSHOT_IN_MEMORY` bytes, else a private copy in a hidden staging dir beside the payload). A file a
checkpoint writer is still finishing can therefore never give a manifest that disagrees with the
upload. Trade-off: a large file costs one extra local copy for the duration of the push.

The manifest {path: sha256, size} goes into RELAY.json. A pull downloads into a staging dir, checks
every file against that manifest, and only then moves the files into place: a corrupt or truncated
download changes nothing. Files already in the destination with the manifest's sha256 (the LFS oid)
are not downloaded again. `tree_problems` checks a commit's tree against a manifest without
downloading large files (size and sha256 from the listing; small regular files are read).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ChecksumMismatch, FileNotFoundInStore, PayloadError
from .relay_state import PayloadFile
from .store import FileInfo, RelayStore, sha256_file

SNAPSHOT_IN_MEMORY = 8 * 1024 * 1024  # at most this many bytes per file are held in memory
REPAIR_HINT = "run `colibri-relay repair --store STORE` (or leg.repair()) to roll back to the last verified payload"

RESERVED = {"RELAY.json", "LEDGER.jsonl", "LEDGER.md", ".gitattributes", "README.md"}


def scan_payload(src_dir: Path) -> dict[str, Path]:
    """Relative posix path -> absolute path of every file to push."""
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        raise PayloadError(f"payload directory {src_dir} does not exist or is not a directory")
    files: dict[str, Path] = {}
    for root, dirs, names in os.walk(src_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith("."):
                continue
            full = Path(root) / name
            rel = full.relative_to(src_dir).as_posix()
            if rel in RESERVED:
                raise PayloadError(f"{full}: {rel} is reserved for the relay's own files; rename it")
            if full.is_file():
                files[rel] = full
    if not files:
        raise PayloadError(f"payload directory {src_dir} holds no files")
    return files


def build_manifest(files: dict[str, Path]) -> dict[str, PayloadFile]:
    return {rel: PayloadFile(sha256=sha256_file(p), size=p.stat().st_size) for rel, p in files.items()}


@dataclass
class Snapshot:
    """What a push uploads: per file the bytes (or a private copy) read once, and their manifest."""

    manifest: dict[str, PayloadFile] = field(default_factory=dict)
    sources: dict[str, bytes | Path] = field(default_factory=dict)
    staging: Path | None = None

    def close(self) -> None:
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None


def snapshot_payload(files: dict[str, Path], src_dir: Path) -> Snapshot:
    """Read every payload file ONCE, hashing what is read; keep exactly those bytes for the upload."""
    snap = Snapshot()
    try:
        for rel, path in files.items():
            h = hashlib.sha256()
            with open(path, "rb") as src:
                head = src.read(SNAPSHOT_IN_MEMORY + 1)
                h.update(head)
                if len(head) <= SNAPSHOT_IN_MEMORY:
                    snap.sources[rel] = head
                    size = len(head)
                else:
                    copy = _staging(snap, src_dir) / f"{len(snap.sources):06d}"
                    with open(copy, "wb") as dst:
                        dst.write(head)
                        size = len(head)
                        while block := src.read(1 << 20):
                            h.update(block)
                            dst.write(block)
                            size += len(block)
                    snap.sources[rel] = copy
            snap.manifest[rel] = PayloadFile(sha256=h.hexdigest(), size=size)
        return snap
    except BaseException:
        snap.close()
        raise


def _staging(snap: Snapshot, src_dir: Path) -> Path:
    if snap.staging is None:
        try:  # beside the payload: same filesystem, and skipped by scans (dot name)
            snap.staging = Path(tempfile.mkdtemp(prefix=".relay-push-", dir=src_dir))
        except OSError:
            snap.staging = Path(tempfile.mkdtemp(prefix="relay-push-"))
    return snap.staging


def entry_matches(info: FileInfo | None, meta: PayloadFile) -> bool | None:
    """True/False when the listing alone decides; None when only the content can (a Hub regular
    file: its listing gives a git sha1, the manifest a sha256)."""
    if info is None or info.size != meta.size:
        return False
    if info.sha256 is not None:
        return info.sha256 == meta.sha256
    return None


def tree_problems(store: RelayStore, revision: str, manifest: dict[str, PayloadFile],
                  files: dict[str, FileInfo] | None = None) -> list[str]:
    """What the tree at `revision` lacks of `manifest` (empty: it verifies). Large (LFS) files are
    checked by size and sha256 from the listing; regular files without a sha256 are read."""
    files = store.list_files(revision) if files is None else files
    problems = []
    for rel, meta in sorted(manifest.items()):
        ok = entry_matches(files.get(rel), meta)
        if ok is None:
            ok = hashlib.sha256(_read_verified(store, rel, revision)).hexdigest() == meta.sha256
        if not ok:
            got = files.get(rel)
            problems.append(f"{rel}: " + ("missing" if got is None else f"{got.size} bytes, not the manifest's "
                                          f"{meta.size} bytes / sha256 {meta.sha256[:12]}"))
    return problems


def pull_payload(store: RelayStore, revision: str, manifest: dict[str, PayloadFile], dest_dir: Path) -> dict[str, Path]:
    """Download the manifest's files at `revision` into `dest_dir`, verified before anything moves."""
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    if not manifest:
        return {}
    # Only what changed travels: a local file with the manifest's size and sha256 (the LFS oid) stays.
    wanted = sorted(rel for rel, meta in manifest.items() if not _local_matches(dest_dir / rel, meta))
    staging = Path(tempfile.mkdtemp(prefix=".relay-pull-", dir=dest_dir))
    try:
        try:
            got = store.download(wanted, revision, staging) if wanted else {}
        except (ChecksumMismatch, FileNotFoundInStore) as exc:
            exc.args = (f"{exc}; {REPAIR_HINT}",)  # the head names a payload it does not hold
            raise
        for rel in wanted:
            meta, path = manifest[rel], got[rel]
            size = path.stat().st_size
            actual = sha256_file(path)
            if actual != meta.sha256 or size != meta.size:
                raise ChecksumMismatch(rel, f"{store.spec}@{revision[:12]} (RELAY.json manifest)", meta.sha256,
                                       actual, size, hint=REPAIR_HINT)
        out = {rel: dest_dir / rel for rel in manifest}
        for rel in wanted:
            out[rel].parent.mkdir(parents=True, exist_ok=True)
            os.replace(got[rel], out[rel])
        return out
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _read_verified(store: RelayStore, rel: str, revision: str, attempts: int = 3) -> bytes:
    """A file's bytes as the store holds them. A read that fails its own checksum is retried: a damaged
    transfer must never pass for a tree that does not hold its manifest (a repair would follow)."""
    for attempt in range(attempts):
        try:
            return store.read_file(rel, revision)
        except ChecksumMismatch:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _local_matches(path: Path, meta: PayloadFile) -> bool:
    try:
        return path.is_file() and path.stat().st_size == meta.size and sha256_file(path) == meta.sha256
    except OSError:
        return False
