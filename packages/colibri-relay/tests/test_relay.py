"""The lease protocol on both stores: claim, pull, push, release, takeover, fencing."""

import json
import os
import time

import pytest
from colibri_relay import LeaseHeld, LeaseLost, LegSummary, PutFile, Relay
from colibri_relay.ledger import LEDGER_JSONL, LEDGER_MD
from colibri_relay.relay_state import RELAY_FILE

D, HB = 1.2, 0.15


def make(store, holder):
    return Relay(store, holder=holder, lease_duration_s=D, heartbeat_s=HB)


def write_ckpt(path, leg, size=1000):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"d_model": 8}))
    (path / "training_state.json").write_text(json.dumps({"leg": leg}))
    (path / "model.safetensors").write_bytes(os.urandom(size))
    with open(path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"leg": leg, "loss": 3.0 - leg / 10}) + "\n")


def test_init_is_idempotent_and_empty(store):
    relay = make(store, "a")
    head, state = relay.init()
    assert state.status == "free" and state.leg == 0 and state.epoch == 0
    assert relay.init()[0] == head
    assert relay.ledger() == []
    assert b"Relay ledger" in store.read_file(LEDGER_MD, head)


def test_three_legs_chain_through_pull_and_push(store, tmp_path):
    relay = make(store, "a")
    relay.init()
    ck = tmp_path / "ck"
    for n in range(1, 4):
        with relay.leg() as leg:
            assert leg.number == n
            pulled = leg.pull(ck)
            if n == 1:
                assert pulled == {}
            else:
                assert json.loads((ck / "training_state.json").read_text()) == {"leg": n - 1}
            leg.check()
            write_ckpt(ck, n)
            res = leg.push(ck, LegSummary(steps=10, tokens=640, loss_start=3.0, loss_end=2.9, hardware="cpu"))
            assert res.leg == n and res.tag == f"leg-{n}"
        assert not leg.lease.fenced or leg.lease._fence_reason == "released"
    head, state = relay.status()
    assert state.status == "free" and state.leg == 3 and state.epoch == 3
    assert state.leg_commit == store.list_tags()["leg-3"]
    entries = relay.ledger()
    assert [e.leg for e in entries] == [1, 2, 3]
    assert entries[1].base_commit != entries[0].base_commit and entries[0].tokens == 640
    # Everything a dashboard reads is readable at a pinned revision.
    tag2 = store.list_tags()["leg-2"]
    assert len(relay.ledger(tag2)) == 2
    metrics = store.read_file("metrics.jsonl", tag2).decode().splitlines()
    assert len(metrics) == 2
    assert relay.read_state(tag2).leg == 2
    assert "leg 3" in store.read_file(LEDGER_MD, head).decode() or "| 3 |" in store.read_file(LEDGER_MD, head).decode()


def test_push_deletes_files_dropped_from_the_payload(store, tmp_path):
    relay = make(store, "a")
    relay.init()
    ck = tmp_path / "ck"
    write_ckpt(ck, 1)
    (ck / "old.bin").write_bytes(b"x")
    with relay.leg() as leg:
        leg.push(ck)
    (ck / "old.bin").unlink()
    with relay.leg() as leg:
        leg.push(ck)
    assert "old.bin" not in store.list_files(store.head())
    assert "old.bin" in store.list_files("leg-1")


def test_second_claimant_waits_then_takes_over_an_abandoned_lease(store):
    a, b = make(store, "a"), make(store, "b")
    a.init()
    leg_a = a.claim()
    with pytest.raises(LeaseHeld):
        b.claim(wait=False)
    leg_a.close()  # holder "crashes": heartbeat stops, nothing released
    t0 = time.monotonic()
    leg_b = b.claim(poll_s=0.05)
    waited = time.monotonic() - t0
    assert waited >= D  # never before the holder's own lease duration
    assert leg_b.state.epoch == 2 and leg_b.state.holder == "b"
    leg_b.release()


def test_live_holder_keeps_the_lease_against_a_waiting_claimant(store):
    a, b = make(store, "a"), make(store, "b")
    a.init()
    leg_a = a.claim()
    with pytest.raises(LeaseHeld):
        b.claim(timeout_s=2.5 * D, poll_s=0.05)
    leg_a.check()
    assert leg_a.lease.heartbeats >= 3
    leg_a.release()


def test_foreign_write_fences_the_holder_and_its_push_fails(store, tmp_path):
    a = make(store, "a")
    a.init()
    leg = a.claim()
    a.force_release()  # someone else writes on top of our commit
    ck = tmp_path / "ck"
    write_ckpt(ck, 1)
    with pytest.raises(LeaseLost):
        leg.push(ck)
    with pytest.raises(LeaseLost):
        leg.check()
    assert "leg-1" not in store.list_tags()
    assert a.status()[1].leg == 0
    assert leg.release() is False


def test_holder_fences_itself_when_renewals_stop_landing(store, monkeypatch):
    a = make(store, "a")
    a.init()
    leg = a.claim()
    from colibri_relay.errors import OutcomeUnknown

    def never(*args, **kwargs):
        raise OutcomeUnknown("injected: no renewal lands")

    monkeypatch.setattr(store, "commit", never)
    with pytest.raises(LeaseLost, match="no successful renewal"):
        while True:
            leg.check()
            time.sleep(0.02)
    # The fence deadline is D - margin after the last renewal was SENT: before any claimant's D + margin.
    assert leg.lease.time_left_s() <= 0 and leg.lease.margin_s > 0
    leg.close()


def test_leg_context_releases_on_error(store):
    a = make(store, "a")
    a.init()
    with pytest.raises(RuntimeError):
        with a.leg():
            raise RuntimeError("trainer crashed")
    assert a.status()[1].status == "free"


def test_missing_leg_tag_is_repaired_by_the_next_claim(store, tmp_path):
    """A holder killed between its push commit and its tag: the next claimant adds the tag."""
    a = make(store, "a")
    a.init()
    ck = tmp_path / "ck"
    write_ckpt(ck, 1)
    leg = a.claim()
    monkey_tag = store.create_tag
    store.create_tag = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        leg.push(ck)
    store.create_tag = monkey_tag
    push_sha = leg.lease.commit
    leg.close()
    assert "leg-1" not in store.list_tags()
    b = make(store, "b")
    leg_b = b.claim(poll_s=0.05)
    assert store.list_tags()["leg-1"] == push_sha
    assert leg_b.state.leg_commit == push_sha
    leg_b.release()


def test_relay_files_in_payload_are_refused(store, tmp_path):
    from colibri_relay import PayloadError

    a = make(store, "a")
    a.init()
    ck = tmp_path / "ck"
    write_ckpt(ck, 1)
    (ck / RELAY_FILE).write_text("{}")
    with a.leg() as leg:
        with pytest.raises(PayloadError, match="reserved"):
            leg.push(ck)
    assert a.status()[1].leg == 0


def test_ledger_jsonl_is_append_only_across_legs(store, tmp_path):
    a = make(store, "a")
    a.init()
    ck = tmp_path / "ck"
    write_ckpt(ck, 1)
    with a.leg() as leg:
        leg.push(ck, {"steps": 1})
    first = store.read_file(LEDGER_JSONL, store.head())
    with a.leg() as leg:
        leg.push(ck, {"steps": 2})
    second = store.read_file(LEDGER_JSONL, store.head())
    assert second.startswith(first) and second.count(b"\n") == 2


def test_a_store_level_put_cannot_touch_relay_through_payload(store):
    # Sanity: RELAY.json written by a foreign tool with a bad version is refused by readers.
    a = make(store, "a")
    a.init()
    bad = json.dumps({"relay_version": "3.0", "status": "free"}).encode()
    store.commit([PutFile(RELAY_FILE, bad)], parent=store.head(), message="m", nonce="f00d")
    from colibri_relay import SchemaVersionError

    with pytest.raises(SchemaVersionError, match=r"3.0 is not supported \(this colibri-relay reads 1.0, 2.0\)"):
        a.status()


def test_write_whose_outcome_was_unknown_but_landed_is_adopted_not_fenced(store, monkeypatch):
    """Attempt 1 lands but reports OutcomeUnknown; attempt 2 (same parent) gets CasLost; the holder
    must find attempt 1's nonce in the history and carry on."""
    from colibri_relay.errors import OutcomeUnknown

    a = make(store, "a")
    a.init()
    leg = a.claim()
    leg.lease.stop_heartbeat()  # drive writes by hand
    leg.lease._stop.clear()
    real = store.commit
    calls = []

    def flaky(ops, **kw):
        calls.append(kw["nonce"])
        sha = real(ops, **kw)
        if len(calls) == 1:
            raise OutcomeUnknown("injected: reply lost after the commit landed")
        return sha

    monkeypatch.setattr(store, "commit", flaky)
    sha = leg.lease.renew()
    assert len(calls) == 2
    assert store.head() == sha and store.history()[0].nonce == calls[0]
    assert leg.lease.state.nonce == calls[0]
    leg.check()
    monkeypatch.setattr(store, "commit", real)
    assert leg.release() is True


def test_a_heartbeat_landing_after_lease_lost_is_still_released(store, monkeypatch):
    """Bug 4: the trainer was told LeaseLost (no renewal landed within D - m), then the slow heartbeat
    landed after all. release() must still free the baton (one CAS write on our own last commit),
    or every waiter loses a whole lease duration for nothing."""
    a = make(store, "a")
    a.init()
    real = store.commit
    slow = {"on": True}

    def slow_heartbeat(ops, **kw):
        if slow["on"] and "heartbeat" in kw["message"]:
            slow["on"] = False
            time.sleep(D)  # lands well after the holder's D - m fence deadline
        return real(ops, **kw)

    monkeypatch.setattr(store, "commit", slow_heartbeat)
    leg = a.claim()
    with pytest.raises(LeaseLost):
        while True:
            leg.check()
            time.sleep(0.02)
    assert leg.release() is True
    head, state = a.status()
    assert state.status == "free" and store.history()[1].title.startswith("relay: heartbeat")
