"""Parallel rounds on the fake Hub: protocol versions, the commit planner, the companion repo's close,
exactly-once merges with rejections, and the chaos of worker processes killed (merger included)."""

from __future__ import annotations

import json
import os
import time

import pytest
from colibri_relay import Relay
from colibri_relay.contribution import close_round, post_contribution, read_slots
from colibri_relay.dashboard.page import render_page
from colibri_relay.dashboard.reader import DashboardReader
from colibri_relay.errors import (
    ChecksumMismatch,
    ModeMismatch,
    RoundClosed,
    RoundPlanError,
    SchemaVersionError,
    SlotTaken,
)
from colibri_relay.ledger import parse_ledger
from colibri_relay.relay_state import check_major, parse_relay_state
from colibri_relay.round_loop import RoundWorker
from colibri_relay.round_plan import plan_rounds
from colibri_relay.round_state import RoundsConfig, rounds_of
from colibri_relay.rounds import RoundRelay
from colibri_relay.testing.round_chaos import merge_totals, replay_totals, run_round_chaos
from colibri_relay.testing.round_history_check import check_round_history

SEED = int(os.environ.get("COLIBRI_RELAY_CHAOS_SEED", "1"))


def _start(tmp_path, fake_hub, name: str, workers: int = 2, round_s: float = 2.0):
    spec, comp = f"hf://t/{name}", f"hf://t/{name}-contrib"
    relay = Relay(spec, holder="starter", lease_duration_s=3.0, heartbeat_s=0.5)
    relay.init()
    base = tmp_path / f"{name}-start"
    base.mkdir()
    (base / "total.json").write_text(json.dumps({"round": 0, "total": 0}))
    with relay.leg() as leg:
        RoundRelay(relay).start(leg, RoundsConfig(companion=comp, workers=workers, inner_steps=1, round_s=round_s), base)
    return relay, RoundRelay(relay)


def _delta_dir(tmp_path, name: str, delta: int):
    d = tmp_path / name
    d.mkdir()
    (d / "delta.json").write_text(json.dumps({"delta": delta}))
    return d


def test_planner_refuses_with_one_line_and_accepts_the_hub_sized_plan():
    plan = plan_rounds(workers=8, min_round_s=1800, heartbeat_s=300, poll_s=10).check()
    assert plan.companion_commits_per_hour == pytest.approx(18) and plan.main_commits_per_hour < 20
    with pytest.raises(RoundPlanError) as err:
        plan_rounds(workers=8, min_round_s=300, heartbeat_s=300, poll_s=10).check()
    msg = str(err.value)
    assert "\n" not in msg and "companion" in msg and "128 per hour" in msg and "at least 506s" in msg
    with pytest.raises(RoundPlanError, match="poll less often"):
        plan_rounds(workers=2, min_round_s=1800, heartbeat_s=300, poll_s=0.5).check()


def test_versions_old_readers_and_mixing_modes_fail_clearly(tmp_path, fake_hub):
    relay, rounds = _start(tmp_path, fake_hub, "versions")
    head, state = relay.status()
    assert state.relay_version == "2.0" and rounds_of(state).round == 0
    raw = relay.store.read_file("RELAY.json", head)
    with pytest.raises(SchemaVersionError, match=r"relay_version 2.0 is not supported \(this colibri-relay reads 1.0\)"):
        check_major(json.loads(raw)["relay_version"], "1.0", "relay_version", "RELAY.json")  # a 1.x reader's check
    with pytest.raises(SchemaVersionError, match=r"3.0 is not supported \(this colibri-relay reads 1.0, 2.0\)"):
        parse_relay_state(raw.replace(b'"2.0"', b'"3.0"'), "RELAY.json")
    leg = relay.claim()
    try:
        (tmp_path / "seq").mkdir()
        (tmp_path / "seq" / "w.bin").write_bytes(b"x")
        with pytest.raises(ModeMismatch, match="runs parallel rounds"):
            leg.push(tmp_path / "seq")
    finally:
        leg.release()
    seq = Relay("hf://t/sequential", lease_duration_s=3.0, heartbeat_s=0.5)
    seq.init()
    with pytest.raises(ModeMismatch, match="sequential legs"):
        RoundRelay(seq).view()


def test_close_admits_nothing_more_and_merge_records_every_contribution(tmp_path, fake_hub):
    relay, rounds = _start(tmp_path, fake_hub, "close", workers=4)
    view = rounds.view()
    comp = rounds.companion(view.rounds)
    a = rounds.post(view, slot=0, worker="a", src_dir=_delta_dir(tmp_path, "a", 5), summary={"tokens": 10})
    with pytest.raises(SlotTaken, match="slot 0 of round 0 already holds the contribution of a"):
        rounds.post(view, slot=0, worker="b", src_dir=_delta_dir(tmp_path, "b", 7), summary={})
    # a contribution trained on another base lands, and is rejected by the merge as stale
    stale = post_contribution(comp, round=0, slot=1, worker="c", base_commit=view.head, base_digest="0" * 64,
                              src_dir=_delta_dir(tmp_path, "c", 9), summary={})
    bad = rounds.post(view, slot=2, worker="d", src_dir=_delta_dir(tmp_path, "d", 10**6), summary={})
    closed, close_commit = close_round(comp, 0, "m")
    assert [s.slot for s in closed.contributions] == [0, 1, 2]
    with pytest.raises(RoundClosed, match="late"):
        rounds.post(view, slot=3, worker="late", src_dir=_delta_dir(tmp_path, "late", 1), summary={})
    assert close_round(comp, 0, "other")[1] == close_commit  # idempotent: the one close stands
    worker = RoundWorker(rounds, slot=0, train=lambda *a: {}, merge=merge_totals, work_dir=tmp_path / "m")
    worker.leg = relay.claim()
    worker.done.add(0)
    worker._merge_duty()
    entry = rounds.ledger()[0]
    assert [c.nonce for c in entry.contributions] == [a.nonce]
    assert {(j.slot, j.reason) for j in entry.rejected} == {(1, "stale base"), (2, "failed check")}
    assert {j.nonce for j in entry.rejected} == {stale.nonce, bad.nonce}
    worker.leg.release()
    report = check_round_history(relay.store, comp, acks=[{"round": 0, "slot": 0, "nonce": a.nonce}],
                                 replay=replay_totals)
    assert report["violations"] == [] and report["rounds"] == 1
    snap = DashboardReader(relay.store).read()
    assert [(r.round, r.workers, r.rejected) for r in snap.rounds] == [(0, 1, 2)]
    assert 'id="rounds"' in render_page(snap, refresh_s=30) and not snap.ledger
    # round 1's close removed round 0's files from the tree (the history keeps them)
    view = rounds.view()
    assert view.round == 1
    close_round(comp, 1, "m")
    assert not [p for p in comp.list_files(comp.head()) if p.startswith("rounds/000000/")]
    assert read_slots(comp, 0, close_commit)[0] == [0, 1, 2]
    # a worker whose (lagging) view still shows round 0 cannot land in it once round 0's marker is gone
    with pytest.raises(RoundClosed, match="rounds up to 1 are closed"):
        post_contribution(comp, round=0, slot=3, worker="laggard", base_commit=view.head, base_digest="0" * 64,
                          src_dir=_delta_dir(tmp_path, "laggard", 1), summary={})


def test_a_deposed_merger_cannot_merge_the_round_again(tmp_path, fake_hub):
    relay, rounds = _start(tmp_path, fake_hub, "twice", workers=1)
    view = rounds.view()
    rounds.post(view, slot=0, worker="a", src_dir=_delta_dir(tmp_path, "a", 3), summary={})
    closed, close_commit = close_round(rounds.companion(view.rounds), 0, "m")
    old = RoundWorker(rounds, slot=0, train=lambda *a: {}, merge=merge_totals, work_dir=tmp_path / "old")
    old.leg = relay.claim()
    old.done.add(0)
    Relay(relay.store, holder="ops").force_release()  # an operator frees the baton under the merger
    new = RoundWorker(rounds, slot=0, train=lambda *a: {}, merge=merge_totals, work_dir=tmp_path / "new")
    new.leg = Relay(relay.store, holder="new", lease_duration_s=3.0, heartbeat_s=0.5).claim()
    new.done.add(0)
    new._merge_duty()
    old._merge_duty()  # its merge commit names its own last commit: refused, it fences
    assert old.leg is None and old.report.merged == [] and new.report.merged == [0]
    with pytest.raises(ModeMismatch, match="cannot merge round 0: this merger's RELAY.json is at round 1"):
        rounds.merge(new.leg, closed, rounds.ledger()[0], tmp_path / "a")
    new.leg.release()
    assert [e.round for e in rounds.ledger()] == [0]
    with pytest.raises(SchemaVersionError, match="ledger_version 2.0"):
        parse_ledger(relay.store.read_file("LEDGER.jsonl", relay.store.head()), "LEDGER.jsonl")  # a 1.x reader


def test_round_chaos_killed_workers_and_mergers_lose_nothing(tmp_path):
    report = run_round_chaos(rounds=6, workers=4, seed=SEED, work=tmp_path / "chaos", timeout_s=240,
                             kill_every_s=(1.0, 2.0))
    assert report["violations"] == [], report
    assert report["rounds"] == 6 and report["kills"] >= 2 and report["acks"] >= 12


def test_a_merged_base_that_lost_a_file_with_its_merger_is_rebuilt_by_the_next_holder(tmp_path, fake_hub, monkeypatch):
    """The Hub lands round 0's merge without total.json and the merger dies before its re-upload:
    the next lease holder rebuilds the merge from the ledger and uploads what the tree lacks, so the
    run goes on and the history replays."""
    import colibri_relay.rounds as rounds_module

    relay, rounds = _start(tmp_path, fake_hub, "heal", workers=1)
    view = rounds.view()
    a = rounds.post(view, slot=0, worker="a", src_dir=_delta_dir(tmp_path, "a", 7), summary={"tokens": 10})
    first = RoundWorker(rounds, slot=0, train=lambda *a: {}, merge=merge_totals, work_dir=tmp_path / "first")
    first.leg = Relay(relay.store, holder="first", lease_duration_s=3.0, heartbeat_s=0.5).claim()
    first.done.add(0)
    close_round(rounds.companion(view.rounds), 0, "first")  # so that the dropped file is the merge's
    fake_hub.faults.inject("commit_drops_file", 1)
    monkeypatch.setattr(rounds_module, "tree_problems", lambda *a, **k: [])  # dies before it re-uploads
    first._merge_duty()
    monkeypatch.undo()
    first.leg.close()  # killed: its heartbeats stop, the lease lapses by itself
    broken = rounds.view()
    assert broken.round == 1 and rounds.base_problems(broken)
    with pytest.raises(ChecksumMismatch):
        rounds.pull_base(broken, tmp_path / "pulled")
    worker = RoundWorker(rounds, slot=0, train=lambda *a: {}, merge=merge_totals, work_dir=tmp_path / "next",
                         poll_s=0.05)
    worker.relay = Relay(relay.store, holder="next", lease_duration_s=3.0, heartbeat_s=0.5)
    deadline = time.monotonic() + 20
    while worker.leg is None and time.monotonic() < deadline:  # the lapsed lease, then the repair
        worker._contribute(worker._view())
    assert worker.leg is not None
    healed = rounds.view()
    assert not rounds.base_problems(healed)
    rounds.pull_base(healed, tmp_path / "pulled")
    assert json.loads((tmp_path / "pulled" / "total.json").read_text())["total"] == 7
    worker.leg.release()
    report = check_round_history(relay.store, rounds.companion(view.rounds),
                                 acks=[{"round": 0, "slot": 0, "nonce": a.nonce}], replay=replay_totals)
    assert report["violations"] == [] and report["rounds"] == 1
