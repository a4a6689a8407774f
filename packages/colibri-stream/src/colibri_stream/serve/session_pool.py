"""Chat sessions kept between HTTP requests, so a client that resends the conversation (every
OpenAI client does) prefills only its new turn.

After a chat request finishes, its `ChatSession` (its KV cache and token ids) goes back to the
pool; the next chat request takes the pooled session sharing the longest prefix with its own
rendered prompt (a new one when none shares a token) and so reuses that prefix's KV cache. At
most `size` sessions are kept, the least recently returned dropped first; each costs its context's
KV cache (`Engine.kv_bytes_per_token` per token) beyond the engine's budget. A session is used
by one request at a time (taken out of the pool while it runs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from ..chat import ChatSession, common_prefix


class ChatSessionPool:
    def __init__(self, engine, size: int = 4):
        self.engine, self.size = engine, size
        self._free: list[ChatSession] = []
        self._lock = threading.Lock()

    def take(self, prompt_ids: list[int]) -> ChatSession:
        with self._lock:
            shared = [common_prefix(chat.session.tokens, prompt_ids) for chat in self._free]
            if shared and max(shared) > 0:
                return self._free.pop(shared.index(max(shared)))
        return self.engine.chat_session()

    def give(self, chat: ChatSession) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._free.append(chat)
            del self._free[: max(0, len(self._free) - self.size)]

    def returning(self, chat: ChatSession, tokens: Iterator) -> Iterator:
        """`tokens`, then `chat` back into the pool (also when the consumer stops early)."""
        try:
            yield from tokens
        finally:
            self.give(chat)

    def __len__(self) -> int:
        return len(self._free)
