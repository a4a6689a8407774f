"""A push records exactly what it uploaded, and a relay whose head does not verify has a way back:
hash the bytes we upload (one read per file), verify the new commit's tree against
the manifest, roll a bad head back to the last verified payload as a new CAS commit."""

import json
import os

import pytest
from colibri_relay import ChecksumMismatch, PayloadError, PutFile, Relay, RelayError

D, HB = 1.2, 0.15


def make(store, holder):
    return Relay(store, holder=holder, lease_duration_s=D, heartbeat_s=HB)


def ckpt(path, leg, size=3000):
    path.mkdir(exist_ok=True)
    (path / "counter.json").write_text(json.dumps({"leg": leg}))
    (path / "model.safetensors").write_bytes(os.urandom(size))
    return path


def test_a_file_rewritten_during_the_push_cannot_break_later_pulls(store, tmp_path, monkeypatch):
    """A checkpoint writer finishes while we push: what lands is what we hashed, and it pulls."""
    relay = make(store, "a")
    relay.init()
    ck = ckpt(tmp_path / "ck", 1)
    hashed = (ck / "model.safetensors").read_bytes()
    real_prepare = store.prepare

    def writer_finishes(ops):
        (ck / "model.safetensors").write_bytes(os.urandom(5000))  # after the scan, before the upload
        (ck / "counter.json").write_text(json.dumps({"leg": 99}))
        return real_prepare(ops)

    monkeypatch.setattr(store, "prepare", writer_finishes)
    with relay.leg() as leg:
        leg.push(ck)
    monkeypatch.setattr(store, "prepare", real_prepare)
    with make(store, "b").leg() as leg:
        got = leg.pull(tmp_path / "pulled")
    assert got["model.safetensors"].read_bytes() == hashed
    assert json.loads(got["counter.json"].read_text()) == {"leg": 1}


def test_a_payload_file_the_repos_gitignore_would_drop_is_refused_before_any_commit(hub_store, tmp_path):
    """create_commit silently skips files the repo's .gitignore matches: refuse the push instead."""
    relay = make(hub_store, "a")
    relay.init()
    hub_store.commit([PutFile(".gitignore", b"*.log\n")], parent=hub_store.head(), message="m", nonce="0a0a")
    ck = ckpt(tmp_path / "ck", 1)
    (ck / "train.log").write_text("step 1\n")
    head = hub_store.head()
    with relay.leg() as leg:
        with pytest.raises(PayloadError, match=r"train\.log.*gitignore"):
            leg.push(ck)
    assert relay.status()[1].leg == 0
    assert [c.title for c in hub_store.history(stop_at=head)][-2].startswith("relay: claim")


def test_a_push_the_hub_did_not_fully_apply_is_rolled_back_and_reported(hub_store, fake_hub, tmp_path):
    """The Hub drops a file it believes unchanged (a stale preupload answer): the new tree does not match
    the manifest. The holder rolls the payload back to the last verified one and says so."""
    relay = make(hub_store, "a")
    relay.init()
    ck = ckpt(tmp_path / "ck", 1)
    with relay.leg() as leg:
        first = leg.push(ck)
    fake_hub.faults.inject("commit_drops_file", 1)
    ckpt(ck, 2)
    with relay.leg() as leg:
        with pytest.raises(RelayError, match="did not verify.*rolled back"):
            leg.push(ck)
        leg.check()  # still our lease
    with make(hub_store, "b").leg() as leg:
        got = leg.pull(tmp_path / "pulled")  # the head verifies again: leg 1's payload
    assert json.loads(got["counter.json"].read_text()) == {"leg": 1}
    assert relay.status()[1].payload == hub_store_state_payload(relay, first.commit)
    from colibri_relay.testing.history_check import check_history

    report = check_history(hub_store)
    assert report["violations"] == [] and report["repaired_legs"] == 1 and report["legs"] == 2


def hub_store_state_payload(relay, sha):
    return relay.read_state(sha).payload


def test_repair_rolls_an_unreadable_head_back_to_the_last_verified_payload(store, tmp_path):
    """A relay left with a head whose payload does not verify (an older client, a damaged blob):
    `Relay.repair()` claims, finds the last push whose payload verifies and restores it."""
    relay = make(store, "a")
    relay.init()
    ck = ckpt(tmp_path / "ck", 1)
    with relay.leg() as leg:
        leg.push(ck)
    ckpt(ck, 2)
    with relay.leg() as leg:
        leg.push(ck)
    # Damage leg 2's head the way the old push did: RELAY.json's manifest names other bytes.
    head, state = relay.status()
    bad = state.model_copy(update={"payload": {**state.payload, "counter.json": state.payload["model.safetensors"]}})
    store.commit([PutFile("RELAY.json", bad.next_write().to_bytes())], parent=head, message="m", nonce="0b0b")
    with relay.leg() as leg:
        with pytest.raises(ChecksumMismatch, match="colibri-relay repair"):
            leg.pull(tmp_path / "p0", repair=False)
    restored = relay.repair()
    assert restored is not None
    with relay.leg() as leg:
        got = leg.pull(tmp_path / "p1")
    assert json.loads(got["counter.json"].read_text()) == {"leg": 2}  # leg 2 itself still verified
    assert relay.repair() is None  # nothing to do on a head that verifies


def test_repair_command_on_a_head_that_verifies(tmp_path):
    from click.testing import CliRunner
    from colibri_relay.cli import main

    store = str(tmp_path / "s")
    assert CliRunner().invoke(main, ["init", "--store", store]).exit_code == 0
    res = CliRunner().invoke(main, ["repair", "--store", store])
    assert res.exit_code == 0 and "nothing to repair" in res.output


def test_a_claimant_meeting_an_unreadable_head_rolls_it_back_on_pull(store, tmp_path):
    """The holder of a bad push was killed before its rollback: the next claimant's pull repairs it
    (one CAS commit) and gets the last verified payload, instead of failing forever."""
    relay = make(store, "a")
    relay.init()
    ck = ckpt(tmp_path / "ck", 1)
    with relay.leg() as leg:
        leg.push(ck)
    head, state = relay.status()
    bad = state.model_copy(update={"payload": {**state.payload, "counter.json": state.payload["model.safetensors"]}})
    store.commit([PutFile("RELAY.json", bad.next_write().to_bytes())], parent=head, message="m", nonce="0c0c")
    with make(store, "b").leg() as leg:
        got = leg.pull(tmp_path / "p")
        assert any(c.title.startswith("relay: repair by b") for c in store.history()[:5])
    assert json.loads(got["counter.json"].read_text()) == {"leg": 1}
