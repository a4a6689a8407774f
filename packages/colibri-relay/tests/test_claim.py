"""Claiming when the store says "not now": a spent commit quota, repeated short claims against a dead
holder, and the lagging head reads a Hub serves right after init."""

import re
import time

import pytest
from colibri_relay import LeaseHeld, NotInitialized, RateLimited, Relay

D, HB = 1.2, 0.15  # a takeover needs D + D/6 = 1.4 s of an unchanged (epoch, seq)


def make(store, holder):
    return Relay(store, holder=holder, lease_duration_s=D, heartbeat_s=HB)


@pytest.mark.parametrize("baton", ["free", "dead holder"])
def test_a_spent_commit_quota_raises_rate_limited_within_the_timeout(hub_store, fake_hub, monkeypatch, baton):
    """The Hub's quota answers "retry in about 1 hour": the claim says so before its timeout ends,
    instead of sleeping past it and blaming a holder that has long exited."""
    a = make(hub_store, "a")
    a.init()
    if baton == "dead holder":
        a.claim().close()  # the holder exits without releasing: its heartbeats stop
    monkeypatch.setattr(fake_hub, "commit_rate_limit", (1 if baton == "free" else 2, 3600.0))
    b = make(hub_store, "b")
    t0 = time.monotonic()
    with pytest.raises(RateLimited, match="about 1 hour") as err:
        b.claim(timeout_s=3.0, poll_s=0.05)
    assert time.monotonic() - t0 < 3.0
    assert err.value.retry_after_s >= 50 * 60
    assert "held by" not in str(err.value)
    assert b.status()[1].holder == ("a" if baton == "dead holder" else None)  # nothing was written


def test_a_claim_without_waiting_is_told_the_quota_at_once(hub_store, fake_hub, monkeypatch):
    relay = make(hub_store, "a")
    relay.init()
    monkeypatch.setattr(fake_hub, "commit_rate_limit", (1, 3600.0))
    t0 = time.monotonic()
    with pytest.raises(RateLimited, match="wait"):
        relay.claim(wait=False)
    assert time.monotonic() - t0 < 2.0


def test_a_quota_wait_inside_the_timeout_is_waited_out(hub_store, fake_hub, monkeypatch):
    """A window short enough to wait out: the claim waits what the server asked, then lands."""
    relay = make(hub_store, "a")
    monkeypatch.setattr(fake_hub, "commit_rate_limit", (1, 2.0))
    relay.init()
    t0 = time.monotonic()
    leg = relay.claim(timeout_s=10.0)
    assert time.monotonic() - t0 >= 1.0 and leg.state.holder == "a"
    leg.close()


@pytest.mark.parametrize("how", ["no wait", "short timeout"])
def test_repeated_short_claims_take_over_a_dead_holder(store, how):
    """The watch of (epoch, seq) belongs to the Relay, not to one claim() call: claims shorter than
    D + margin add up, and the takeover comes once the state stayed unchanged that long in total."""
    a, b = make(store, "a"), make(store, "b")
    a.init()
    a.claim().close()
    t0 = time.monotonic()
    refusals = []
    while True:
        try:
            leg = b.claim(wait=False) if how == "no wait" else b.claim(timeout_s=0.3, poll_s=0.05)
            break
        except LeaseHeld as exc:
            refusals.append(exc)
            assert time.monotonic() - t0 < 6 * D, f"never took over: {exc}"
            time.sleep(0.05)
    assert time.monotonic() - t0 >= D  # never before the holder's own lease duration
    assert leg.state.holder == "b" and leg.state.epoch == 2
    watched = [exc.watched_s for exc in refusals]
    assert watched == sorted(watched) and watched[-1] < D + D / 6
    leg.release()


def test_lease_held_names_the_declared_lease_and_the_watch(store):
    # a lease long enough that no stall of a loaded machine lets b take the baton over in between
    lease = 6.0
    a, b = (Relay(store, holder=h, lease_duration_s=lease, heartbeat_s=1.0) for h in ("a", "b"))
    a.init()
    a.claim().close()
    with pytest.raises(LeaseHeld):
        b.claim(wait=False)
    time.sleep(0.3)
    with pytest.raises(LeaseHeld) as err:
        b.claim(wait=False)
    msg = str(err.value)
    assert "held by a" in msg and "declares a 6s lease" in msg, msg
    watched = re.search(r"watched unchanged for (\d+\.\d)s", msg)
    assert watched and float(watched.group(1)) == round(err.value.watched_s, 1), msg
    assert err.value.holder == "a" and err.value.lease_duration_s == lease
    assert 0.3 <= err.value.watched_s < err.value.takeover_after_s == pytest.approx(lease + lease / 6)


def test_a_live_holder_is_never_taken_over_by_repeated_claims(store):
    a, b = make(store, "a"), make(store, "b")
    a.init()
    leg_a = a.claim()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.5 * D:
        with pytest.raises(LeaseHeld):
            b.claim(timeout_s=0.2, poll_s=0.05)
    leg_a.check()
    leg_a.release()


def test_a_stale_head_read_right_after_init_does_not_stop_a_claim(hub_store, fake_hub):
    """The Hub's head reads lag: right after init, `main` may still show the repo's first commit,
    which holds no RELAY.json. The claim reads again instead of calling the relay uninitialised."""
    relay = make(hub_store, "a")
    relay.init()
    fake_hub.faults.inject("stale_head_read", n=2)
    leg = relay.claim(wait=False)
    assert leg.state.epoch == 1 and fake_hub.faults.injected["stale_head_read"] == 2
    leg.release()


def test_init_again_under_a_stale_head_read_is_still_idempotent(hub_store, fake_hub):
    relay = make(hub_store, "a")
    head, _ = relay.init()
    fake_hub.faults.inject("stale_head_read", n=1)
    assert relay.init()[0] == head


def test_a_relay_never_initialised_is_still_not_initialized(hub_store):
    t0 = time.monotonic()
    with pytest.raises(NotInitialized, match="colibri-relay init"):
        make(hub_store, "a").claim(wait=False)
    assert time.monotonic() - t0 < 10
