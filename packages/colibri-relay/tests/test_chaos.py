"""The reliability suite: contender processes race for K legs under kill -9, SIGSTOP > D and
injected Hub faults; the history checker must find zero violations.

Size: COLIBRI_RELAY_CHAOS_LEGS (default 50), COLIBRI_RELAY_CHAOS_PROCS (default 4),
COLIBRI_RELAY_CHAOS_SEED (default 1). A bigger run: `python -m colibri_relay.testing.chaos run --help`.
"""

import json
import os

import pytest
from colibri_relay.testing.chaos import run_chaos

LEGS = int(os.environ.get("COLIBRI_RELAY_CHAOS_LEGS", "50"))
PROCS = int(os.environ.get("COLIBRI_RELAY_CHAOS_PROCS", "4"))
SEED = int(os.environ.get("COLIBRI_RELAY_CHAOS_SEED", "1"))


@pytest.mark.parametrize("store_kind", ["local", "hub"])
def test_chaos_history_has_no_violations(store_kind, tmp_path):
    report = run_chaos(store_kind, legs=LEGS, procs=PROCS, lease_s=1.2, heartbeat_s=0.2, seed=SEED,
                       work=tmp_path / "chaos", timeout_s=240)
    print(json.dumps({k: v for k, v in report.items() if k != "work"}))
    assert report["violations"] == []
    assert report["legs"] >= LEGS
    assert report["kills"] + report["stops"] > 0
    if store_kind == "hub":
        assert sum(report["faults_injected"].values()) > 0
