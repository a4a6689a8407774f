"""How HubStore reads the Hub's error answers: which wait a 429 asks for, which typed error a read
failure is. Kept apart from the store (store.py, reader.py) so the mapping can be tested without a
server.

The Hub has two limiters a relay meets (huggingface/huggingface_hub#3186, braindecode/braindecode#947):

* the per-user `api` window (1000 requests / 300 s), announced in IETF `RateLimit` headers
  (`"api";r=0;t=271`), which `huggingface_hub.utils.parse_ratelimit_headers` reads;
* the per-repo commit quota ("You have exceeded the rate limit for repository commits (128 per hour).
  You can retry this action in about 1 hour"), whose wait is ONLY in the message. A 429 may carry
  both (the header then tells the api window's reset, a few minutes, while commits stay refused for
  the hour), so the wait is the longest of the header, `Retry-After` and the message.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ..errors import FileNotFoundInStore, RateLimited, RevisionNotFound, StoreError, StoreNotFound

DEFAULT_RETRY_S = 5.0
_UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
_MESSAGE_WAIT = re.compile(r"retry (?:this action |again )?(?:in|after) (?:about |approximately )?"
                           r"(\d+|an?|one) (second|minute|hour|day)s?", re.IGNORECASE)


def wait_in_message(message: str) -> float | None:
    """Seconds named by a sentence like "You can retry this action in 43 minutes" (None if absent)."""
    waits = []
    for count, unit in _MESSAGE_WAIT.findall(message or ""):
        n = 1 if count.lower() in ("a", "an", "one") else int(count)
        waits.append(float(n * _UNITS[unit.lower()]))
    return max(waits) if waits else None


def retry_after_s(headers: Mapping[str, str], message: str = "") -> float:
    """The wait a 429 asks for: the longest of RateLimit reset, Retry-After and the message's wait."""
    waits: list[float] = []
    try:
        from huggingface_hub.utils import parse_ratelimit_headers

        info = parse_ratelimit_headers(headers)
        if info is not None:
            waits.append(float(info.reset_in_seconds))
    except Exception:  # noqa: BLE001 - header parsing is best effort
        pass
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        waits.append(float(lower["retry-after"]))
    except (KeyError, ValueError):
        pass
    in_message = wait_in_message(message)
    if in_message is not None:
        waits.append(in_message)
    return max(waits) if waits else DEFAULT_RETRY_S


def error_text(exc: Exception) -> str:
    """The server's words for an HfHubHTTPError: the exception text plus the reply body."""
    text = str(exc)
    response = getattr(exc, "response", None)
    try:
        body = response.text if response is not None else ""
    except Exception:  # noqa: BLE001 - a streamed or closed body
        body = ""
    return f"{text}\n{body}"


def first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def retry_after(err: HfHubHTTPError) -> float:
    """The wait a 429 asks for, from its headers and its message."""
    return retry_after_s(err.response.headers if err.response is not None else {}, error_text(err))


def read_error(exc: Exception, what: str, *, repo_id: str, endpoint: str, path: str | None = None,
               revision: str | None = None) -> StoreError:
    """The typed error for a failed request `what` on the Hub repo `repo_id`: StoreNotFound,
    RevisionNotFound, FileNotFoundInStore (when `path` is given), RateLimited, else StoreError."""
    if isinstance(exc, RepositoryNotFoundError):
        return StoreNotFound(f"Hub repo {repo_id} not found at {endpoint}")
    if isinstance(exc, RevisionNotFoundError):
        return RevisionNotFound(f"revision {revision} not found in {repo_id}")
    if isinstance(exc, EntryNotFoundError) and path is not None:
        return FileNotFoundInStore(path, revision or "?")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code == 429:
        return RateLimited(f"{what}: rate limited by the Hub", retry_after(exc))
    return StoreError(f"{what} on {repo_id} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
