"""The write side of HubStore: relay operations as huggingface_hub commit operations, prepared
(pre-uploaded) once, and the check that a landed commit holds what was sent.

Why the check: `HfApi.create_commit` silently leaves files out of a commit. It skips every file the
preupload answer marks `shouldIgnore` (the repo's .gitignore, huggingface/huggingface_hub#1868) and
every file whose remote oid equals the local one (huggingface/huggingface_hub#2389: sha256 for LFS
files, git sha1 for regular ones), and a preupload answer describes the branch head at that moment,
not the parent we commit on. So after each commit we read the new tree at the touched paths (one
paths-info call) and compare size and oid with what we sent; a mismatch is `CommitNotVerified`.

Ignored paths are refused in `prepare` (PathIgnored) before anything is committed, and prepared
files forget the preupload's remote oid, so the client never drops them as "unchanged" on the word
of a head that is not our parent; files added without `prepare` are caught by the check above.

NOTE: the upload mode, the ignore flag and the committed flag are private fields of the client's
`CommitOperationAdd` (`_upload_mode`, `_should_ignore`, `_is_committed`, and `_remote_oid` in
cas_commit.py): it offers no public way to read them, and the checks above need them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from huggingface_hub import CommitOperationAdd, CommitOperationCopy, CommitOperationDelete

from ..store import CopyFile, DeleteFile, FileInfo, Operation, PutFile, git_blob_sha1

PATHS_INFO_BATCH = 100  # paths per paths-info request, like the client's own FETCH_LFS_BATCH_SIZE


@dataclass
class _Prepared:
    op: PutFile  # held so that id(op) cannot be reused while the entry lives
    hub_op: CommitOperationAdd


class PreparedOps:
    """CommitOperationAdd objects built (hashed, upload mode known, LFS uploaded) by `prepare`,
    reused by every commit attempt of the same PutFile objects, so a retry uploads nothing again."""

    def __init__(self) -> None:
        self._by_id: dict[int, _Prepared] = {}

    def clear(self) -> None:
        self._by_id.clear()

    def add(self, op: PutFile) -> CommitOperationAdd:
        hub_op = CommitOperationAdd(path_in_repo=op.path, path_or_fileobj=_source(op))
        self._by_id[id(op)] = _Prepared(op, hub_op)
        return hub_op

    def get(self, op: PutFile) -> CommitOperationAdd | None:
        entry = self._by_id.get(id(op))
        if entry is None or entry.op is not op or entry.hub_op._is_committed:
            return None
        return entry.hub_op


def _source(op: PutFile) -> bytes | str:
    return op.source if isinstance(op.source, bytes) else str(op.source)


HubOperation = CommitOperationAdd | CommitOperationDelete | CommitOperationCopy


def to_hub_ops(operations: Sequence[Operation], prepared: PreparedOps) -> list[HubOperation]:
    out: list[HubOperation] = []
    for op in operations:
        if isinstance(op, PutFile):
            out.append(prepared.get(op) or CommitOperationAdd(path_in_repo=op.path, path_or_fileobj=_source(op)))
        elif isinstance(op, DeleteFile):
            out.append(CommitOperationDelete(path_in_repo=op.path))
        elif isinstance(op, CopyFile):
            out.append(CommitOperationCopy(src_path_in_repo=op.path, path_in_repo=op.path,
                                           src_revision=op.src_revision))
    return out


def ignored_paths(hub_ops: list) -> list[str]:
    return [h.path_in_repo for h in hub_ops if isinstance(h, CommitOperationAdd) and h._should_ignore]


def inline_bytes(hub_ops: list) -> int:
    """Bytes the commit request carries for regular-mode files (base64: 4 per 3)."""
    raw = sum(h.upload_info.size for h in hub_ops
              if isinstance(h, CommitOperationAdd) and h._upload_mode != "lfs")
    return raw * 4 // 3


def _git_oid_of(op: PutFile) -> str:
    if isinstance(op.source, bytes):
        return git_blob_sha1(op.source)
    # A file source is read again here: the relay only hands in private snapshots (payload.py).
    with open(op.source, "rb") as f:
        return git_blob_sha1(f.read())


def landed_problems(operations: Sequence[Operation], hub_ops: list, tree: dict[str, FileInfo],
                    sources: dict[str, FileInfo]) -> list[str]:
    """What the new tree (`tree`: the touched paths at the new commit) lacks of what we sent.
    `sources` holds the source entries of CopyFile operations."""
    problems = []
    for op, hub_op in zip(operations, hub_ops, strict=True):
        got = tree.get(op.path)
        if isinstance(op, DeleteFile):
            if got is not None:
                problems.append(f"{op.path} still present")
            continue
        if got is None:
            problems.append(f"{op.path} missing")
            continue
        if isinstance(op, CopyFile):
            want = sources.get(op.path)
            if want is None or (got.size, got.sha256, got.git_oid) != (want.size, want.sha256, want.git_oid):
                problems.append(f"{op.path} is not the copy of {op.src_revision[:12]}")
            continue
        size = hub_op.upload_info.size
        if got.size != size:
            problems.append(f"{op.path} has {got.size} bytes, sent {size}")
        elif got.sha256 is not None:
            if got.sha256 != hub_op.upload_info.sha256.hex():
                problems.append(f"{op.path} has sha256 {got.sha256[:12]}, sent {hub_op.upload_info.sha256.hex()[:12]}")
        elif got.git_oid != _git_oid_of(op):
            problems.append(f"{op.path} has git oid {str(got.git_oid)[:12]}, sent other bytes")
    return problems


def file_size(op: PutFile) -> int:
    return len(op.source) if isinstance(op.source, bytes) else os.path.getsize(op.source)
