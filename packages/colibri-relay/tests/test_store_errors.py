"""Store errors that must keep their meaning: an I/O error after a LocalStore
commit landed, a 429 whose wait is only in the message, a 404 on commit."""

import errno

import pytest
from colibri_relay import LocalStore, OutcomeUnknown, PutFile, RateLimited, StoreNotFound
from colibri_relay.hub import HubStore


def test_io_error_after_the_ref_rename_resolves_to_the_landed_commit(tmp_path, monkeypatch):
    """Bug 5: the commit landed (refs/main renamed), then an I/O error: that is our commit, not an OSError."""
    import colibri_relay.local_store as ls

    store = LocalStore(tmp_path / "s")
    h0 = store.create()
    real = ls._atomic_write

    def eio_after_rename(path, data):
        real(path, data)
        if path.name == "main":
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ls, "_atomic_write", eio_after_rename)
    sha = store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="beef01")
    monkeypatch.setattr(ls, "_atomic_write", real)
    assert sha == store.head() and store.history()[0].nonce == "beef01"


def test_io_error_before_the_ref_rename_is_outcome_unknown(tmp_path, monkeypatch):
    import colibri_relay.local_store as ls

    store = LocalStore(tmp_path / "s")
    h0 = store.create()
    real = ls._atomic_write

    def eio_before_rename(path, data):
        if path.name == "main":
            raise OSError(errno.EIO, "Input/output error")
        real(path, data)

    monkeypatch.setattr(ls, "_atomic_write", eio_before_rename)
    with pytest.raises(OutcomeUnknown, match="Input/output error"):
        store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="beef02")
    monkeypatch.setattr(ls, "_atomic_write", real)
    assert store.head() == h0


def test_commit_rate_limit_without_a_ratelimit_header_keeps_the_servers_wait(hub_store, fake_hub, monkeypatch):
    """Bug 6: the Hub's commit quota answers 429 with the wait in its message only ("... in 43 minutes")."""
    monkeypatch.setattr(fake_hub, "commit_rate_limit", (2, 3600.0))
    head = hub_store.head()
    for i in range(2):
        head = hub_store.commit([PutFile("x", str(i).encode())], parent=head, message="m", nonce=f"cafe0{i}")
    with pytest.raises(RateLimited) as err:
        hub_store.commit([PutFile("x", b"2")], parent=head, message="m", nonce="cafe02")
    assert err.value.retry_after_s >= 59 * 60  # "You can retry this action in 60 minutes", not the 5 s fallback


def test_ratelimit_header_shorter_than_the_message_does_not_win():
    """The Hub sends the api window's RateLimit header next to the commit quota's message
    (braindecode/braindecode#947: header "Retry after 271 seconds", message "in about 1 hour")."""
    from colibri_relay.hub.errors import retry_after_s

    headers = {"RateLimit": '"api";r=0;t=271', "RateLimit-Policy": '"fixed window";"api";q=1000;w=300'}
    msg = ("429 Too Many Requests: you have reached your 'api' rate limit.\nYou have exceeded the rate limit for "
           "repository commits (128 per hour). You can retry this action in about 1 hour.")
    assert retry_after_s(headers, msg) == 3600
    assert retry_after_s({}, "You can retry this action in 43 minutes.") == 43 * 60
    assert retry_after_s({"Retry-After": "7"}, "busy") == 7
    assert retry_after_s({}, "busy") == 5


def test_commit_to_a_missing_repo_is_store_not_found(fake_hub):
    """Bug 7: RepositoryNotFoundError is an HfHubHTTPError; a 404 on commit must stay StoreNotFound."""
    store = HubStore("tester/never-created", endpoint=fake_hub.endpoint, token="hf_fake")
    with pytest.raises(StoreNotFound):
        store.commit([PutFile("x", b"1")], parent="0" * 40, message="m", nonce="dead01")


def test_a_holder_told_to_wait_past_its_lease_fences_at_once_and_says_why(hub_store, fake_hub, monkeypatch):
    """Bug 6, relay side: a 429 asking for 60 minutes cannot be waited out inside a 1.2 s lease."""
    import time

    from colibri_relay import LeaseLost, Relay

    relay = Relay(hub_store, holder="a", lease_duration_s=1.2, heartbeat_s=0.15)
    relay.init()
    monkeypatch.setattr(fake_hub, "commit_rate_limit", (3, 3600.0))  # init, claim, one heartbeat
    leg = relay.claim()
    t0 = time.monotonic()
    with pytest.raises(LeaseLost, match="rate limited"):
        while time.monotonic() - t0 < 5:
            leg.check()
            time.sleep(0.02)
    leg.close()
