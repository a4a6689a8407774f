"""Tags are bookkeeping: a 409 on create_tag after our own landed push is retried
and re-read, never turned into "pushed twice"; a tag still missing is repaired by the next claimant."""

import json

from colibri_relay import Relay


def _ckpt(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir(exist_ok=True)
    (ck / "state.json").write_text(json.dumps({"step": 1}))
    return ck


def test_a_409_on_the_tag_under_lock_contention_is_retried(hub_store, fake_hub, tmp_path):
    relay = Relay(hub_store, holder="a", lease_duration_s=1.2, heartbeat_s=0.15)
    relay.init()
    fake_hub.faults.inject("tag_409", 2)
    with relay.leg() as leg:
        res = leg.push(_ckpt(tmp_path))
    assert fake_hub.faults.injected["tag_409"] == 2
    assert hub_store.list_tags()["leg-1"] == res.commit


def test_a_tag_that_cannot_be_created_now_is_left_to_the_next_claimant(hub_store, fake_hub, tmp_path):
    relay = Relay(hub_store, holder="a", lease_duration_s=1.2, heartbeat_s=0.15)
    relay.init()
    fake_hub.faults.set(tag_409=1.0, stale_tags_read=1.0)
    with relay.leg() as leg:
        res = leg.push(_ckpt(tmp_path))  # a landed push is a success, whatever the tag does
    assert res.leg == 1
    fake_hub.faults.set(tag_409=0.0, stale_tags_read=0.0)
    assert "leg-1" not in hub_store.list_tags()
    with Relay(hub_store, holder="b", lease_duration_s=1.2, heartbeat_s=0.15).leg():
        pass
    assert hub_store.list_tags()["leg-1"] == res.commit


def test_create_tag_whose_first_reply_was_lost_is_not_an_error(hub_store, fake_hub):
    """The tag landed but the reply was a 409 (a retry of a landed request): re-read, it is ours."""
    h = hub_store.head()
    hub_store.create_tag("leg-1", h)
    hub_store.create_tag("leg-1", h)  # exists at the same commit: done, not TagExists
