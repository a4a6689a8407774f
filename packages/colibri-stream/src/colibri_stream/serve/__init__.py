"""An OpenAI-compatible HTTP server over an Engine (`colibri-stream serve`): server.py, openai_api.py."""

from .server import ColibriServer, make_server, serve_in_thread

__all__ = ["ColibriServer", "make_server", "serve_in_thread"]
