"""Files the Hub keeps inline travel inside the commit request, when no renewal can land:
a push of a 2 MB text file over a slow link must keep the lease against a waiting claimant."""

import threading

from colibri_relay import Relay


def test_a_slow_inline_push_keeps_the_lease_against_a_waiting_claimant(hub_store, fake_hub, tmp_path, monkeypatch):
    monkeypatch.setattr(fake_hub.state, "lfs_threshold", 10 * 1024 * 1024)  # the Hub's: 2 MB text stays regular
    D, HB = 1.0, 0.15
    ck = tmp_path / "ck"
    ck.mkdir()
    line = b"the quick brown fox jumps over the lazy dog 0123456789\n"
    (ck / "shard-000.txt").write_bytes(line * (2_000_000 // len(line)))
    (ck / "cursor.json").write_text('{"next": 1}')
    a = Relay(hub_store, holder="a", lease_duration_s=D, heartbeat_s=HB)
    a.init()
    leg = a.claim()
    waiter: dict = {}

    def claimant():
        b = Relay(hub_store, holder="b", lease_duration_s=D, heartbeat_s=HB)
        waiter["leg"] = b.claim(poll_s=0.05, timeout_s=60)

    t = threading.Thread(target=claimant)
    t.start()
    monkeypatch.setattr(fake_hub, "upload_bytes_per_s", 650_000)  # ~4 s for the base64 body: > D + m
    res = leg.push(ck, {"steps": 1})
    monkeypatch.setattr(fake_hub, "upload_bytes_per_s", None)
    leg.check()
    assert leg.release() is True
    t.join(60)
    b_leg = waiter["leg"]
    titles = [c.title for c in hub_store.history(stop_at=res.commit)]
    assert res.leg == 1 and hub_store.list_files(res.commit)["shard-000.txt"].sha256 is None  # it went inline
    assert not any("takeover" in t for t in titles)  # b waited for the release, it did not take over
    assert b_leg.state.epoch == 2
    b_leg.release()


def test_heartbeats_inside_an_extension_keep_declaring_it(store):
    """A heartbeat landing between the extension and the push commit must not shorten the lease again."""
    relay = Relay(store, holder="a", lease_duration_s=1.2, heartbeat_s=0.15)
    relay.init()
    with relay.leg() as leg:
        with leg.lease.extended(30.0, "a test"):
            assert relay.status()[1].lease_duration_s == 30.0
            leg.lease.renew()
            assert relay.status()[1].lease_duration_s == 30.0
            leg.check()
        leg.lease.renew()
        assert relay.status()[1].lease_duration_s == 1.2
