"""`colibri-stream serve`: an OpenAI-compatible HTTP server over one `Engine` (stdlib only).

    server = make_server(engine, "127.0.0.1", 8000, model_name="tiny")   # port 0: any free port
    server.serve_forever()

A `ThreadingHTTPServer`: one thread per connection, each request on its own session (the engine's
lock serialises forward passes, so requests interleave token by token); chat sessions are kept
between requests (session_pool.py), so a resent conversation prefills only its new turn. `stream: true` answers
with server-sent events (`data: {json}` per chunk, then `data: [DONE]`) and closes the
connection; a client that goes away stops its generation. Errors are OpenAI-shaped JSON
(`{"error": {"message", "type", "param", "code"}}`): 400 for a bad request (malformed JSON, a bad
or unsupported parameter, a prompt that does not fit the context), 404 for an unknown model or
path, 405 for a wrong method, 500 for anything else (the message names it). Loopback by default:
there is no authentication, so binding another address is the caller's explicit choice.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .openai_api import APIError, full_response, models_response, parse_request, start, stream_chunks
from .session_pool import ChatSessionPool

MAX_BODY_BYTES = 16 << 20
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class Handler(BaseHTTPRequestHandler):
    server: ColibriServer
    protocol_version = "HTTP/1.0"  # one request per connection: simple and correct for SSE

    # --- plumbing -----------------------------------------------------------------------------
    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        if self.server.verbose:
            super().log_message(format, *args)

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: APIError) -> None:
        self._send_json(exc.status, exc.body())

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/")

    # --- methods ------------------------------------------------------------------------------
    def do_GET(self):  # noqa: N802 - the stdlib's name
        path = self._path()
        if path == "/v1/models":
            self._send_json(200, models_response(self.server.model_name, self.server.created))
        elif path == f"/v1/models/{self.server.model_name}":
            self._send_json(200, models_response(self.server.model_name, self.server.created)["data"][0])
        elif path in ROUTES:
            self._error(APIError(405, f"{path} takes POST", code="method_not_allowed"))
        else:
            self._error(APIError(404, f"no route {path}", code="not_found"))

    def do_POST(self):  # noqa: N802
        path = self._path()
        kind = ROUTES.get(path)
        if kind is None:
            return self._error(APIError(404, f"no route {path}", code="not_found"))
        try:
            body = self._read_json()
            request = parse_request(kind, body, self.server.model_name)
            tokens, result = start(self.server.engine, request, self.server.pool)
            if request.stream:
                return self._stream(request, tokens, result)
            for _ in tokens:
                pass
            self._send_json(200, full_response(self.server.engine, request, self.server.model_name, result))
        except APIError as exc:
            self._error(exc)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # one request's failure must not take the server down
            if self.server.verbose:
                traceback.print_exc()
            self._error(APIError(500, f"{type(exc).__name__}: {exc}", kind="server_error"))

    def _read_json(self):
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise APIError(400, "bad Content-Length header") from None
        if length > MAX_BODY_BYTES:
            raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None

    def _stream(self, request, tokens, result) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        chunks = stream_chunks(self.server.engine, request, self.server.model_name, tokens, result)
        try:
            for chunk in chunks:
                self.wfile.write(b"data: " + json.dumps(chunk).encode("utf-8") + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            chunks.close()  # the client left: stop generating
            tokens.close()


class ColibriServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, engine, model_name: str, verbose: bool = False, keep_sessions: int = 4):
        super().__init__(address, Handler)
        self.engine, self.model_name, self.verbose = engine, model_name, verbose
        self.pool = ChatSessionPool(engine, keep_sessions)
        self.created = int(time.time())

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


def make_server(engine, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                verbose: bool = False, keep_sessions: int = 4) -> ColibriServer:
    """`keep_sessions`: chat sessions kept between requests for prefix reuse (session_pool.py)."""
    from pathlib import Path

    return ColibriServer((host, port), engine, model_name or Path(engine.path).stem, verbose, keep_sessions)


def serve_in_thread(server: ColibriServer) -> threading.Thread:
    """Run `server` on a daemon thread (tests, notebooks); `server.shutdown()` stops it."""
    thread = threading.Thread(target=server.serve_forever, name="colibri-serve", daemon=True)
    thread.start()
    return thread
