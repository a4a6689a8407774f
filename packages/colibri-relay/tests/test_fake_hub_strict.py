"""The fake Hub is as strict as the Hub (ARCHITECTURE.md, "Test doubles behave like the real thing"):
commit quota, upload modes, LFS redirects and multipart uploads, paged commit listings."""

import os
import time

import httpx2
from colibri_relay import PutFile, Relay


def test_the_relays_default_timers_stay_well_inside_the_commit_quota(hub_store, fake_hub, monkeypatch):
    """128 commits per hour per repo: a holder renews every 300 s (12 per hour), so even a retry per
    renewal and a claim / push / release per leg every 10 minutes stay under half the quota. The same
    ratio, scaled 1000x faster, meets no 429 on the fake Hub."""
    relay = Relay(hub_store)
    count, window = 128, 3600.0
    per_hour = 3600 / relay.heartbeat_s * 2 + 6 * 3
    assert per_hour <= count / 2
    scale = 1000.0
    monkeypatch.setattr(fake_hub, "commit_rate_limit", (count, window / scale))
    fast = Relay(hub_store, holder="a", lease_duration_s=relay.lease_duration_s / scale,
                 heartbeat_s=relay.heartbeat_s / scale)
    fast.init()
    t0 = time.monotonic()
    with fast.leg() as leg:
        while time.monotonic() - t0 < 2 * window / scale:  # two quota windows
            leg.check()
            time.sleep(0.02)
        assert leg.lease.heartbeats >= 15
    assert fake_hub.commit_quota_wait(hub_store.repo_id) is None


def test_lfs_files_resolve_by_redirect_to_another_origin(hub_store, fake_hub, tmp_path):
    big = tmp_path / "w.safetensors"
    big.write_bytes(os.urandom(100_000))
    sha = hub_store.commit([PutFile("w.safetensors", big)], parent=hub_store.head(), message="m", nonce="5e01")
    r = httpx2.head(f"{fake_hub.endpoint}/{hub_store.repo_id}/resolve/{sha}/w.safetensors", follow_redirects=False)
    assert r.status_code == 302 and r.headers["Location"].startswith(fake_hub.cdn_endpoint)
    assert r.headers["X-Repo-Commit"] == sha and r.headers["X-Linked-Size"] == "100000"
    out = hub_store.download(["w.safetensors"], sha, tmp_path / "dl")  # the client follows it
    assert out["w.safetensors"].read_bytes() == big.read_bytes()


def test_large_lfs_files_upload_in_parts(hub_store, fake_hub, tmp_path, monkeypatch):
    monkeypatch.setattr(fake_hub, "multipart_threshold", 200_000)
    monkeypatch.setattr(fake_hub, "multipart_chunk_bytes", 64 * 1024)
    big = tmp_path / "w.safetensors"
    big.write_bytes(os.urandom(300_000))
    sha = hub_store.commit([PutFile("w.safetensors", big)], parent=hub_store.head(), message="m", nonce="5e02")
    info = hub_store.list_files(sha)["w.safetensors"]
    parts = sorted((fake_hub.state.data_dir / "parts" / info.sha256).iterdir())
    assert len(parts) == 5 and info.size == 300_000
    assert hub_store.read_file("w.safetensors", sha) == big.read_bytes()


def test_commit_listing_honours_limit(hub_store, fake_hub):
    head = hub_store.head()
    for i in range(4):
        head = hub_store.commit([PutFile("n", str(i).encode())], parent=head, message="m", nonce=f"5e1{i}")
    r = httpx2.get(f"{fake_hub.endpoint}/api/models/{hub_store.repo_id}/commits/{head}?limit=2")
    assert [c["id"] for c in r.json()][0] == head and len(r.json()) == 2
    assert "limit=2" in r.headers["Link"] and "p=1" in r.headers["Link"]


def test_preupload_decides_modes_like_the_hub(fake_hub, monkeypatch):
    state = fake_hub.state
    monkeypatch.setattr(state, "lfs_threshold", 10 * 1024 * 1024)  # the Hub's
    assert state.upload_mode("model.safetensors", 10) == "lfs"  # the repo's .gitattributes
    assert state.upload_mode("notes.txt", 2_000_000, b"plain text") == "regular"
    assert state.upload_mode("blob.dat", 2_000_000, b"\0\1\2") == "lfs"  # binary over 1 MB
    assert state.upload_mode("empty.bin", 0) == "regular"
    assert state.upload_mode("huge.txt", 10 * 1024 * 1024, b"text") == "lfs"


def test_gitignore_matching_covers_the_common_forms():
    from colibri_relay.testing.fake_hub_repo import gitignore_matches

    rules = "# logs\n*.log\n!keep.log\ncache/\n/top.txt\n"
    assert gitignore_matches(rules, "train.log") and gitignore_matches(rules, "a/b/train.log")
    assert not gitignore_matches(rules, "keep.log")
    assert gitignore_matches(rules, "cache/x.bin") and gitignore_matches(rules, "a/cache/x.bin")
    assert gitignore_matches(rules, "top.txt") and not gitignore_matches(rules, "a/top.txt")
    assert not gitignore_matches(rules, "model.safetensors")
