"""`colibri-relay dashboard`: serve the read-only dashboard of a relay (registered in cli.py).

Fails fast, with one line and exit 2 (bad input), when the store spec is malformed or names no
relay store; a store that is only unreachable for now is served anyway, the page saying so.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from ..errors import RelayError, StoreNotFound, StoreSpecError
from ..stores import open_store


@click.command("dashboard")
@click.option("--store", "-s", required=True, envvar="COLIBRI_RELAY_STORE",
              help="hf://OWNER/REPO (endpoint from HF_ENDPOINT) or a LocalStore directory.")
@click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A local run directory whose metrics.jsonl grows as the current leg trains.")
@click.option("--port", "-p", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="TCP port; 0 picks a free one.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Anything but loopback exposes the page to the network.")
@click.option("--refresh-s", type=click.IntRange(2, 3600), default=30, show_default=True,
              help="Page auto-refresh period; the store is read at most every refresh-s / 2 seconds.")
@click.option("--metrics-path", default=None,
              help="Path of the metrics file inside the payload (default: the shallowest metrics.jsonl).")
@click.option("--verbose", "-v", is_flag=True, help="Log every HTTP request to stderr.")
def dashboard(store: str, run_dir: Path | None, port: int, host: str, refresh_s: int, metrics_path: str | None,
              verbose: bool) -> None:
    """Serve a read-only dashboard of a relay: baton, ledger, metrics charts, expert balance.

    The page and its JSON twin (/api/snapshot.json) only read the store, pinned to one revision per
    refresh; nothing here can claim, release or write. The Hub token is used to read and is never
    sent to the browser.
    """
    from .reader import DashboardReader  # here, not at import: every other command stays fast
    from .server import DashboardServer, is_loopback

    try:
        relay_store = open_store(store)
    except StoreSpecError as exc:
        raise click.UsageError(str(exc)) from None
    reader = DashboardReader(relay_store, run_dir=run_dir, metrics_path=metrics_path)
    try:
        reader.read()
    except StoreNotFound as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except RelayError as exc:
        click.echo(f"warning: cannot read the store yet ({exc}); serving anyway", err=True)
    try:
        server = DashboardServer(reader, host=host, port=port, refresh_s=refresh_s, verbose=verbose)
    except OSError as exc:
        click.echo(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", err=True)
        sys.exit(1)
    if not is_loopback(host):
        click.echo(f"warning: bound to {host}: anyone who can reach this machine can read the dashboard", err=True)
    click.echo(f"dashboard of {store} at {server.url} (read-only; Ctrl-C stops)", err=True)
    click.echo(server.url)
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
