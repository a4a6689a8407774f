"""The relay's read-only dashboard: baton, ledger, metrics over steps and legs, expert balance.

Modules: `snapshot` (the versioned data model, also the JSON endpoint's schema), `reader` (store +
live run -> Snapshot, read-only), `metrics_reader` (tolerant metrics.jsonl parsing),
`series_builder` (chart data), `charts` (SVG), `page` (HTML), `server` (GET-only HTTP),
`command` (the `colibri-relay dashboard` click command). Spec: DASHBOARD.md.

    from colibri_relay import open_store
    from colibri_relay.dashboard import DashboardReader, DashboardServer
    DashboardServer(DashboardReader(open_store("/tmp/relay"), run_dir="runs/leg")).serve_forever()
"""

from .reader import DashboardReader
from .server import DashboardServer
from .snapshot import DASHBOARD_VERSION, Snapshot

__all__ = ["DashboardReader", "DashboardServer", "Snapshot", "DASHBOARD_VERSION"]
