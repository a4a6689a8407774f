"""History checker for relay runs: verifies, through the store API alone, that a relay's history is
what the protocol promises. Used by the chaos test; usable on any real relay (`check_history`).

Checks: history is one linear chain; leg numbers are pushed exactly once and in order; tags
`leg-1..leg-M` exist and point at those push commits; RELAY.json at each push says leg N (and leg
N-1 just before); LEDGER.jsonl at head has exactly legs 1..M and agrees with the tags; every
payload verifies against its manifest, except a push that a later `relay: repair` commit rolled back
(counted as `repaired_legs`); every acknowledged push is present. Optionally, for the
chaos payload, `counter.json` shows each leg built on the previous one.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import RelayError
from ..ledger import LEDGER_JSONL, parse_ledger
from ..payload import pull_payload
from ..relay_state import RELAY_FILE, parse_relay_state
from ..store import RelayStore

PUSH_TITLE = re.compile(r"^relay: push leg (\d+) ")
# repair.py names the commit whose payload it rolled back: "... (<sha12> did not verify)".
REPAIR_TITLE = re.compile(r"^relay: repair .*\(([0-9a-f]{12}) did not verify\)")


def check_history(store: RelayStore, *, min_legs: int = 0, acks: list[dict] | None = None,
                  check_counter: bool = False) -> dict:
    """Return {"legs", "commits", "violations": [...]} for the relay in `store`."""
    violations: list[str] = []

    def state_at(rev: str):
        return parse_relay_state(store.read_file(RELAY_FILE, rev), f"{store.spec}@{rev[:12]} {RELAY_FILE}")

    history = list(reversed(store.history()))  # oldest first
    for prev, cur in zip(history, history[1:], strict=False):
        if cur.parent is not None and cur.parent != prev.sha:
            violations.append(f"history not linear at {cur.sha[:12]}: parent {cur.parent[:12]} != {prev.sha[:12]}")
    index = {c.sha: i for i, c in enumerate(history)}
    pushes: dict[int, list[str]] = {}
    for c in history:
        m = PUSH_TITLE.match(c.title)
        if m:
            pushes.setdefault(int(m.group(1)), []).append(c.sha)
    repaired = {m.group(1) for c in history if (m := REPAIR_TITLE.match(c.title))}
    legs = max(pushes, default=0)
    for n in range(1, legs + 1):
        if len(pushes.get(n, [])) != 1:
            violations.append(f"leg {n} pushed {len(pushes.get(n, []))} times: {[s[:12] for s in pushes.get(n, [])]}")
    order = [pushes[n][0] for n in range(1, legs + 1) if len(pushes.get(n, [])) == 1]
    if [index[s] for s in order] != sorted(index[s] for s in order):
        violations.append("push commits are not in leg order along the history")
    tags = store.list_tags()
    leg_tags = {int(t[4:]): sha for t, sha in tags.items() if re.fullmatch(r"leg-\d+", t)}
    if set(leg_tags) != set(range(1, legs + 1)):
        violations.append(f"leg tags {sorted(leg_tags)} != pushed legs 1..{legs}")
    head_state = state_at(history[-1].sha)
    if head_state.leg != legs:
        violations.append(f"RELAY.json at head says leg {head_state.leg}, history has {legs} pushes")
    ledger = parse_ledger(store.read_file(LEDGER_JSONL, history[-1].sha), f"{store.spec} {LEDGER_JSONL}")
    if [e.leg for e in ledger] != list(range(1, legs + 1)):
        violations.append(f"LEDGER.jsonl legs {[e.leg for e in ledger]} != 1..{legs}")
    staging = Path(tempfile.mkdtemp(prefix="relay-check-"))
    prev_chain: list = []
    try:
        for n in range(1, legs + 1):
            if len(pushes.get(n, [])) != 1:
                continue
            sha = pushes[n][0]
            if leg_tags.get(n) != sha:
                violations.append(f"tag leg-{n} -> {str(leg_tags.get(n))[:12]}, push commit is {sha[:12]}")
            st = state_at(sha)
            before = state_at(history[index[sha] - 1].sha)
            if st.leg != n or st.leg_commit is not None or before.leg != n - 1:
                violations.append(f"leg {n}: RELAY.json leg {st.leg} (before: {before.leg}) at push {sha[:12]}")
            if n <= len(ledger):
                e = ledger[n - 1]
                if e.holder != st.holder or e.lease_id != st.lease_id:
                    violations.append(f"leg {n}: ledger holder {e.holder} != RELAY.json holder {st.holder}")
                if e.base_commit not in index or index[e.base_commit] >= index[sha] or (
                        n > 1 and index[e.base_commit] < index[pushes[n - 1][0]]):
                    violations.append(f"leg {n}: base commit {e.base_commit[:12]} not between legs {n - 1} and {n}")
            if sha[:12] in repaired:  # its payload never verified and was rolled back: not a loss
                prev_chain = None
                continue
            try:
                dest = staging / str(n)
                pull_payload(store, sha, st.payload, dest)
            except RelayError as exc:
                violations.append(f"leg {n}: payload does not verify: {exc}")
                continue
            if check_counter:
                counter = json.loads((dest / "counter.json").read_text())
                if counter["leg"] != n or (prev_chain is not None and counter["chain"][:-1] != prev_chain):
                    violations.append(f"leg {n}: counter {counter['leg']} / chain does not extend leg {n - 1}")
                prev_chain = counter["chain"]
            shutil.rmtree(dest, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for ack in acks or []:
        if leg_tags.get(ack["leg"]) != ack["commit"]:
            violations.append(f"acknowledged push of leg {ack['leg']} ({ack['commit'][:12]}) is not tag leg-{ack['leg']}")
    if legs < min_legs:
        violations.append(f"only {legs} legs pushed, wanted {min_legs}")
    return {"legs": legs, "commits": len(history), "acks": len(acks or []), "repaired_legs": len(repaired),
            "violations": violations}
