"""In-memory git-like model of Hub repos, used by the fake Hub HTTP server.

Only what the relay's client calls needs exists: one branch (`main`) per repo, tags, a linear
commit history, file trees whose entries are either regular files (git blob sha1 `oid`) or LFS
files (sha256 `lfs.oid` + the git oid of the pointer). File contents live on disk under
`data_dir/blobs/<sha256>` so payloads of hundreds of MB do not sit in RAM.

Errors are raised as `HubHTTPError(status, message, error_code)` and turned into HTTP answers by
the server, with the `X-Error-Code` values the huggingface_hub client maps to typed exceptions.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

BINARY_INLINE_MAX = 1024 * 1024  # "binary files over 1MB" must be LFS (huggingface/huggingface_hub#657)
# A new Hub model repo starts with a .gitattributes sending these to LFS (an abridged copy of the
# Hub's default, as seen in any freshly created repo); preupload follows the repo's own file.
LFS_PATTERNS = ("*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.gguf", "*.gz", "*.h5", "*.joblib", "*.msgpack",
                "*.npy", "*.npz", "*.onnx", "*.parquet", "*.pb", "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar",
                "*.safetensors", "*.tar", "*.tflite", "*.tgz", "*.xz", "*.zip", "*.zst", "*tfevents*")
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()


class HubHTTPError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None, repo_commit: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code
        self.repo_commit = repo_commit


INLINE_FILE_MAX = 10 * 1024 * 1024  # "Your push was rejected because it contains files larger than 10 MiB"


def check_inline_limits(operations: list[dict], max_body_bytes: int | None, body_bytes: int) -> None:
    """The Hub's limits on what travels INSIDE a commit: no regular file over 10 MiB
    (huggingface/huggingface_hub#2666), no binary regular file over 1 MB (#657), and a bounded
    request body ("the limit will still be 100MB commit", #920), base64 inline files included."""
    if max_body_bytes is not None and body_bytes > max_body_bytes:
        raise HubHTTPError(413, f"Payload Too Large: the commit body is {body_bytes} bytes (limit {max_body_bytes}); "
                                "upload large files with LFS")
    import base64

    for op in operations:
        if op.get("key") != "file":
            continue
        value = op["value"]
        content = value.get("content", "")
        size = len(content) * 3 // 4 if value.get("encoding") == "base64" else len(content.encode())
        if size > INLINE_FILE_MAX:
            raise HubHTTPError(400, "Your push was rejected because it contains files larger than 10 MiB. Please use "
                                    f"https://git-lfs.github.com/ to store large files. Offending files: - {value['path']}")
        if size > BINARY_INLINE_MAX:
            data = base64.b64decode(content) if value.get("encoding") == "base64" else content.encode()
            if b"\0" in data[:8000]:
                raise HubHTTPError(400, f"Your push was rejected because it contains binary files over 1MB: "
                                        f"{value['path']}; use LFS")


def gitignore_matches(gitignore: str, path: str) -> bool:
    """Whether `path` is ignored by a root .gitignore (the common subset: `#` comments, `!` negation,
    a trailing `/` for directories, a `/` inside a pattern anchoring it at the root; last match wins)."""
    parts = path.split("/")
    ignored = False
    for raw in gitignore.splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        negate = pat.startswith("!")
        pat = pat[1:] if negate else pat
        dir_only = pat.endswith("/")
        pat = pat.strip("/") if dir_only else pat.lstrip("/")
        if "/" in pat or raw.strip().lstrip("!").startswith("/"):
            prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + (0 if dir_only else 1))]
            hit = any(fnmatch.fnmatch(p, pat) for p in prefixes)
        else:
            names = parts[:-1] if dir_only else parts
            hit = any(fnmatch.fnmatch(n, pat) for n in names)
        if hit:
            ignored = not negate
    return ignored


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class TreeEntry:
    size: int
    sha256: str  # content address in the blob directory
    git_oid: str  # git blob id (of the content, or of the LFS pointer)
    lfs: bool

    def as_json(self, path: str) -> dict:
        out = {"type": "file", "path": path, "size": self.size, "oid": self.git_oid}
        if self.lfs:
            out["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": len(lfs_pointer(self.sha256, self.size))}
        return out


@dataclass
class Commit:
    sha: str
    parent: str | None
    title: str
    description: str
    date: str
    tree: dict[str, TreeEntry]


@dataclass
class FakeRepo:
    repo_id: str
    commits: dict[str, Commit] = field(default_factory=dict)
    head: str = ""
    previous_heads: list[str] = field(default_factory=list)
    tags: dict[str, str] = field(default_factory=dict)
    previous_tags: list[dict[str, str]] = field(default_factory=list)
    commit_lock: threading.Lock = field(default_factory=threading.Lock)

    def resolve(self, revision: str) -> str:
        if revision == "main":
            return self.head
        if revision in self.tags:
            return self.tags[revision]
        if revision in self.commits:
            return revision
        raise HubHTTPError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def history(self, sha: str) -> list[Commit]:
        out = []
        cur: str | None = sha
        while cur:
            out.append(self.commits[cur])
            cur = self.commits[cur].parent
        return out


class FakeHubState:
    """All repos of one fake Hub plus the blob directory. Thread-safe (one state lock)."""

    def __init__(self, data_dir: Path, lfs_threshold: int = 10 * 1024 * 1024):
        self.data_dir = Path(data_dir)
        self.blob_dir = self.data_dir / "blobs"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.lfs_threshold = lfs_threshold
        self.repos: dict[str, FakeRepo] = {}
        self.lock = threading.RLock()

    # --- blobs ---------------------------------------------------------------------------------
    def blob_path(self, sha256: str) -> Path:
        return self.blob_dir / sha256

    def has_blob(self, sha256: str) -> bool:
        return self.blob_path(sha256).exists()

    def put_blob_bytes(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        path = self.blob_path(digest)
        if not path.exists():
            tmp = path.with_name(f".{digest}.{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return digest

    # --- repos ---------------------------------------------------------------------------------
    def repo(self, repo_id: str) -> FakeRepo:
        with self.lock:
            repo = self.repos.get(repo_id)
        if repo is None:
            raise HubHTTPError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def create_repo(self, repo_id: str) -> FakeRepo:
        with self.lock:
            if repo_id in self.repos:
                raise HubHTTPError(409, "You already created this model repo")
            repo = FakeRepo(repo_id)
            digest = self.put_blob_bytes(GITATTRIBUTES)
            entry = TreeEntry(len(GITATTRIBUTES), digest, git_blob_sha1(GITATTRIBUTES), False)
            self._add_commit(repo, None, "initial commit", "", {".gitattributes": entry})
            self.repos[repo_id] = repo
            return repo

    def _add_commit(self, repo: FakeRepo, parent: str | None, title: str, description: str, tree: dict) -> Commit:
        date = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        seed = f"{parent}\n{title}\n{description}\n{date}\n{len(repo.commits)}\n" + "\n".join(
            f"{p}:{e.git_oid}" for p, e in sorted(tree.items())
        )
        sha = hashlib.sha1(seed.encode()).hexdigest()
        commit = Commit(sha, parent, title, description, date, tree)
        repo.commits[sha] = commit
        if repo.head:
            repo.previous_heads = (repo.previous_heads + [repo.head])[-8:]
        repo.head = sha
        return commit

    def upload_mode(self, path: str, size: int, sample: bytes = b"", tree: dict | None = None) -> str:
        """The Hub's choice, as its preupload answers: LFS for a path the repo's .gitattributes sends
        to LFS, for a file over the size threshold (10 MiB on the Hub: "Your push was rejected because
        it contains files larger than 10 MiB", huggingface/huggingface_hub#2666) and for binary content
        (the client sends the first 512 bytes as `sample` for this; binary files over 1 MB must be LFS,
        huggingface/huggingface_hub#657). Empty files stay regular (the client forces it too)."""
        if size == 0:
            return "regular"
        attributes = self.gitattributes(tree)
        if any(lfs and fnmatch.fnmatch(path.rsplit("/", 1)[-1] if "/" not in pat else path, pat)
               for pat, lfs in attributes):
            return "lfs"
        if size >= self.lfs_threshold or (b"\0" in sample and size > BINARY_INLINE_MAX):
            return "lfs"
        return "regular"

    def gitattributes(self, tree: dict | None) -> list[tuple[str, bool]]:
        """(pattern, is_lfs) of the tree's root .gitattributes (the repo's default when unknown)."""
        raw = GITATTRIBUTES
        if tree is not None and ".gitattributes" in tree:
            raw = self.blob_path(tree[".gitattributes"].sha256).read_bytes()
        out = []
        for line in raw.decode(errors="replace").splitlines():
            parts = line.split()
            if parts and not parts[0].startswith("#"):
                out.append((parts[0], "filter=lfs" in parts[1:]))
        return out

    def apply_commit(self, repo: FakeRepo, header: dict, operations: list[tuple[str, dict]]) -> Commit:
        """Validate everything first, then apply: all files land or none. Caller holds repo.commit_lock."""
        with self.lock:
            parent = header.get("parentCommit")
            if parent is not None and parent != repo.head:
                raise HubHTTPError(412, "A commit has happened since. Please refresh and try again.")
            tree = dict(repo.commits[repo.head].tree)
            for key, value in operations:
                path = value.get("path", "")
                if not path or path.startswith("/") or ".." in path.split("/"):
                    raise HubHTTPError(400, f"invalid path {path!r}")
                if key == "file":
                    import base64

                    data = base64.b64decode(value["content"]) if value.get("encoding") == "base64" else value[
                        "content"].encode()
                    digest = self.put_blob_bytes(data)
                    tree[path] = TreeEntry(len(data), digest, git_blob_sha1(data), False)
                elif key == "lfsFile":
                    oid, size = value["oid"], value.get("size")
                    if not self.has_blob(oid):
                        raise HubHTTPError(422, f"LFS object {oid} for {path} was never uploaded")
                    real_size = self.blob_path(oid).stat().st_size
                    if size is not None and size != real_size:
                        raise HubHTTPError(422, f"LFS object {oid} has size {real_size}, not {size}")
                    tree[path] = TreeEntry(real_size, oid, git_blob_sha1(lfs_pointer(oid, real_size)), True)
                elif key == "deletedFile":
                    if tree.pop(path, None) is None:
                        raise HubHTTPError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                elif key == "deletedFolder":
                    prefix = path.rstrip("/") + "/"
                    for p in [p for p in tree if p.startswith(prefix)]:
                        del tree[p]
                else:
                    raise HubHTTPError(400, f"unknown commit operation key {key!r}")
            return self._add_commit(repo, repo.head, header.get("summary", ""), header.get("description", ""), tree)

    def create_tag(self, repo: FakeRepo, revision: str, tag: str) -> None:
        with self.lock:
            sha = repo.resolve(revision)
            if tag in repo.tags:
                raise HubHTTPError(409, f"Tag {tag} already exists")
            repo.previous_tags = (repo.previous_tags + [dict(repo.tags)])[-8:]
            repo.tags[tag] = sha
