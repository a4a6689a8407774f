"""The relay's read-only dashboard: baton, ledger, metrics over steps and legs, expert balance.

Modules: `snapshot` (the versioned data model, also the JSON endpoint's schema), `reader` (store +
live run -> Snapshot, read-only), `metrics_reader` (tolerant metrics.jsonl parsing),
`series_builder` (chart data), `charts` (SVG), `page` (HTML), `server` (GET-only HTTP),
`command` (the `colibri-relay dashboard` click command). Spec: DASHBOARD.md.

    from colibri_relay import open_store
    from colibri_relay.dashboard import DashboardReader, DashboardServer
    DashboardServer(DashboardReader(open_store("/tmp/relay"), run_dir="runs/leg")).serve_forever()
"""

from __future__ import annotations

import importlib

# Lazy: `colibri-relay --help` imports the dashboard's command, not its server (~0.1 s).
_EXPORTS = {"DashboardReader": "reader", "DashboardServer": "server", "Snapshot": "snapshot",
            "DASHBOARD_VERSION": "snapshot"}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DashboardReader", "DashboardServer", "Snapshot", "DASHBOARD_VERSION"]
