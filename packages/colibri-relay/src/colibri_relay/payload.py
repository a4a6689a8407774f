"""The payload: a directory of files (e.g. a checkpoint dir) pushed and pulled as one unit.

A push scans the directory (every regular file, recursively; names starting with '.' are skipped,
so tool caches and our own staging dirs never travel) and records a manifest {path: sha256, size}
in RELAY.json. A pull downloads into a staging dir, checks every file against that manifest, and
only then moves the files into place: a corrupt or truncated download changes nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .errors import ChecksumMismatch, PayloadError
from .relay_state import PayloadFile
from .store import RelayStore, sha256_file

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


def pull_payload(store: RelayStore, revision: str, manifest: dict[str, PayloadFile], dest_dir: Path) -> dict[str, Path]:
    """Download the manifest's files at `revision` into `dest_dir`, verified before anything moves."""
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    if not manifest:
        return {}
    staging = Path(tempfile.mkdtemp(prefix=".relay-pull-", dir=dest_dir))
    try:
        got = store.download(sorted(manifest), revision, staging)
        for rel, meta in manifest.items():
            path = got[rel]
            size = path.stat().st_size
            actual = sha256_file(path)
            if actual != meta.sha256 or size != meta.size:
                raise ChecksumMismatch(rel, f"{store.spec}@{revision[:12]} (RELAY.json manifest)", meta.sha256,
                                       actual, size)
        out = {}
        for rel in manifest:
            target = dest_dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(got[rel], target)
            out[rel] = target
        return out
    finally:
        shutil.rmtree(staging, ignore_errors=True)
