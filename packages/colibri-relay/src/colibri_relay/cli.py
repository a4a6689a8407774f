"""The `colibri-relay` command: init, status, claim, release, ledger, fake-hub.

Exit status, as for every Colibri command: 0 ok; 1 a check failed or the operation could not be
done (the baton is held, the lease was lost, a file failed its checksum); 2 bad usage or bad
input (an unknown flag, a malformed store spec, no store or no relay at that address). Errors are
one line on stderr, with no traceback; each `RelayError` carries its `exit_code`. The Hub token comes from HF_TOKEN / the huggingface_hub login and is never printed.
`claim` holds the lease in the foreground (heartbeat running) until Ctrl-C or `--hold-s` elapses,
then releases: a human-driven lease for manual work on the repo.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import click

from . import __version__
from .errors import LeaseLost, RelayError
from .relay import Relay


def _relay(store: str, **kw) -> Relay:
    try:
        return Relay(store, **kw)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _fail(exc: RelayError) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(exc.exit_code)


SECONDS = click.FloatRange(min=0, min_open=True)


STORE = click.option("--store", "-s", required=True, envvar="COLIBRI_RELAY_STORE",
                     help="hf://OWNER/REPO (endpoint from HF_ENDPOINT) or a directory path.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="colibri-relay")
def main() -> None:
    """A Hub relay for turn-based training: a compare-and-swap lease, a ledger, a fake Hub.

    Exit status: 0 ok, 1 a check failed (e.g. the baton is held, the lease was lost, a checksum
    failed), 2 bad usage or bad input.
    """


@main.command()
@STORE
@click.option("--lease-s", type=SECONDS, default=1200.0, show_default=True, help="Lease duration D in seconds.")
@click.option("--heartbeat-s", type=SECONDS, default=300.0, show_default=True, help="Heartbeat period in seconds.")
def init(store: str, lease_s: float, heartbeat_s: float) -> None:
    """Create an empty relay: baton free, leg 0, empty ledger (idempotent)."""
    try:
        head, state = _relay(store, lease_duration_s=lease_s, heartbeat_s=heartbeat_s).init()
    except RelayError as exc:
        _fail(exc)
    click.echo(f"relay ready at {store}: head {head}, leg {state.leg}, baton {state.status}")


@main.command()
@STORE
@click.option("--json", "as_json", is_flag=True, help="Print RELAY.json state and the head sha as JSON.")
def status(store: str, as_json: bool) -> None:
    """Show who holds the baton, the leg count and the head commit."""
    try:
        head, state = _relay(store).status()
    except RelayError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps({"head": head, "state": state.model_dump()}, indent=2, sort_keys=True))
        return
    holder = f"held by {state.holder} (epoch {state.epoch}, seq {state.seq})" if state.status == "held" else "free"
    click.echo(f"store:   {store}\nhead:    {head}\nbaton:   {holder}\nlegs:    {state.leg}\n"
               f"payload: {len(state.payload)} files, {sum(f.size for f in state.payload.values())} bytes\n"
               f"updated: {state.updated_at} (writer's clock)")


@main.command()
@STORE
@click.option("--holder", default=None, help="Name recorded in RELAY.json (default user@host:pid).")
@click.option("--wait/--no-wait", default=False, show_default=True, help="Wait for a held baton to expire.")
@click.option("--hold-s", type=SECONDS, default=None, help="Release after this many seconds (default: until Ctrl-C).")
@click.option("--lease-s", type=SECONDS, default=1200.0, show_default=True, help="Lease duration D in seconds.")
@click.option("--heartbeat-s", type=SECONDS, default=300.0, show_default=True, help="Heartbeat period in seconds.")
def claim(store: str, holder: str | None, wait: bool, hold_s: float | None, lease_s: float, heartbeat_s: float) -> None:
    """Claim the baton and hold it (heartbeat running) until Ctrl-C or --hold-s, then release."""
    relay = _relay(store, holder=holder, lease_duration_s=lease_s, heartbeat_s=heartbeat_s)
    try:
        leg = relay.claim(wait=wait)
    except RelayError as exc:
        _fail(exc)
    click.echo(f"claimed {store}: epoch {leg.state.epoch}, lease {leg.state.lease_id}; next leg {leg.number}")
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    end = None if hold_s is None else time.monotonic() + hold_s
    try:
        while not stop["now"] and (end is None or time.monotonic() < end):
            leg.check()
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    except LeaseLost as exc:
        _fail(exc)
    released = leg.release()
    click.echo("released" if released else "lease was already lost; nothing released")


@main.command()
@STORE
@click.option("--lease-id", default=None, help="Release only if this lease (printed by `claim`) holds the baton.")
@click.option("--force", is_flag=True, help="Release whatever lease holds the baton.")
def release(store: str, lease_id: str | None, force: bool) -> None:
    """Free the baton from outside the holder (e.g. after a crashed `claim`).

    One CAS write on the current head: a still-running holder is fenced by it on its next
    heartbeat and can push nothing. Give --lease-id, or --force to release any holder."""
    if not lease_id and not force:
        raise click.UsageError("give --lease-id ID (as printed by `claim`) or --force")
    try:
        head, state = _relay(store).force_release(lease_id)
    except RelayError as exc:
        _fail(exc)
    click.echo(f"baton free at {head} (leg {state.leg})")


@main.command()
@STORE
@click.option("--json", "as_json", is_flag=True, help="Print LEDGER.jsonl entries as a JSON list.")
@click.option("--revision", default=None, help="Commit sha or tag (default: head).")
def ledger(store: str, as_json: bool, revision: str | None) -> None:
    """Print the ledger (one line per pushed leg)."""
    try:
        entries = _relay(store).ledger(revision)
    except RelayError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps([e.model_dump() for e in entries], indent=2))
        return
    if not entries:
        click.echo("no legs pushed yet")
    for e in entries:
        click.echo(f"leg {e.leg:4d}  {e.finished_at}  {e.holder}  steps {e.steps}  tokens {e.tokens}  "
                   f"hours {e.hours:.3f}  loss {e.loss_start} -> {e.loss_end}")


@main.command()
@STORE
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for a held baton to expire.")
def repair(store: str, wait: bool) -> None:
    """Roll a head whose payload does not verify back to the last verified payload.

    Claims the baton, checks the payload at the head against RELAY.json's manifest and, if it does
    not hold, writes ONE CAS commit restoring the newest payload that does (legs, ledger and tags
    are kept), then releases."""
    try:
        sha = _relay(store).repair(wait=wait)
    except RelayError as exc:
        _fail(exc)
    click.echo(f"payload restored in commit {sha}" if sha else "the head's payload verifies: nothing to repair")


def _commit_quota(ctx, param, value: str):
    from .testing.fake_hub import parse_commit_quota

    try:
        return parse_commit_quota(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


@main.command("fake-hub")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True, help="0 picks a free port.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, help="Where blobs go (default: temp).")
@click.option("--commit-quota", default="128/3600", show_default=True, callback=_commit_quota,
              metavar="N/WINDOW|off",
              help="Commits per repo per WINDOW seconds, a sliding window; a commit past it gets the Hub's "
                   "429 (\"You can retry this action in ...\"). 128/3600 is the Hub's; scale WINDOW with "
                   "your test's lease (e.g. 20/10), or turn it off.")
def fake_hub(port: int, data_dir: str | None, commit_quota: tuple[int, float] | None) -> None:
    """Serve a fake Hub on 127.0.0.1 until stopped (clients need HF_HUB_DISABLE_XET=1)."""
    from .testing.fake_hub import FakeHub

    try:
        hub = FakeHub(port=port, data_dir=data_dir, commit_rate_limit=commit_quota)
    except OSError as exc:
        _fail(RelayError(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}"))
    click.echo(f"fake Hub serving at {hub.endpoint} (HF_ENDPOINT={hub.endpoint} HF_HUB_DISABLE_XET=1)", err=True)
    click.echo(hub.endpoint)
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        hub.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        hub.stop()


def _register_dashboard() -> None:
    # The read-only dashboard lives in its own subpackage (DASHBOARD.md).
    from .dashboard.command import dashboard

    main.add_command(dashboard)


_register_dashboard()

if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
    main()
