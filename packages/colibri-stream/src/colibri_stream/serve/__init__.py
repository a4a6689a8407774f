"""An OpenAI- and Anthropic-compatible HTTP server over an Engine (`colibri-stream serve`): server.py
routes to one module per API (openai_chat.py, openai_completions.py, openai_responses.py,
anthropic_messages.py), all over the same sessions and generation (context.py, runs.py)."""

from .server import ColibriServer, make_server, serve_in_thread

__all__ = ["ColibriServer", "make_server", "serve_in_thread"]
