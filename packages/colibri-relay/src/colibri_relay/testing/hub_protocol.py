"""The HTTP side of the fake Hub: one request handler class, routing the Hub's URLs to the repo model.

Each route mirrors what the unmodified huggingface_hub client sends and checks (see fake_hub.py for
the list). Errors become JSON bodies with the `X-Error-Code` / `X-Error-Message` headers the client
maps to typed exceptions, and `Connection: close`, since the request body may be unread.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, unquote, urlsplit

from .fake_hub_repo import HubHTTPError, check_inline_limits, gitignore_matches
from .hub_lfs import LFS_ROUTES, LfsRoutes

REPO = r"(?P<repo>[^/]+/[^/]+)"
COMMITS_PAGE = 50


class _DropConnection(Exception):
    pass


def commit_quota_message(limit: tuple[int, float], wait_s: float) -> str:
    """The Hub's words for its commit quota (braindecode/braindecode#947, huggingface/datasets#6257)."""
    count, window = limit
    per = "hour" if window == 3600 else f"{window:g} seconds"
    if wait_s >= 50 * 60:
        when = "about 1 hour"
    elif wait_s >= 60:
        when = f"{math.ceil(wait_s / 60)} minutes"
    else:
        when = f"{math.ceil(wait_s)} seconds"
    return (f"You have exceeded the rate limit for repository commits ({count} per {per}). "
            f"You can retry this action in {when}.")


class HubRequestHandler(LfsRoutes, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub  # noqa: F821 - set by FakeHub on a subclass

    def setup(self):
        super().setup()
        # Headers and body go out in separate writes: without NODELAY, Nagle + delayed ACK add 40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format, *args):  # noqa: A002 - stdlib signature
        pass

    # --- plumbing ------------------------------------------------------------------------------
    def _body_chunks(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                yield self.rfile.read(size)
                self.rfile.readline()
        else:
            left = int(self.headers.get("Content-Length") or 0)
            while left > 0:
                block = self.rfile.read(min(left, 1 << 20))
                if not block:
                    return
                left -= len(block)
                yield block

    def _body(self) -> bytes:
        return b"".join(self._body_chunks())

    def _slow_body(self) -> bytes:
        out = []
        for block in self._body_chunks():
            if self.hub.upload_bytes_per_s:
                time.sleep(len(block) / self.hub.upload_bytes_per_s)
            out.append(block)
        return b"".join(out)

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, ctype="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None):
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, err: HubHTTPError):
        # The request body may be unread: close rather than desynchronise a keep-alive connection.
        self.close_connection = True
        headers = {"X-Error-Message": err.message, "Connection": "close"}
        if err.error_code:
            headers["X-Error-Code"] = err.error_code
        if err.repo_commit:
            headers["X-Repo-Commit"] = err.repo_commit
        self._json(err.status, {"error": err.message}, headers)

    def _dispatch(self):
        hub = self.hub
        hub.requests += 1
        delay = hub.faults.delay()
        if delay:
            time.sleep(delay)
        url = urlsplit(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        try:
            for method, pattern, fn in _ROUTES:
                if method == self.command or (method == "GET" and self.command == "HEAD"):
                    m = re.fullmatch(pattern, path)
                    if m:
                        return fn(self, query=query, **m.groupdict())
            raise HubHTTPError(404, f"no fake-Hub route for {self.command} {path}")
        except HubHTTPError as err:
            self._error(err)
        except (ValueError, KeyError) as exc:  # malformed request (e.g. a client killed mid-body)
            self._error(HubHTTPError(400, f"bad request: {exc}"))
        except _DropConnection:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    do_GET = do_POST = do_PUT = do_HEAD = _dispatch

    # --- repos ---------------------------------------------------------------------------------
    def create_repo(self, query):
        body = json.loads(self._body() or b"{}")
        repo_id = f"{body.get('organization') or 'user'}/{body['name']}"
        try:
            self.hub.state.create_repo(repo_id)
        except HubHTTPError as err:  # like the Hub: a 409 still names the existing repo's url
            self._json(err.status, {"error": err.message, "url": f"{self.hub.endpoint}/{repo_id}"})
            return
        self._json(200, {"url": f"{self.hub.endpoint}/{repo_id}", "name": repo_id, "id": repo_id})

    def _read_rev(self, repo, rev: str) -> str:
        """Resolve a revision for a READ: `main` may be served stale on every read endpoint."""
        return self._head_for_read(repo) if rev in (None, "main") else repo.resolve(rev)

    def _head_for_read(self, repo) -> str:
        # NOTE: stale reads model a CDN / replica lag: safety must not depend on reads being fresh.
        if repo.previous_heads and self.hub.faults.fire("stale_head_read"):
            return repo.previous_heads[-1]
        return repo.head

    def model_info(self, query, repo, rev=None):
        r = self.hub.state.repo(repo)
        with self.hub.state.lock:
            sha = self._read_rev(r, rev)
            commit = r.commits[sha]
        self._json(200, {
            "id": repo, "modelId": repo, "sha": sha, "private": False, "disabled": False, "gated": False,
            "lastModified": commit.date, "tags": [], "downloads": 0, "likes": 0,
            "siblings": [{"rfilename": p} for p in sorted(commit.tree)],
        })

    def refs(self, query, repo):
        r = self.hub.state.repo(repo)
        with self.hub.state.lock:
            head = self._head_for_read(r)
            shown = r.tags
            if r.previous_tags and self.hub.faults.fire("stale_tags_read"):
                shown = r.previous_tags[-1]
            tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": s} for t, s in sorted(shown.items())]
        self._json(200, {"branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": head}],
                         "converts": [], "tags": tags, "pullRequests": []})

    def create_tag(self, query, repo, rev):
        r = self.hub.state.repo(repo)
        body = json.loads(self._body() or b"{}")
        if self.hub.faults.fire("tag_409"):
            # Refs share the repo's lock: under contention the Hub answers 409 and creates nothing,
            # the same status as for an existing tag (probes of the real Hub met exactly this).
            raise HubHTTPError(409, "A ref update is already in progress on this repo; retry later.")
        self.hub.state.create_tag(r, rev, body["tag"])
        self._json(200, {})

    def commits(self, query, repo, rev):
        r = self.hub.state.repo(repo)
        with self.hub.state.lock:
            history = r.history(self._read_rev(r, rev))
        # `limit` sets the page size, up to 1000 (@huggingface/hub's listCommits sends ?limit=, "Defaults
        # to 100. Can be set to 1000"); without it a page holds COMMITS_PAGE; `Link` names the next one.
        page = int(query.get("p", ["0"])[0])
        size = max(1, min(int(query.get("limit", [str(COMMITS_PAGE)])[0]), 1000))
        items = history[page * size:(page + 1) * size]
        headers = {}
        if (page + 1) * size < len(history):
            headers["Link"] = f'<{self.hub.endpoint}/api/models/{repo}/commits/{rev}?p={page + 1}&limit={size}>; rel="next"'
        self._json(200, [{
            "id": c.sha, "title": c.title, "message": (c.title + ("\n\n" + c.description if c.description else "")),
            "date": c.date, "authors": [{"user": "relay"}],
        } for c in items], headers)

    def _tree_at(self, repo, rev):
        r = self.hub.state.repo(repo)
        with self.hub.state.lock:
            return r.commits[self._read_rev(r, rev)].tree

    def paths_info(self, query, repo, rev):
        form = parse_qs(self._body().decode())
        tree = self._tree_at(repo, rev)
        out = []
        for p in form.get("paths", []):
            if p in tree:
                out.append(tree[p].as_json(p))
            elif any(q.startswith(p.rstrip("/") + "/") for q in tree):
                out.append({"type": "directory", "path": p, "oid": hashlib.sha1(p.encode()).hexdigest(), "size": 0})
        self._json(200, out)

    def tree(self, query, repo, rev, sub=None):
        tree = self._tree_at(repo, rev)
        prefix = (sub.strip("/") + "/") if sub else ""
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        out, dirs = [], set()
        for p in sorted(tree):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/")[0])
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                dirs.update(prefix + "/".join(parts[: i + 1]) for i in range(len(parts)))
            out.append(tree[p].as_json(p))
        out += [{"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0}
                for d in sorted(dirs)]
        self._json(200, out)

    # --- uploads -------------------------------------------------------------------------------
    def preupload(self, query, repo, rev):
        r = self.hub.state.repo(repo)
        body = json.loads(self._body())
        with self.hub.state.lock:
            tree = r.commits[self._read_rev(r, rev)].tree  # preupload's oids may describe an older head
        # .gitignore: the one sent with the request, else the repo's root one (huggingface_hub's
        # `_fetch_upload_modes` docstring; only the root file counts, huggingface/huggingface_hub#1868).
        gitignore = body.get("gitIgnore")
        if gitignore is None and ".gitignore" in tree:
            gitignore = self.hub.state.blob_path(tree[".gitignore"].sha256).read_text(errors="replace")
        files = []
        for f in body["files"]:
            sample = base64.b64decode(f.get("sample") or "")
            mode = self.hub.state.upload_mode(f["path"], f["size"], sample, tree)
            old = tree.get(f["path"])
            oid = None
            if old is not None:  # the client skips a file whose local oid equals this (huggingface_hub#2389)
                oid = old.sha256 if old.lfs else old.git_oid
            files.append({"path": f["path"], "uploadMode": mode, "oid": oid,
                          "shouldIgnore": bool(gitignore) and gitignore_matches(gitignore, f["path"])})
        self._json(200, {"files": files, "commitOid": r.head})

    def commit(self, query, repo, rev):
        hub, state = self.hub, self.hub.state
        r = state.repo(repo)
        raw = self._slow_body()  # inline (regular) files travel in here, base64: on a slow link, slowly
        if rev != "main":
            raise HubHTTPError(400, "the fake Hub only commits to main")
        if hub.faults.fire("commit_429"):
            after = str(hub.faults.retry_after_s)
            raise_headers = {"RateLimit": f'"api";r=0;t={after}', "RateLimit-Policy": '"fixed window";"api";q=100;w=300',
                             "Retry-After": after}
            self._json(429, {"error": "You have exceeded the rate limit for repository commits."}, raise_headers)
            return
        wait = hub.commit_quota_wait(repo)
        if wait is not None:
            # The Hub's per-repo commit quota names its wait in the message only, with no RateLimit
            # header of its own (braindecode/braindecode#947 quotes the reply).
            raise HubHTTPError(429, commit_quota_message(hub.commit_rate_limit, wait))
        if hub.faults.fire("commit_409") or not r.commit_lock.acquire(blocking=False):
            raise HubHTTPError(409, "A commit is already in progress on this repo; retry later.")
        late = False
        try:
            lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
            if not lines or lines[0].get("key") != "header":
                raise HubHTTPError(400, "the first NDJSON line must be the header")
            check_inline_limits(lines[1:], hub.max_commit_body_bytes, len(raw))
            if hub.faults.fire("commit_drop_request_before_apply"):
                raise _DropConnection()  # the request died on the way: nothing applied
            if hub.faults.fire("commit_late_apply"):
                # A gateway timeout while the backend keeps going: the client gets a 504 at once and
                # the commit lands (or 412s against a moved head) a moment later, the lock held
                # meanwhile ("even if the timeout is raised client-side, the process is still
                # completed server-side", huggingface/huggingface_hub#1660).
                late = True
                threading.Thread(target=self._late_apply, args=(r, lines), daemon=True).start()
                raise HubHTTPError(504, "Gateway Time-out (injected: the commit will land late)")
            if hub.commit_hold_s:
                time.sleep(hub.commit_hold_s)
            ops = [(x["key"], x["value"]) for x in lines[1:]]
            # What a stale preupload answer or a .gitignore match make the client do: one file of
            # the commit silently left out, the commit a success all the same.
            droppable = [i for i, (k, v) in enumerate(ops) if k in ("file", "lfsFile")
                         and v.get("path") not in ("RELAY.json", "LEDGER.jsonl", "LEDGER.md")]
            if droppable and hub.faults.fire("commit_drops_file"):
                del ops[droppable[0]]
            commit = state.apply_commit(r, lines[0]["value"], ops)
            hub.count_commit(repo)
        finally:
            if not late:
                r.commit_lock.release()
        if hub.faults.fire("commit_drop_reply_after_apply"):
            raise _DropConnection()
        if hub.faults.fire("commit_500_after_apply"):
            raise HubHTTPError(500, "Internal Error (injected after the commit was applied)")
        if hub.faults.fire("commit_504_after_apply"):
            raise HubHTTPError(504, "Gateway Time-out (injected after the commit was applied)")
        self._json(200, {"success": True, "commitOid": commit.sha, "commitUrl": f"{hub.endpoint}/{repo}/commit/{commit.sha}",
                         "pullRequestUrl": None})

    def _late_apply(self, r, lines) -> None:
        try:
            time.sleep(self.hub.faults.late_apply_s)
            self.hub.state.apply_commit(r, lines[0]["value"], [(x["key"], x["value"]) for x in lines[1:]])
            self.hub.count_commit(r.repo_id)
        except HubHTTPError:
            pass  # e.g. 412: the head moved while the commit waited; nobody hears of it, like on the Hub
        finally:
            r.commit_lock.release()

    # --- admin ---------------------------------------------------------------------------------
    def faults(self, query):
        if self.command == "POST":
            body = json.loads(self._body() or b"{}")
            try:
                self.hub.faults.set(**body.get("knobs", {}))
                for kind, n in body.get("inject", {}).items():
                    self.hub.faults.inject(kind, n)
            except ValueError as exc:
                raise HubHTTPError(400, str(exc)) from None
        self._json(200, self.hub.faults.as_json())


_ROUTES = [
    ("POST", r"/api/repos/create", HubRequestHandler.create_repo),
    ("GET", rf"/api/models/{REPO}/revision/(?P<rev>[^/]+)", HubRequestHandler.model_info),
    ("GET", rf"/api/models/{REPO}/refs", HubRequestHandler.refs),
    ("GET", rf"/api/models/{REPO}/commits/(?P<rev>[^/]+)", HubRequestHandler.commits),
    ("GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.+))?", HubRequestHandler.tree),
    ("POST", rf"/api/models/{REPO}/tag/(?P<rev>[^/]+)", HubRequestHandler.create_tag),
    ("POST", rf"/api/models/{REPO}/paths-info/(?P<rev>[^/]+)", HubRequestHandler.paths_info),
    ("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", HubRequestHandler.preupload),
    ("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", HubRequestHandler.commit),
    ("GET", rf"/api/models/{REPO}", HubRequestHandler.model_info),
    *LFS_ROUTES,
    ("GET", r"/_fake/faults", HubRequestHandler.faults),
    ("POST", r"/_fake/faults", HubRequestHandler.faults),
]
