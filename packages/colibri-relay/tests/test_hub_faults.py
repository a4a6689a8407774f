"""HubStore against the fake Hub's injected faults: each maps to its typed error or is resolved."""

import pytest
from colibri_relay import (
    CasLost,
    ChecksumMismatch,
    CommitLockBusy,
    OutcomeUnknown,
    PutFile,
    RateLimited,
    StoreError,
)


@pytest.mark.parametrize("fault", ["commit_drop_reply_after_apply", "commit_500_after_apply", "commit_504_after_apply"])
def test_unknown_outcome_is_resolved_by_finding_the_nonce(hub_store, fake_hub, fault):
    h0 = hub_store.head()
    fake_hub.faults.inject(fault)
    sha = hub_store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="abcdef01")
    assert fake_hub.faults.injected[fault] == 1
    assert hub_store.head() == sha
    assert hub_store.history()[0].parent == h0


def test_409_is_commit_lock_busy_and_the_same_parent_then_works(hub_store, fake_hub):
    h0 = hub_store.head()
    fake_hub.faults.inject("commit_409")
    with pytest.raises(CommitLockBusy):
        hub_store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="abcdef02")
    assert hub_store.head() == h0
    assert hub_store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="abcdef03") == hub_store.head()


def test_429_is_rate_limited_with_the_reset_from_headers(hub_store, fake_hub):
    fake_hub.faults.set(retry_after_s=7)
    fake_hub.faults.inject("commit_429")
    h0 = hub_store.head()
    with pytest.raises(RateLimited) as err:
        hub_store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="abcdef04")
    assert err.value.retry_after_s == 7
    assert hub_store.head() == h0


def test_stale_head_reads_cannot_break_cas(hub_store, fake_hub):
    h0 = hub_store.head()
    h1 = hub_store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="abcdef05")
    fake_hub.faults.set(stale_head_read=1.0)
    assert hub_store.head() == h0  # the stale read the knob promises
    with pytest.raises(CasLost):
        hub_store.commit([PutFile("x", b"2")], parent=h0, message="m", nonce="abcdef06")
    fake_hub.faults.set(stale_head_read=0.0)
    assert hub_store.head() == h1


def test_dropped_reply_on_a_losing_commit_is_cas_lost_not_success(hub_store, fake_hub):
    h0 = hub_store.head()
    hub_store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="abcdef07")
    with pytest.raises(CasLost):
        hub_store.commit([PutFile("x", b"2")], parent=h0, message="m", nonce="abcdef08")


def test_unresolvable_outcome_raises_outcome_unknown(hub_store, fake_hub, monkeypatch):
    """A 5xx whose commit never lands and a head that did not move: we cannot know -> OutcomeUnknown."""
    import colibri_relay.hub.cas_commit as hs

    monkeypatch.setattr(hs.time, "sleep", lambda s: None)
    h0 = hub_store.head()

    def boom(*a, **k):
        raise ConnectionResetError("peer reset")

    monkeypatch.setattr(hub_store.api, "create_commit", boom)
    with pytest.raises(OutcomeUnknown):
        hub_store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="abcdef09")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_blob_on_the_server_is_caught_and_destination_untouched(hub_store, fake_hub, tmp_path, damage):
    big = tmp_path / "w.safetensors"
    big.write_bytes(b"A" * 200_000)
    h1 = hub_store.commit([PutFile("w.safetensors", big)], parent=hub_store.head(), message="m",
                          nonce="abcdef1" + str(len(damage)))
    sha256 = hub_store.list_files(h1)["w.safetensors"].sha256
    blob = fake_hub.state.blob_path(sha256)
    blob.write_bytes(b"A" * 100_000 if damage == "truncate" else b"A" * 199_999 + b"B")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "w.safetensors").write_bytes(b"previous")
    with pytest.raises(StoreError, match="w.safetensors") as err:
        hub_store.download(["w.safetensors"], h1, dest)
    if damage == "flip":
        assert isinstance(err.value, ChecksumMismatch)
    assert (dest / "w.safetensors").read_bytes() == b"previous"
    assert [p.name for p in dest.iterdir()] == ["w.safetensors"]


def test_token_is_not_in_repr(hub_store):
    assert "hf_fake_token" not in repr(hub_store)


def test_a_request_dropped_before_apply_is_unknown_then_the_same_parent_lands(hub_store, fake_hub, monkeypatch):
    import colibri_relay.hub.cas_commit as hs

    monkeypatch.setattr(hs.time, "sleep", lambda s: None)
    h0 = hub_store.head()
    fake_hub.faults.inject("commit_drop_request_before_apply")
    with pytest.raises(OutcomeUnknown):
        hub_store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="abcdef20")
    assert hub_store.head() == h0
    assert hub_store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="abcdef21") == hub_store.head()


def test_a_late_apply_is_found_by_its_nonce(hub_store, fake_hub):
    """504 at once, the commit lands 0.2 s later: the nonce search must wait for it, not give up."""
    fake_hub.faults.set(late_apply_s=0.2)
    fake_hub.faults.inject("commit_late_apply")
    h0 = hub_store.head()
    sha = hub_store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="abcdef22")
    assert sha == hub_store.head() and hub_store.history()[0].nonce == "abcdef22"


def test_a_relay_lease_survives_late_applies_and_dropped_requests(hub_store, fake_hub):
    import time

    from colibri_relay import Relay

    # Each unknown outcome costs the nonce search ~1 s: a lease of 4 s has room for two in a row.
    relay = Relay(hub_store, holder="a", lease_duration_s=4.0, heartbeat_s=0.3)
    relay.init()
    fake_hub.faults.set(late_apply_s=0.3)
    leg = relay.claim()
    fake_hub.faults.inject("commit_late_apply", 2)
    fake_hub.faults.inject("commit_drop_request_before_apply", 2)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        leg.check()
        time.sleep(0.05)
    assert leg.release() is True
    assert fake_hub.faults.injected["commit_late_apply"] == 2
    assert relay.status()[1].status == "free"


def test_an_inline_file_over_10_mib_is_refused_like_the_hub(fake_hub):
    import base64

    from colibri_relay.testing.fake_hub_repo import HubHTTPError, check_inline_limits
    big = base64.b64encode(b"a" * (10 * 1024 * 1024 + 1)).decode()
    with pytest.raises(HubHTTPError, match="larger than 10 MiB"):
        check_inline_limits([{"key": "file", "value": {"path": "x.txt", "content": big, "encoding": "base64"}}],
                            None, len(big))
    with pytest.raises(HubHTTPError, match="Payload Too Large"):
        check_inline_limits([], 100, 101)


def test_a_stale_preupload_answer_cannot_make_the_client_drop_a_prepared_file(hub_store, fake_hub):
    """Preupload describes the head of that moment: a stale one says x already holds A (it did, two
    commits ago), and create_commit would skip x. Prepared files always travel; unprepared ones are
    caught by the landed-tree check."""
    from colibri_relay import CommitNotVerified

    h0 = hub_store.head()
    h1 = hub_store.commit([PutFile("x", b"A")], parent=h0, message="m", nonce="abcdef30")
    h2 = hub_store.commit([PutFile("x", b"B")], parent=h1, message="m", nonce="abcdef31")
    fake_hub.faults.set(stale_head_read=1.0)  # every read of main now answers h1
    put = PutFile("x", b"A")
    hub_store.prepare([put])
    h3 = hub_store.commit([put, PutFile("y", b"1")], parent=h2, message="m", nonce="abcdef32")
    assert hub_store.read_file("x", h3) == b"A"
    with pytest.raises(CommitNotVerified, match="x has") as err:
        hub_store.commit([PutFile("x", b"B"), PutFile("y", b"2")], parent=h3, message="m", nonce="abcdef33")
    fake_hub.faults.set(stale_head_read=0.0)
    assert err.value.sha == hub_store.head()


def test_init_rides_out_a_busy_commit_lock(hub_store, fake_hub):
    from colibri_relay import Relay

    fake_hub.faults.inject("commit_409", 2)
    head, state = Relay(hub_store, holder="a").init()
    assert fake_hub.faults.injected["commit_409"] == 2
    assert (head, state.status) == (hub_store.head(), "free")


def test_workers_started_together_all_init_the_same_relay(fake_hub):
    """Every worker of a new run inits at once: the commits that meet the others' lock (409)
    or lose the CAS read the relay that won instead of failing."""
    from concurrent.futures import ThreadPoolExecutor

    from colibri_relay import Relay

    spec = "hf://colibri/init-race"
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: Relay(spec, holder=f"w{i}").init(), range(6)))
    heads = {head for head, _ in results}
    assert len(heads) == 1 and {state.nonce for _, state in results} == {results[0][1].nonce}
    assert sum(r.title.startswith("relay: init") for r in Relay(spec).store.history()) == 1
