"""History checker for parallel rounds: replays the main and companion repos through the store API and
asserts what ROUNDS.md promises. Used by the round chaos test; usable on any real run.

Invariants checked:
* main: one linear chain; exactly one `relay: merge round R` commit per round, rounds 0..N-1 in
  order; RELAY.json at head says round N; LEDGER.jsonl holds rounds 0..N-1, each written by its
  merge commit, naming the digest of the base the merge started from;
* exactly once: for every round, the contributions named by the companion's CLOSED.json are each
  in the ledger entry exactly once, merged or rejected with a reason, and nothing else is; no
  contribution landed in the companion after its round's close; every acknowledged contribution
  (`acks`) is in its round's entry with the same nonce;
* provenance: every merged contribution's base digest is its round's base;
* the outer step: `replay(entry, base_dir, new_dir, contributions)` (the caller's reference merge)
  returns no complaint for any round.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..contribution import CLOSED_FILE, ClosedRound, fetch_contribution, parse_companion_file, round_dir
from ..errors import RelayError
from ..ledger import LEDGER_JSONL
from ..payload import pull_payload
from ..relay_state import RELAY_FILE, parse_relay_state
from ..round_state import parse_round_ledger, rounds_of
from ..rounds import REUPLOAD_TITLE, payload_digest
from ..store import RelayStore

MERGE_TITLE = re.compile(r"^relay: merge round (\d+) ")
CLOSE_TITLE = re.compile(r"^rounds: close round (\d+) ")
CONTRIB_TITLE = re.compile(r"^rounds: contribution round (\d+) slot (\d+) ")


Replay = Callable[[object, Path, Path, list], list[str]]


def _pull_new_base(store: RelayStore, history: list, at: int, manifest: dict, dest: Path) -> None:
    """The merged base: at its merge commit, or, if the store dropped a file from that commit, at the
    merger's re-upload that follows it (rounds.py) before anything else is merged."""
    candidates = [history[at].sha]
    for c in history[at + 1:]:
        if MERGE_TITLE.match(c.title):
            break
        if c.title.startswith(REUPLOAD_TITLE):
            candidates.append(c.sha)
    for i, sha in enumerate(candidates):
        try:
            pull_payload(store, sha, manifest, dest)
            return
        except RelayError:
            if i == len(candidates) - 1:
                raise


def check_round_history(store: RelayStore, companion: RelayStore, *, min_rounds: int = 0,
                        acks: list[dict] | None = None, replay: Replay | None = None) -> dict:
    """Return {"rounds", "contributions", "rejected", "violations": [...]} for the run in `store`."""
    violations: list[str] = []

    def state_at(rev: str):
        return parse_relay_state(store.read_file(RELAY_FILE, rev), f"{store.spec}@{rev[:12]} {RELAY_FILE}")

    history = list(reversed(store.history()))
    for prev, cur in zip(history, history[1:], strict=False):
        if cur.parent is not None and cur.parent != prev.sha:
            violations.append(f"main history not linear at {cur.sha[:12]}")
    index = {c.sha: i for i, c in enumerate(history)}
    merges: dict[int, list[str]] = {}
    for c in history:
        if m := MERGE_TITLE.match(c.title):
            merges.setdefault(int(m.group(1)), []).append(c.sha)
    n = max(merges, default=-1) + 1
    for r in range(n):
        if len(merges.get(r, [])) != 1:
            violations.append(f"round {r} merged {len(merges.get(r, []))} times")
    head_rounds = rounds_of(state_at(history[-1].sha))
    if head_rounds.round != n:
        violations.append(f"RELAY.json at head says round {head_rounds.round}, history has {n} merges")
    ledger = parse_round_ledger(store.read_file(LEDGER_JSONL, history[-1].sha), f"{store.spec} {LEDGER_JSONL}")
    if [e.round for e in ledger] != list(range(n)):
        violations.append(f"ledger rounds {[e.round for e in ledger]} != 0..{n - 1}")

    chist = list(reversed(companion.history()))
    cindex = {c.sha: i for i, c in enumerate(chist)}
    closes: dict[int, list[int]] = {}
    for i, c in enumerate(chist):
        # A close commit the store landed without its CLOSED.json closed nothing (its writer saw
        # CommitNotVerified and closed again): only closes whose tree holds the marker count.
        if (m := CLOSE_TITLE.match(c.title)) and f"{round_dir(int(m.group(1)))}/{CLOSED_FILE}" in companion.list_files(c.sha):
            closes.setdefault(int(m.group(1)), []).append(i)
    for i, c in enumerate(chist):
        if (m := CONTRIB_TITLE.match(c.title)) and closes.get(int(m.group(1))) and i > closes[int(m.group(1))][0]:
            violations.append(f"a contribution to round {m.group(1)} landed after its close ({c.sha[:12]})")
    for r, where in closes.items():
        if len(where) != 1:
            violations.append(f"round {r} closed {len(where)} times in the companion")

    staging = Path(tempfile.mkdtemp(prefix="rounds-check-"))
    total_merged = total_rejected = 0
    try:
        for entry in ledger:
            r = entry.round
            if len(merges.get(r, [])) != 1:
                continue
            sha = merges[r][0]
            before = history[index[sha] - 1].sha
            base_state, new_state = state_at(before), state_at(sha)
            if rounds_of(base_state).round != r or rounds_of(new_state).round != r + 1:
                violations.append(f"round {r}: RELAY.json {rounds_of(base_state).round} -> "
                                  f"{rounds_of(new_state).round} at its merge")
            if entry.base_digest != payload_digest(base_state.payload):
                violations.append(f"round {r}: ledger base digest is not the base before its merge")
            if entry.close_commit not in cindex or cindex[entry.close_commit] not in closes.get(r, []):
                violations.append(f"round {r}: close commit {entry.close_commit[:12]} is not round {r}'s close")
                continue
            path = f"{round_dir(r)}/{CLOSED_FILE}"
            closed = parse_companion_file(ClosedRound, companion.read_file(path, entry.close_commit), path)
            landed = {s.slot: s.nonce for s in closed.contributions}
            named = [c.slot for c in entry.contributions] + [j.slot for j in entry.rejected]
            if sorted(named) != sorted(landed):
                violations.append(f"round {r}: ledger names slots {sorted(named)}, the close {sorted(landed)}")
            for c in entry.contributions:
                if landed.get(c.slot) != c.nonce:
                    violations.append(f"round {r} slot {c.slot}: merged nonce {c.nonce} is not the landed one")
            total_merged += len(entry.contributions)
            total_rejected += len(entry.rejected)
            if replay is None:
                continue
            base_dir, new_dir, cdir = staging / f"{r}-base", staging / f"{r}-new", staging / f"{r}-c"
            try:
                pull_payload(store, before, base_state.payload, base_dir)
                _pull_new_base(store, history, index[sha], new_state.payload, new_dir)
                contribs = [fetch_contribution(companion, entry.close_commit, r, c.slot, cdir)
                            for c in entry.contributions]
            except RelayError as exc:
                violations.append(f"round {r}: cannot replay: {exc}")
                continue
            for meta, _ in contribs:
                if meta.base_digest != entry.base_digest:
                    violations.append(f"round {r} slot {meta.slot}: merged a contribution on another base")
            violations += [f"round {r}: {v}" for v in replay(entry, base_dir, new_dir, contribs)]
            for d in (base_dir, new_dir, cdir):
                shutil.rmtree(d, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    by_round = {e.round: e for e in ledger}
    for ack in acks or []:
        e = by_round.get(ack["round"])
        nonces = set() if e is None else {c.nonce for c in e.contributions} | {j.nonce for j in e.rejected}
        if ack["nonce"] not in nonces:
            violations.append(f"acknowledged contribution {ack['nonce']} (round {ack['round']} slot {ack['slot']}) "
                              "is neither merged nor rejected")
    if n < min_rounds:
        violations.append(f"only {n} rounds merged, wanted {min_rounds}")
    return {"rounds": n, "contributions": total_merged, "rejected": total_rejected, "acks": len(acks or []),
            "commits": len(history), "companion_commits": len(chist), "violations": violations}
