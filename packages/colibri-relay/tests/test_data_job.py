"""The relay for something other than training: a resumable data-processing job handed between
processes, its cursor in the payload. Each process claims, pulls the outputs so far and the cursor,
processes one batch, pushes (only the new shard and the cursor travel), and exits; one is killed
with SIGKILL mid-batch and the next one resumes from the last pushed cursor after the lease expires."""

import json
import os
import signal
import subprocess
import sys
import time

from colibri_relay import PutFile, Relay

ITEMS, BATCH = 20, 6

WORKER = r"""
import json, sys, time
from pathlib import Path
from colibri_relay import Relay

store, work, name, mode, size = sys.argv[1:6]
relay = Relay(store, holder=name, lease_duration_s=1.2, heartbeat_s=0.15)
with relay.leg(poll_s=0.05, timeout_s=60) as leg:
    out = Path(work) / name
    leg.pull(out)
    cursor = json.loads((out / "cursor.json").read_text())["next"] if (out / "cursor.json").exists() else 0
    items = [int(x) for x in (Path(work) / "input.txt").read_text().split()]
    batch = items[cursor:cursor + int(size)]
    if mode == "crash":
        print("pulled", flush=True)
        time.sleep(60)  # killed here, lease held, nothing pushed
    (out / f"part-{cursor:05d}.txt").write_text("".join(f"{x * x}\n" for x in batch))
    (out / "cursor.json").write_text(json.dumps({"next": cursor + len(batch)}))
    leg.push(out, {"steps": len(batch), "notes": f"items {cursor}..{cursor + len(batch) - 1}"})
"""


def _run(spec, work, name, mode="run"):
    return subprocess.Popen([sys.executable, "-c", WORKER, spec, str(work), name, mode, str(BATCH)], env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_data_job_resumes_across_processes_from_the_cursor_in_its_payload(store, tmp_path):
    Relay(store, lease_duration_s=1.2, heartbeat_s=0.15).init()
    (tmp_path / "input.txt").write_text(" ".join(str(i) for i in range(ITEMS)))
    first = _run(store.spec, tmp_path, "w0")
    assert first.wait(60) == 0, first.stderr.read()
    crash = _run(store.spec, tmp_path, "w1", "crash")
    assert crash.stdout.readline().strip() == "pulled"
    crash.send_signal(signal.SIGKILL)
    crash.wait()
    t0 = time.monotonic()
    n = 2
    while True:
        head, state = Relay(store).status()
        cursor = json.loads(store.read_file("cursor.json", head))["next"]
        if cursor >= ITEMS:
            break
        w = _run(store.spec, tmp_path, f"w{n}")
        assert w.wait(60) == 0, w.stderr.read()
        n += 1
    assert time.monotonic() - t0 >= 1.2  # the killed holder's lease had to expire first
    files = store.list_files(head)
    parts = sorted(p for p in files if p.startswith("part-"))
    assert parts == [f"part-{i:05d}.txt" for i in range(0, ITEMS, BATCH)]
    squares = [int(x) for p in parts for x in store.read_file(p, head).split()]
    assert squares == [i * i for i in range(ITEMS)]  # every item once, in order
    ledger = Relay(store).ledger()
    assert [e.notes for e in ledger][0] == "items 0..5" and len(ledger) == len(parts)


def test_a_push_sends_only_the_files_that_changed(store, tmp_path, monkeypatch):
    relay = Relay(store, holder="a", lease_duration_s=1.2, heartbeat_s=0.15)
    relay.init()
    out = tmp_path / "out"
    out.mkdir()
    for i in range(5):
        (out / f"part-{i}.txt").write_text(f"shard {i}\n")
    (out / "cursor.json").write_text('{"next": 5}')
    with relay.leg() as leg:
        leg.push(out)
    (out / "part-5.txt").write_text("shard 5\n")
    (out / "cursor.json").write_text('{"next": 6}')
    sent = []
    real = store.commit

    def spy(ops, **kw):
        if "push" in kw["message"]:
            sent.extend(op.path for op in ops if isinstance(op, PutFile))
        return real(ops, **kw)

    monkeypatch.setattr(store, "commit", spy)
    with relay.leg() as leg:
        res = leg.push(out)
    assert sorted(sent) == ["LEDGER.jsonl", "LEDGER.md", "RELAY.json", "cursor.json", "part-5.txt"]
    assert len([p for p in store.list_files(res.commit) if p.startswith("part-")]) == 6
    got = {}
    with relay.leg() as leg:  # a pull into the same directory downloads nothing: all present
        monkeypatch.setattr(store, "download", lambda paths, *a, **k: got.setdefault("paths", paths) and {})
        leg.pull(out)
    assert got.get("paths", []) == []
