"""The server's one error type, written in the shape of the API that was called.

OpenAI endpoints answer `{"error": {"message", "type", "param", "code"}}`; Anthropic's
`/v1/messages` answers `{"type": "error", "error": {"type", "message"}}`, its `type` taken from
the HTTP status as Anthropic's own API does (400 invalid_request_error, 404 not_found_error, 413
request_too_large, 500 api_error). A client library then raises its own typed exception
(`openai.BadRequestError`, `anthropic.NotFoundError`, ...) with the message the server wrote.
"""

from __future__ import annotations

from ..errors import StreamError

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}


class APIError(StreamError):
    """An HTTP error answer (a `StreamError`, as every colibri-stream error): `status`, and the message, `param` (the request field at fault),
    `code` (a machine-readable reason, e.g. `context_length_exceeded`) and OpenAI `kind`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self, api: str = "openai") -> dict:
        if api == "anthropic":
            return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                                               "message": self.message}}
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for the request's own fault."""
    return APIError(400, message, param, code)


def unsupported(param: str, why: str) -> APIError:
    """A 400 for what this model or server cannot do (never silently ignored)."""
    return APIError(400, f"'{param}' is not supported: {why}", param, "unsupported_parameter")


def cannot(param: str, message: str) -> APIError:
    """A 400 for input this model cannot take (an image to a text model), `message` saying what."""
    return APIError(400, message, param, "unsupported_content")
