"""The fake Hub's LFS side: the batch API, single-part and multipart uploads, verify, and downloads
(resolve), with large files served from a separate "CDN" origin as the Hub does.

What the unmodified client expects, and where that is written down:

* batch (`lfs.py::post_lfs_batch_info`): per object either no `actions` (already stored) or an
  `upload` action and a `verify` one. Files over `FakeHub.multipart_threshold` get the multipart
  form: `upload.header` = {"chunk_size": N, "00001": part URL, ...} and `upload.href` = the
  completion endpoint; the client PUTs each part, collects each reply's `ETag` and POSTs
  {"oid", "parts": [{"partNumber", "etag"}]} to complete (`lfs.py::_upload_multi_part`). Parts go to
  the CDN origin (S3 on the Hub); the completion checks every ETag and the whole file's sha256.
* resolve of an LFS file answers 302 with `Location` on another origin and the file's metadata
  (`X-Repo-Commit`, `X-Linked-Etag` = sha256, `X-Linked-Size`) on the redirect itself: the client
  follows redirects only within the Hub's origins (`utils/_http.py::_httpx2_follow_hub_redirects_with_
  backoff`: "the file metadata is on the redirect response itself and the auth header must not leave
  the Hub"; the same in huggingface/hf-hub#176). Regular files are served directly (200).

The upload throttle (`FakeHub.upload_bytes_per_s`) slows single parts and multipart parts alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time

from .fake_hub_repo import HubHTTPError

REPO = r"(?P<repo>[^/]+/[^/]+)"
OID = r"(?P<oid>[0-9a-f]{64})"


class LfsRoutes:
    """Mixed into the request handler (it provides hub, _body, _body_chunks, _send, _json, _read_rev)."""

    # --- uploads -------------------------------------------------------------------------------
    def lfs_batch(self, query, repo):
        self.hub.state.repo(repo)
        body = json.loads(self._body())
        base, cdn = self.hub.endpoint, self.hub.cdn_endpoint
        objects = []
        for obj in body.get("objects", []):
            oid, size = obj["oid"], obj["size"]
            item = {"oid": oid, "size": size, "authenticated": True}
            if not self.hub.state.has_blob(oid):
                verify = {"href": f"{base}/_lfs/{repo}/{oid}/verify"}
                chunk = self.hub.multipart_chunk_bytes
                if self.hub.multipart_threshold is not None and size > self.hub.multipart_threshold:
                    parts = -(-size // chunk)
                    header = {"chunk_size": str(chunk)}
                    header.update({f"{n:05d}": f"{cdn}/_cdn/part/{repo}/{oid}/{n}" for n in range(1, parts + 1)})
                    upload = {"href": f"{base}/_lfs/{repo}/{oid}/complete", "header": header}
                else:
                    upload = {"href": f"{base}/_lfs/{repo}/{oid}?size={size}"}
                item["actions"] = {"upload": upload, "verify": verify}
            objects.append(item)
        self._json(200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

    def _receive(self, f) -> tuple[str, int]:
        h, n = hashlib.sha256(), 0
        for block in self._body_chunks():
            if self.hub.upload_bytes_per_s:
                time.sleep(len(block) / self.hub.upload_bytes_per_s)
            h.update(block)
            f.write(block)
            n += len(block)
        return h.hexdigest(), n

    def lfs_upload(self, query, repo, oid):
        size = int(query.get("size", ["-1"])[0])
        state = self.hub.state
        fd, tmp = tempfile.mkstemp(dir=state.blob_dir, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                digest, n = self._receive(f)
            if digest != oid or (size >= 0 and n != size):
                raise HubHTTPError(400, f"uploaded content has sha256 {digest} / {n} bytes, expected {oid}")
            os.replace(tmp, state.blob_path(oid))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._send(200, b"")

    def _part_path(self, oid: str, n: int):
        d = self.hub.state.data_dir / "parts" / oid
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{n:05d}"

    def lfs_part(self, query, repo, oid, n):
        path = self._part_path(oid, int(n))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".part-")
        with os.fdopen(fd, "wb") as f:
            md5 = hashlib.md5(usedforsecurity=False)
            for block in self._body_chunks():
                if self.hub.upload_bytes_per_s:
                    time.sleep(len(block) / self.hub.upload_bytes_per_s)
                md5.update(block)
                f.write(block)
        os.replace(tmp, path)
        self._send(200, b"", {"ETag": f'"{md5.hexdigest()}"'})  # S3 answers each part with its ETag

    def lfs_complete(self, query, repo, oid):
        body = json.loads(self._body() or b"{}")
        parts = sorted(body.get("parts", []), key=lambda p: p["partNumber"])
        if body.get("oid") != oid or not parts:
            raise HubHTTPError(400, "completion needs the oid and its parts")
        state = self.hub.state
        fd, tmp = tempfile.mkstemp(dir=state.blob_dir, prefix=".complete-")
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                for i, part in enumerate(parts, start=1):
                    path = self._part_path(oid, part["partNumber"])
                    if part["partNumber"] != i or not path.exists():
                        raise HubHTTPError(400, f"part {i} of {oid} was never uploaded")
                    data = path.read_bytes()
                    if part["etag"].strip('"') != hashlib.md5(data, usedforsecurity=False).hexdigest():
                        raise HubHTTPError(400, f"part {i} of {oid}: ETag does not match the uploaded part")
                    h.update(data)
                    out.write(data)
            if h.hexdigest() != oid:
                raise HubHTTPError(400, f"assembled parts have sha256 {h.hexdigest()}, expected {oid}")
            os.replace(tmp, state.blob_path(oid))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._json(200, {"success": True})

    def lfs_verify(self, query, repo, oid):
        body = json.loads(self._body() or b"{}")
        if not self.hub.state.has_blob(oid):
            raise HubHTTPError(404, f"LFS object {oid} not found")
        if "size" in body and self.hub.state.blob_path(oid).stat().st_size != body["size"]:
            raise HubHTTPError(422, f"LFS object {oid} has the wrong size")
        self._json(200, {"success": True})

    # --- downloads -----------------------------------------------------------------------------
    def resolve(self, query, repo, rev, file):
        r = self.hub.state.repo(repo)
        with self.hub.state.lock:
            sha = self._read_rev(r, rev)
            entry = r.commits[sha].tree.get(file)
        if entry is None:
            raise HubHTTPError(404, f"Entry {file} not found at {rev}", "EntryNotFound", repo_commit=sha)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{entry.git_oid}"', "Accept-Ranges": "bytes"}
        if entry.lfs:
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(entry.size)
            if self.hub.lfs_redirect:
                headers["Location"] = f"{self.hub.cdn_endpoint}/_cdn/{entry.sha256}"
                self._send(302, b"", headers)
                return
        self._serve_blob(entry.sha256, headers)

    def cdn_blob(self, query, oid):
        if not self.hub.state.has_blob(oid):
            raise HubHTTPError(404, f"no object {oid}")
        self._serve_blob(oid, {"ETag": f'"{oid}"', "Accept-Ranges": "bytes"})

    def _serve_blob(self, sha256: str, headers: dict) -> None:
        # NOTE: serve what is on disk (a test may have truncated it); the tree's size is in X-Linked-Size.
        blob = self.hub.state.blob_path(sha256)
        size = blob.stat().st_size
        start, status = 0, 200
        m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if m and int(m.group(1)) < size:
            start, status = int(m.group(1)), 206
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size - start))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(blob, "rb") as f:
            f.seek(start)
            while block := f.read(1 << 20):
                self.wfile.write(block)


LFS_ROUTES = [
    ("POST", rf"/{REPO}\.git/info/lfs/objects/batch", LfsRoutes.lfs_batch),
    ("PUT", rf"/_lfs/{REPO}/{OID}", LfsRoutes.lfs_upload),
    ("POST", rf"/_lfs/{REPO}/{OID}/verify", LfsRoutes.lfs_verify),
    ("POST", rf"/_lfs/{REPO}/{OID}/complete", LfsRoutes.lfs_complete),
    ("PUT", rf"/_cdn/part/{REPO}/{OID}/(?P<n>\d+)", LfsRoutes.lfs_part),
    ("GET", rf"/_cdn/{OID}", LfsRoutes.cdn_blob),
    ("GET", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", LfsRoutes.resolve),
]
