"""`colibri-stream serve CONTAINER`: the OpenAI- and Anthropic-compatible HTTP server (serve/server.py).

    colibri-stream serve model.coli --ram-budget 600MB                 # http://127.0.0.1:8000/v1
    colibri-stream serve model.coli --ram-budget auto --port 8080 --model-name colibri

Then any OpenAI client: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")`, or
Anthropic's: `Anthropic(base_url="http://127.0.0.1:8000", api_key="unused")`.
"""

from __future__ import annotations

import click

from .run import _open_engine, engine_options


@click.command()
@click.argument("container", type=click.Path(exists=True, dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Loopback by default: the server has no authentication.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: any free port.")
@click.option("--model-name", default=None, help="The model id clients name (default: the container's file stem).")
@click.option("--keep-sessions", type=click.IntRange(min=0), default=4, show_default=True,
              help="Chat sessions kept between requests, so a resent conversation prefills only its new turn; "
              "each holds its KV cache beyond --ram-budget (0: none).")
@click.option("--chat-template", "chat_template", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Jinja chat template file (transformers' kind) to use instead of the container's, e.g. one "
              "that renders `tools`.")
@click.option("--batch-sessions/--no-batch-sessions", default=True, show_default=True,
              help="Continuous batching: the decode steps of requests generating at the same time run as one "
              "forward pass (each distinct expert read once for all); off: one request's pass at a time.")
@click.option("--embedding-pooling", type=click.Choice(["mean", "last"]), default="mean", show_default=True,
              help="/v1/embeddings: the mean of the last hidden state over the input's tokens, or the last token's.")
@click.option("--verbose", is_flag=True, help="Log every request (and tracebacks of server errors) to stderr.")
@engine_options(required_budget=True)
def serve(container, host, port, model_name, keep_sessions, chat_template, batch_sessions, embedding_pooling, verbose,
          **options):
    """Serve CONTAINER over HTTP: OpenAI's /v1/chat/completions, /v1/completions, /v1/responses,
    /v1/embeddings and /v1/models, Anthropic's /v1/messages (stream: true for server-sent events)."""
    from pathlib import Path

    from ..serve.server import make_server

    engine = _open_engine(container, options, batch_sessions=batch_sessions)
    with engine:
        try:
            template = Path(chat_template).read_text(encoding="utf-8") if chat_template else None
            server = make_server(engine, host, port, model_name, verbose, keep_sessions, template, embedding_pooling)
        except OSError as exc:
            raise click.UsageError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
        click.echo(f"serving {server.model_name} at {server.url} (Ctrl-C stops)", err=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
