"""`colibri-stream serve`: an OpenAI- and Anthropic-compatible HTTP server over one `Engine`
(stdlib only).

    server = make_server(engine, "127.0.0.1", 8000, model_name="tiny")   # port 0: any free port
    server.serve_forever()

Routes: `/v1/chat/completions` (openai_chat.py), `/v1/completions` (openai_completions.py),
`/v1/responses` (openai_responses.py), `/v1/messages` (anthropic_messages.py),
`/v1/embeddings` (openai_embeddings.py), `/v1/models`, and the tokenizer (`/tokenize`,
`/detokenize`, `/tokenizer_info`: tokenizer_api.py). A `ThreadingHTTPServer`: one thread per
connection, each request on its own session; the decode steps of requests generating at the same
time run as one pass (the engine's `batch_sessions`, step_combiner.py: continuous batching),
prefills one at a time between them. Chat sessions are kept between
requests (session_pool.py), so a resent conversation prefills only its new turn. `stream: true`
answers with server-sent events and closes the connection; a client that goes away stops its
generation. Errors are in the called API's shape (errors.py): 400 for a bad request (malformed
JSON, a bad, unknown or unsupported field, a prompt that does not fit the context), 404 for an
unknown model or path, 405 for a wrong method, 413 for a body over 16 MiB, 500 for anything else
(the message names it). Loopback by default: there is no authentication, so binding another
address is the caller's explicit choice.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..chat import ChatTemplate
from . import (
    anthropic_messages,
    openai_chat,
    openai_completions,
    openai_embeddings,
    openai_responses,
    tokenizer_api,
)
from .constrained import Grammars
from .context import ServeContext
from .errors import APIError
from .session_pool import ChatSessionPool

MAX_BODY_BYTES = 16 << 20
ROUTES = {"/v1/chat/completions": (openai_chat.answer, "openai"),
          "/v1/completions": (openai_completions.answer, "openai"),
          "/v1/responses": (openai_responses.answer, "openai"),
          "/v1/embeddings": (openai_embeddings.answer, "openai"),
          "/v1/messages": (anthropic_messages.answer, "anthropic")}
TOKENIZER = {"/tokenize": tokenizer_api.tokenize, "/detokenize": tokenizer_api.detokenize}


class Handler(BaseHTTPRequestHandler):
    server: ColibriServer
    protocol_version = "HTTP/1.0"  # one request per connection: simple and correct for SSE

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

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/")

    def do_GET(self):  # noqa: N802 - the stdlib's name
        path, ctx = self._path(), self.server.ctx
        models = models_response(ctx.model_name, self.server.created)
        if path == "/v1/models":
            self._send_json(200, models)
        elif path in ("/tokenizer_info", "/v1/tokenizer_info"):
            self._send_json(200, tokenizer_api.tokenizer_info(ctx))
        elif path == f"/v1/models/{ctx.model_name}":
            self._send_json(200, models["data"][0])
        elif path in ROUTES:
            self._send_json(405, APIError(405, f"{path} takes POST", code="method_not_allowed").body(ROUTES[path][1]))
        else:
            self._send_json(404, APIError(404, f"no route {path}", code="not_found").body())

    def do_POST(self):  # noqa: N802
        path = self._path()
        tokenizer = TOKENIZER.get(path.removeprefix("/v1"))
        if tokenizer is not None:
            try:
                return self._send_json(200, tokenizer(self.server.ctx, self._read_json()))
            except APIError as exc:
                return self._send_json(exc.status, exc.body())
        if path not in ROUTES:
            return self._send_json(404, APIError(404, f"no route {path}", code="not_found").body())
        endpoint, api = ROUTES[path]
        try:
            answer = endpoint(self.server.ctx, self._read_json())
            if answer.events is None:
                return self._send_json(200, answer.body)
            self._stream(answer, api)
        except APIError as exc:
            self._send_json(exc.status, exc.body(api))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # one request's failure must not take the server down
            if self.server.verbose:
                traceback.print_exc()
            error = APIError(500, f"{type(exc).__name__}: {exc}", kind="server_error")
            self._send_json(500, error.body(api))

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

    def _stream(self, answer, api: str) -> None:
        events = iter(answer.events)
        first = next(events, None)  # an error before the first event is still a plain HTTP error
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            if first is not None:
                self._event(*first)
            for name, data in events:
                self._event(name, data)
            if answer.done_marker:
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # after the 200 went out: the error becomes the stream's last event
            if self.server.verbose:
                traceback.print_exc()
            error = exc if isinstance(exc, APIError) else APIError(500, f"{type(exc).__name__}: {exc}",
                                                                   kind="server_error")
            try:
                self._event("error" if api == "anthropic" else None, error.body(api))
            except (BrokenPipeError, ConnectionResetError):
                pass
        finally:
            close = getattr(answer.events, "close", None)
            if close is not None:
                close()  # the client left (or the stream ended): stop generating

    def _event(self, name: str | None, data: dict) -> None:
        head = f"event: {name}\n".encode() if name else b""
        self.wfile.write(head + b"data: " + json.dumps(data).encode("utf-8") + b"\n\n")
        self.wfile.flush()


class ColibriServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, engine, model_name: str, verbose: bool = False, keep_sessions: int = 4,
                 chat_template: str | None = None, embedding_pooling: str = "mean"):
        super().__init__(address, Handler)
        self.engine, self.verbose = engine, verbose
        template = engine.chat_template
        if chat_template is not None:  # the caller's Jinja template in place of the container's
            config = engine.container.tokenizer_config or {}
            template = ChatTemplate(engine.tokenizer, chat_template, config.get("bos_token"), config.get("eos_token"))
        if embedding_pooling not in ("mean", "last"):
            raise ValueError(f"embedding_pooling must be mean or last, got {embedding_pooling!r}")
        self.ctx = ServeContext(engine, model_name, ChatSessionPool(engine, keep_sessions), template,
                                grammars=Grammars(engine), embedding_pooling=embedding_pooling)
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        return self.ctx.model_name

    @property
    def pool(self) -> ChatSessionPool:
        return self.ctx.pool

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


def models_response(model_name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "colibri-stream"}]}


def make_server(engine, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                verbose: bool = False, keep_sessions: int = 4, chat_template: str | None = None,
                embedding_pooling: str = "mean") -> ColibriServer:
    """`keep_sessions`: chat sessions kept between requests for prefix reuse (session_pool.py);
    `chat_template`: a Jinja chat template (transformers' kind) used instead of the container's;
    `embedding_pooling`: "mean" or "last" token's hidden state for /v1/embeddings."""
    from pathlib import Path

    return ColibriServer((host, port), engine, model_name or Path(engine.path).stem, verbose, keep_sessions,
                         chat_template, embedding_pooling)


def serve_in_thread(server: ColibriServer) -> threading.Thread:
    """Run `server` on a daemon thread (tests, notebooks); `server.shutdown()` stops it."""
    thread = threading.Thread(target=server.serve_forever, name="colibri-serve", daemon=True)
    thread.start()
    return thread
