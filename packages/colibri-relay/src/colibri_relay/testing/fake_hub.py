"""A loopback HTTP server that speaks the part of the Hub protocol huggingface_hub uses for relays.

Run it in-process (`with FakeHub() as hub: HfApi(endpoint=hub.endpoint)`) or as a command
(`colibri-relay fake-hub --port P`). Clients must run with `HF_HUB_DISABLE_XET=1` (the fake Hub
speaks the legacy LFS protocol only). Any token is accepted.

Endpoints: repo create; model info (at a revision); preupload; LFS batch, single-part and multipart
upload, verify; the NDJSON commit endpoint with `parentCommit` (412) and a per-repo commit lock
(409); commit listing (paged, `limit`, `Link` header); refs; tags; paths-info; tree; resolve (HEAD /
GET; LFS files by redirect to a CDN origin). `/_fake/faults` (GET/POST JSON) reads/sets the fault
knobs of `faults.FaultKnobs` from another process.

As strict as the Hub, each behaviour from where it is written down (ARCHITECTURE.md: "a fake that is
kinder than the real service hides the bugs users will meet"):

| behaviour | source |
|---|---|
| 412 on a stale `parentCommit`, 409 while the repo's commit lock is held | hf_api.create_commit docs |
| commit quota per repo, 128/hour, 429 whose wait is in the message only ("You can retry this action in 43 minutes"); on by default, `commit_rate_limit=(n, window_s)` or None (`colibri-relay fake-hub --commit-quota N/WINDOW` or `off`) | braindecode/braindecode#947, huggingface/datasets#6257 |
| preupload decides modes: the repo's .gitattributes, >= 10 MiB, binary > 1 MB -> LFS; empty -> regular | huggingface_hub#2666, #657, `_commit_api._fetch_upload_modes` |
| preupload honours the root .gitignore (`shouldIgnore`) and returns remote oids (the client then skips "unchanged" files) | huggingface_hub#1868, #2389 |
| inline files count into the commit: no regular file > 10 MiB, no binary one > 1 MB, body <= 100 MB | huggingface_hub#2666, #657, #920 |
| LFS multipart upload (parts with ETags, a completion call) above `multipart_threshold` | `lfs.py::_upload_multi_part` |
| resolve of an LFS file: 302 to another origin, metadata on the redirect | `utils/_http.py`, huggingface/hf-hub#176 |
| commit listing honours `limit` (<= 1000) and pages with `Link` | @huggingface/hub `listCommits` |
| faults before apply, after apply (reply lost, 500, 504), late apply, stale reads of `main` on every read endpoint, 409 on tags, slow replies and a slow link (`upload_bytes_per_s`, commit bodies too) | faults.py; huggingface_hub#1660 (a timed-out commit "is still completed server-side") |

Trade-off: ThreadingHTTPServer (stdlib) is plenty for loopback tests; it is not a production server.
"""

from __future__ import annotations

import collections
import shutil
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

from .fake_hub_repo import FakeHubState
from .faults import FaultKnobs
from .hub_protocol import HubRequestHandler

# The Hub's commit quota per repo: 128 commits per hour (the 429 text in braindecode/braindecode#947).
HUB_COMMIT_RATE_LIMIT = (128, 3600.0)
# The commit request's size limit, inline (base64) files included (huggingface/huggingface_hub#920).
HUB_COMMIT_BODY_MAX = 100 * 1000 * 1000


def parse_commit_quota(text: str) -> tuple[int, float] | None:
    """`"128/3600"` -> (128, 3600.0) commits per window in seconds; `"off"` -> None (no quota).

    Raises ValueError naming what is wrong. Scale the window with a test's timers: a lease 1000x
    shorter than the default 1200 s meets the Hub's quota at `128/3.6`."""
    value = text.strip()
    if value.lower() == "off":
        return None
    form = "give COMMITS/WINDOW_SECONDS (e.g. 128/3600, the Hub's, or 20/10) or off"
    count, sep, window = value.partition("/")
    if not sep:
        raise ValueError(f"{text!r} has no '/': {form}")
    try:
        n = int(count)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"{text!r}: the number of commits must be a whole number above 0; {form}")
    try:
        w = float(window)
    except ValueError:
        w = 0.0
    if not 0 < w < float("inf"):
        raise ValueError(f"{text!r}: the window must be a number of seconds above 0; {form}")
    return n, w


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def handle_error(self, request, client_address):
        # Clients killed mid-request (the chaos test does this on purpose) are not server errors.
        pass


class FakeHub:
    """The fake Hub: `endpoint` is `http://127.0.0.1:PORT`. Use as a context manager or start/stop."""

    def __init__(self, port: int = 0, data_dir: Path | None = None, *, lfs_threshold: int = 10 * 1024 * 1024,
                 faults: FaultKnobs | None = None, commit_hold_s: float = 0.0,
                 upload_bytes_per_s: float | None = None,
                 commit_rate_limit: tuple[int, float] | None = HUB_COMMIT_RATE_LIMIT,
                 max_commit_body_bytes: int | None = HUB_COMMIT_BODY_MAX,
                 multipart_threshold: int | None = 16 * 1024 * 1024, multipart_chunk_bytes: int = 8 * 1024 * 1024,
                 lfs_redirect: bool = True):
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="fake-hub-"))
        self.state = FakeHubState(self.data_dir, lfs_threshold=lfs_threshold)
        self.faults = faults or FaultKnobs()
        self.commit_hold_s = commit_hold_s
        self.upload_bytes_per_s = upload_bytes_per_s  # throttle LFS uploads (a slow link)
        self.requests = 0
        # (commits, window_s) per repo, a sliding window like the Hub's quota; None switches it off.
        self.commit_rate_limit = commit_rate_limit
        self.max_commit_body_bytes = max_commit_body_bytes
        self.multipart_threshold = multipart_threshold  # LFS files above this upload in parts (hub_lfs.py)
        self.multipart_chunk_bytes = multipart_chunk_bytes
        self.lfs_redirect = lfs_redirect  # resolve of an LFS file: 302 to the CDN origin, like the Hub
        self._commit_times: dict[str, collections.deque] = {}
        self._quota_lock = threading.Lock()
        handler = type("Handler", (HubRequestHandler,), {"hub": self})
        self._server = _Server(("127.0.0.1", port), handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # LFS content lives on another origin (the Hub's CDN / S3): a second port, same handler.
        self._cdn = _Server(("127.0.0.1", 0), handler)
        self.cdn_endpoint = f"http://127.0.0.1:{self._cdn.server_address[1]}"
        self._thread: threading.Thread | None = None
        self._cdn_thread = threading.Thread(target=self._cdn.serve_forever, name="fake-hub-cdn", daemon=True)
        self._cdn_thread.start()

    def commit_quota_wait(self, repo_id: str) -> float | None:
        """Seconds until `repo_id` may commit again, or None if it may now."""
        if not self.commit_rate_limit:
            return None
        count, window = self.commit_rate_limit
        now = time.monotonic()
        with self._quota_lock:
            times = self._commit_times.setdefault(repo_id, collections.deque())
            while times and now - times[0] >= window:
                times.popleft()
            return times[0] + window - now if len(times) >= count else None

    def count_commit(self, repo_id: str) -> None:
        with self._quota_lock:
            self._commit_times.setdefault(repo_id, collections.deque()).append(time.monotonic())

    def start(self) -> FakeHub:
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._cdn.shutdown()
        self._cdn.server_close()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


