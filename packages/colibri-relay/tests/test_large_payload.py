"""A checkpoint-sized push through LFS on the fake Hub, slower than the lease, while heartbeats go on.

Size: COLIBRI_RELAY_BIG_MB (default 24 MB here; the report quotes a 400 MB run)."""

import hashlib
import json
import os

from colibri_relay import Relay


def test_push_slower_than_the_lease_keeps_the_heartbeat_running(hub_store, fake_hub, tmp_path):
    mb = int(os.environ.get("COLIBRI_RELAY_BIG_MB", "24"))
    # Timers as short as the suite's others (1 s leases) fenced this test on a loaded CI machine: the
    # upload's threads and the in-process fake Hub share one GIL with the heartbeat. 3 s keeps the
    # point (the upload outlasts two leases) with room for a starved heartbeat.
    D = 3.0
    # A slow link: the upload alone takes ~2 lease durations.
    fake_hub.upload_bytes_per_s = mb * 1024 * 1024 / (2 * D)
    ck = tmp_path / "ck"
    ck.mkdir()
    block = os.urandom(1 << 20)
    with open(ck / "model.safetensors", "wb") as f:
        for i in range(mb):
            f.write(block[:-4] + i.to_bytes(4, "little"))
    (ck / "optimizer.safetensors").write_bytes(os.urandom(100_000))
    (ck / "config.json").write_text(json.dumps({"d_model": 64}))
    (ck / "training_state.json").write_text(json.dumps({"step": 100}))
    (ck / "metrics.jsonl").write_text(json.dumps({"step": 100, "loss": 2.5}) + "\n")
    relay = Relay(hub_store, holder="big", lease_duration_s=D, heartbeat_s=0.3)
    relay.init()
    try:
        with relay.leg() as leg:
            before = leg.lease.heartbeats
            res = leg.push(ck, {"steps": 100})
            assert leg.lease.heartbeats - before >= 3  # renewals landed during the upload
            leg.check()
    finally:
        fake_hub.upload_bytes_per_s = None
    files = hub_store.list_files(res.commit)
    assert files["model.safetensors"].size == mb << 20 and files["model.safetensors"].sha256
    with relay.leg() as leg:
        got = leg.pull(tmp_path / "pulled")
    h = hashlib.sha256((tmp_path / "pulled" / "model.safetensors").read_bytes()).hexdigest()
    assert h == files["model.safetensors"].sha256 and set(got) == {
        "model.safetensors", "optimizer.safetensors", "config.json", "training_state.json", "metrics.jsonl"}
