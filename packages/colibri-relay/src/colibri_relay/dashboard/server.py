"""The dashboard's HTTP server: GET-only, standard library (`http.server`), one snapshot cache.

Routes: `/` (the HTML page), `/api/snapshot.json` (the same `Snapshot` as JSON). Every other
path is 404; every method but GET/HEAD is 405. There is no route that writes: the reader it
serves only calls store read methods, so the server is read-only by construction.

Why the standard library: two routes, no forms, no sessions; a ThreadingHTTPServer serves a
handful of viewers and adds no dependency to a package others `pip install` for its relay alone.

Safety: binds 127.0.0.1 unless told otherwise; when bound to a loopback address it answers only
requests whose Host header is a loopback name (a page on another site cannot read the dashboard
through DNS rebinding). A strict Content-Security-Policy allows no script and no remote load.
The Hub token stays inside the store object: snapshots never carry it.

Refreshes: many browser tabs must not multiply Hub API calls, so a snapshot is reused for
`min_interval_s`; if a read fails, the last good snapshot is served with the error on top.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .page import render_page
from .reader import DashboardReader, read_snapshot_or_error
from .snapshot import Snapshot

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


class SnapshotCache:
    """At most one store read per `min_interval_s`, shared by all requests (thread-safe)."""

    def __init__(self, reader: DashboardReader, min_interval_s: float):
        self.reader = reader
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._last: Snapshot | None = None
        self._last_good: Snapshot | None = None
        self._read_mono = float("-inf")

    def get(self) -> Snapshot:
        with self._lock:
            if self._last is None or time.monotonic() - self._read_mono >= self.min_interval_s:
                snap = read_snapshot_or_error(self.reader)
                if snap.error and self._last_good is not None:
                    # Keep showing what we had, and say it is stale and why.
                    snap = self._last_good.model_copy(update={
                        "error": f"{snap.error} (showing the snapshot read at {self._last_good.source.read_at})"})
                elif not snap.error:
                    self._last_good = snap
                self._last, self._read_mono = snap, time.monotonic()
            return self._last


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _host_name(header: str) -> str:
    header = header.strip().lower()
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class _Handler(BaseHTTPRequestHandler):
    server: _DashboardHTTPServer
    server_version = "colibri-relay-dashboard"
    sys_version = ""

    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Content-Security-Policy", CSP)
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _host_allowed(self) -> bool:
        if not self.server.loopback_only:
            return True
        return _host_name(self.headers.get("Host", "")) in LOOPBACK_NAMES

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if not self._host_allowed():
            self._send(421, b"this dashboard answers only to localhost / 127.0.0.1\n", "text/plain; charset=utf-8")
            return
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            page = render_page(self.server.cache.get(), refresh_s=self.server.refresh_s)
            self._send(200, page.encode("utf-8"), "text/html; charset=utf-8")
        elif path == "/api/snapshot.json":
            body = self.server.cache.get().model_dump_json(indent=1).encode("utf-8")
            self._send(200, body, "application/json")
        else:
            self._send(404, b"not found: the dashboard serves / and /api/snapshot.json\n", "text/plain; charset=utf-8")

    do_HEAD = do_GET  # noqa: N815

    def _refuse(self) -> None:
        self._send(405, b"read-only dashboard: only GET and HEAD\n", "text/plain; charset=utf-8",
                   {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - signature of the base class
        if self.server.verbose:
            super().log_message(format, *args)


class _DashboardHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, cache: SnapshotCache, refresh_s: int, verbose: bool):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.cache = cache
        self.refresh_s = refresh_s
        self.verbose = verbose
        self.loopback_only = is_loopback(address[0])


class DashboardServer:
    """Serve a relay's dashboard. `port=0` picks a free port (see `.url`).

    >>> server = DashboardServer(DashboardReader(open_store("/tmp/relay")), port=8765)  # doctest: +SKIP
    >>> server.serve_forever()                                                           # doctest: +SKIP
    """

    def __init__(self, reader: DashboardReader, *, host: str = "127.0.0.1", port: int = 0, refresh_s: int = 30,
                 min_interval_s: float | None = None, verbose: bool = False):
        interval = min_interval_s if min_interval_s is not None else max(1.0, refresh_s / 2)
        self.cache = SnapshotCache(reader, interval)
        self.httpd = _DashboardHTTPServer((host, port), self.cache, refresh_s, verbose)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else host
        return f"http://{shown}:{port}/"

    def start(self) -> DashboardServer:
        """Serve in a background thread (tests, embedding); `stop()` ends it."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="relay-dashboard", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
