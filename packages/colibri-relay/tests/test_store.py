"""The RelayStore contract, run against LocalStore and HubStore (through the real client)."""

import os

import pytest
from colibri_relay import CasLost, DeleteFile, FileNotFoundInStore, PutFile, TagExists
from colibri_relay.store import SHA_RE


def test_create_is_idempotent_and_head_is_full_sha(store):
    h1 = store.head()
    assert SHA_RE.match(h1)
    assert store.create() == h1


def test_commit_lands_all_files_and_old_revisions_stay_readable(store, tmp_path):
    h0 = store.head()
    big = tmp_path / "model.safetensors"
    big.write_bytes(os.urandom(300_000))  # over the fake Hub's LFS threshold: goes through LFS
    h1 = store.commit([PutFile("a.txt", b"one"), PutFile("w/model.safetensors", big)], parent=h0,
                      message="first", nonce="0001")
    assert store.head() == h1 and h1 != h0
    h2 = store.commit([PutFile("a.txt", b"two"), DeleteFile("w/model.safetensors")], parent=h1,
                      message="second", nonce="0002")
    assert store.read_file("a.txt", h1) == b"one"
    assert store.read_file("a.txt", h2) == b"two"
    files1 = store.list_files(h1)
    assert files1["w/model.safetensors"].size == 300_000
    assert "w/model.safetensors" not in store.list_files(h2)
    with pytest.raises(FileNotFoundInStore):
        store.read_file("w/model.safetensors", h2)
    out = store.download(["w/model.safetensors", "a.txt"], h1, tmp_path / "dl")
    assert out["w/model.safetensors"].read_bytes() == big.read_bytes()
    assert (tmp_path / "dl" / "a.txt").read_bytes() == b"one"
    assert not [p for p in (tmp_path / "dl").iterdir() if p.name.startswith(".")]  # no staging left


def test_stale_parent_is_cas_lost_and_changes_nothing(store):
    h0 = store.head()
    h1 = store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="0003")
    with pytest.raises(CasLost):
        store.commit([PutFile("x", b"2"), PutFile("y", b"3")], parent=h0, message="m", nonce="0004")
    assert store.head() == h1
    assert "y" not in store.list_files(h1)
    assert store.read_file("x", store.head()) == b"1"


def test_history_is_linear_newest_first_with_nonces_and_timestamps(store):
    h0 = store.head()
    h1 = store.commit([PutFile("x", b"1")], parent=h0, message="one", nonce="00aa")
    h2 = store.commit([PutFile("x", b"2")], parent=h1, message="two", nonce="00bb")
    hist = store.history()
    assert [c.sha for c in hist[:3]] == [h2, h1, h0]
    assert hist[0].parent == h1 and hist[1].parent == h0
    assert hist[0].nonce == "00bb" and hist[1].nonce == "00aa"
    assert hist[0].timestamp >= hist[1].timestamp and "T" in hist[0].timestamp
    assert [c.sha for c in store.history(stop_at=h1)] == [h2, h1]
    assert store.history(h1)[0].sha == h1


def test_tags_are_created_once(store):
    h0 = store.head()
    h1 = store.commit([PutFile("x", b"1")], parent=h0, message="m", nonce="00cc")
    store.create_tag("leg-1", h1)
    with pytest.raises(TagExists) as err:
        store.create_tag("leg-1", h0)
    assert err.value.target == h1
    assert store.list_tags() == {"leg-1": h1}
    assert store.read_file("x", "leg-1") == b"1"


def test_nothing_changed_commit_is_refused_or_distinct(store):
    """create_commit skips the server when no file changed; the store must never report that as a write."""
    h0 = store.head()
    h1 = store.commit([PutFile("same", b"s")], parent=h0, message="m", nonce="00dd")
    try:
        h2 = store.commit([PutFile("same", b"s")], parent=h1, message="m", nonce="00ee")
    except Exception as exc:  # HubStore: the client skipped the commit -> StoreError
        assert "no change" in str(exc)
    else:  # LocalStore: a real, distinct commit
        assert h2 != h1 and store.history()[0].parent == h1


def test_history_follows_pages_and_stops_at(store):
    """The fake Hub pages its commit listing by 50 (Link header), like the Hub."""
    shas = [store.head()]
    for i in range(55):
        shas.append(store.commit([PutFile("n", str(i).encode())], parent=shas[-1], message="m", nonce=f"{i:04x}"))
    hist = store.history()
    assert [c.sha for c in hist[:56]] == shas[::-1]
    assert all(c.parent == shas[-2 - i] for i, c in enumerate(hist[:55]))
    assert [c.sha for c in store.history(stop_at=shas[3])] == shas[3:][::-1]
