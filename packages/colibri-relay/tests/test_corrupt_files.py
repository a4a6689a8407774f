"""Corrupt or truncated RELAY.json / LEDGER.jsonl / payload files: one clear error, nothing lost."""

import json

import pytest
from colibri_relay import ChecksumMismatch, PutFile, Relay, RelayFileCorrupt, SchemaVersionError
from colibri_relay.ledger import LEDGER_JSONL
from colibri_relay.relay_state import RELAY_FILE, RelayState, parse_relay_state


def relay_with_one_leg(store, tmp_path):
    relay = Relay(store, holder="a", lease_duration_s=1.2, heartbeat_s=0.15)
    relay.init()
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors").write_bytes(b"W" * 5000)
    (ck / "training_state.json").write_text('{"step": 10}')
    with relay.leg() as leg:
        leg.push(ck)
    return relay


@pytest.mark.parametrize("damage", ["truncated", "garbage", "wrong-type", "bad-field"])
def test_corrupt_relay_json_is_refused_and_nothing_is_written(store, tmp_path, damage):
    relay = relay_with_one_leg(store, tmp_path)
    good = store.read_file(RELAY_FILE, store.head())
    bad = {
        "truncated": good[: len(good) // 2],
        "garbage": b"\x00\xffnot json",
        "wrong-type": b"[1, 2]",
        "bad-field": good.replace(b'"epoch": 1', b'"epoch": -5'),
    }[damage]
    head = store.commit([PutFile(RELAY_FILE, bad)], parent=store.head(), message="vandal", nonce="bad1")
    with pytest.raises(RelayFileCorrupt) as err:
        relay.status()
    msg = str(err.value)
    assert RELAY_FILE in msg and head[:12] in msg and "\n" not in msg
    with pytest.raises(RelayFileCorrupt):
        relay.claim(wait=False)
    assert store.head() == head  # the claim wrote nothing
    # The last good state is still there, at its pinned revision.
    assert relay.read_state("leg-1").leg == 1


def test_unknown_major_version_names_both_versions():
    raw = RelayState().to_bytes().replace(b'"relay_version": "1.0"', b'"relay_version": "7.2"')
    with pytest.raises(SchemaVersionError, match=r"7\.2.*1\.0"):
        parse_relay_state(raw, "x RELAY.json")
    newer_minor = RelayState().to_bytes().replace(b'"relay_version": "1.0"', b'"relay_version": "1.9"')
    assert parse_relay_state(newer_minor, "x").relay_version == "1.9"


def test_corrupt_ledger_blocks_the_push_with_a_clear_error(store, tmp_path):
    relay = relay_with_one_leg(store, tmp_path)
    store.commit([PutFile(LEDGER_JSONL, b'{"leg": 1, "ledger_version": "1.0"\n')], parent=store.head(),
                 message="vandal", nonce="bad2")
    head = store.head()
    with relay.leg() as leg:
        with pytest.raises(RelayFileCorrupt, match="LEDGER.jsonl line 1"):
            leg.push(tmp_path / "ck")
    assert relay.status()[1].leg == 1
    assert "leg-2" not in store.list_tags()
    newer = store.history(stop_at=head)[:-1]  # claim, heartbeats, release: no push
    assert newer and not [c for c in newer if "push" in c.title]


@pytest.mark.parametrize("damage", ["truncated", "replaced"])
def test_payload_not_matching_the_manifest_is_refused_and_dest_untouched(store, tmp_path, damage):
    relay = relay_with_one_leg(store, tmp_path)
    new = b"W" * 2500 if damage == "truncated" else b"X" * 5000
    store.commit([PutFile("model.safetensors", new)], parent=store.head(), message="vandal", nonce="bad3")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "model.safetensors").write_bytes(b"mine")
    with relay.leg() as leg:
        with pytest.raises(ChecksumMismatch, match="model.safetensors"):
            leg.pull(dest, repair=False)
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors"]
    assert (dest / "model.safetensors").read_bytes() == b"mine"
    # The good payload is still intact at leg-1.
    good = json.loads(store.read_file("training_state.json", "leg-1"))
    assert good == {"step": 10}
    # By default the holder rolls the vandalised head back (one CAS commit) and pulls leg 1's payload.
    with relay.leg() as leg:
        got = leg.pull(dest)
    assert json.loads(got["training_state.json"].read_text()) == {"step": 10}
    assert got["model.safetensors"].read_bytes() == store.read_file("model.safetensors", "leg-1")
    assert any(c.title.startswith("relay: repair ") for c in store.history()[:5])


def test_local_blob_corruption_is_detected_on_read(tmp_path):
    from colibri_relay import LocalStore

    store = LocalStore(tmp_path / "s")
    store.create()
    sha = store.commit([PutFile("f.bin", b"Z" * 1000)], parent=store.head(), message="m", nonce="c0de")
    digest = store.list_files(sha)["f.bin"].sha256
    blob = store.root / "blobs" / digest[:2] / digest
    blob.write_bytes(b"Z" * 999)
    with pytest.raises(ChecksumMismatch, match="f.bin"):
        store.read_file("f.bin", sha)
    with pytest.raises(ChecksumMismatch):
        store.download(["f.bin"], sha, tmp_path / "out")
    assert not (tmp_path / "out" / "f.bin").exists()


def test_local_store_of_an_unknown_major_version_is_refused(tmp_path):
    from colibri_relay import LocalStore, StoreError

    store = LocalStore(tmp_path / "s")
    store.create()
    (store.root / "store.json").write_text('{"store_version": "3.0"}')
    with pytest.raises(StoreError, match=r"3\.0.*1\.0"):
        LocalStore(tmp_path / "s").head()


def test_a_damaged_local_store_gives_one_line_errors_not_tracebacks(tmp_path):
    import shutil

    from click.testing import CliRunner
    from colibri_relay.cli import main as relay_cli

    store = tmp_path / "relay"
    runner = CliRunner()
    assert runner.invoke(relay_cli, ["init", "--store", str(store)], catch_exceptions=False).exit_code == 0
    shutil.rmtree(store / "blobs")  # a partial copy of the store, say
    (store / "blobs").mkdir()
    for args in (["status", "--store", str(store)], ["ledger", "--store", str(store)]):
        result = runner.invoke(relay_cli, args, catch_exceptions=False)
        assert result.exit_code == 1, result.output
        assert "damaged" in result.output and len(result.output.strip().splitlines()) == 1

    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    result = runner.invoke(relay_cli, ["init", "--store", str(a_file)], catch_exceptions=False)
    assert result.exit_code != 0 and "cannot create a store" in result.output
    assert a_file.read_text() == "x"  # nothing lost
