"""The chaos run: N contender processes race for K legs while we kill -9 them, SIGSTOP them for
longer than the lease, and (on the fake Hub) inject dropped replies, 500s, 409s, 429s and stale
reads. Afterwards `history_check.check_history` must find zero violations.

    python -m colibri_relay.testing.chaos run --store-kind hub --legs 200 --procs 8   # a bigger run

Each contender: claim -> pull -> check counter.json == leg - 1 -> "train" (sleeps + leg.check()) ->
write counter.json {leg, chain} + weights -> push -> append an ack line. A process killed after its
commit landed but before its ack is fine (unacknowledged); an ack without its tag is a violation.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

CONTENDER_ERRORS = "contender-errors.log"

# Every fault of the fake Hub at once (faults.py), per request of its kind: before apply, after apply,
# late apply, lock contention, rate limits, stale reads of every kind, slow replies, and commits that
# land without a file (the holder then rolls the payload back: PushNotVerified, a repair commit).
ALL_FAULTS = dict(
    commit_drop_request_before_apply=0.02, commit_drop_reply_after_apply=0.03, commit_500_after_apply=0.03,
    commit_504_after_apply=0.02, commit_late_apply=0.02, commit_409=0.03, commit_429=0.01, commit_drops_file=0.02,
    stale_head_read=0.05, stale_tags_read=0.05, tag_409=0.05,
    latency_s=0.005, retry_after_s=1, late_apply_s=0.3,
)


def contender(store_spec: str, legs: int, work: Path, name: str, lease_s: float, heartbeat_s: float, seed: int) -> int:
    from ..errors import LeaseHeld, LeaseLost, RelayError
    from ..relay import Relay

    rng = random.Random(seed)
    relay = Relay(store_spec, holder=name, lease_duration_s=lease_s, heartbeat_s=heartbeat_s)
    acks = work / "acks.jsonl"
    while True:
        try:
            if relay.status()[1].leg >= legs:
                return 0
            with relay.leg(poll_s=0.1, timeout_s=30 * lease_s) as leg:
                if leg.number > legs:
                    continue
                ck = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
                leg.pull(ck)
                counter_path = ck / "counter.json"
                counter = json.loads(counter_path.read_text()) if counter_path.exists() else {"leg": 0, "chain": []}
                if counter["leg"] != leg.number - 1 and not _rolled_back(relay.store, leg.lease.commit, counter["leg"]):
                    with open(work / "violations.log", "a") as f:
                        f.write(f"{name}: pulled counter {counter['leg']} for leg {leg.number}\n")
                for _ in range(rng.randint(1, 4)):
                    time.sleep(rng.uniform(0.01, 0.08))
                    leg.check()
                counter = {"leg": leg.number, "chain": [*counter["chain"], name]}
                counter_path.write_text(json.dumps(counter))
                (ck / "weights.bin").write_bytes(os.urandom(rng.randint(2_000, 20_000)))
                res = leg.push(ck, {"steps": 10, "tokens": 1000, "loss_start": 3.0, "loss_end": 2.9,
                                    "hardware": "chaos"})
                line = json.dumps({"leg": res.leg, "commit": res.commit, "holder": name}) + "\n"
                fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                os.write(fd, line.encode())
                os.fsync(fd)
                os.close(fd)
                shutil.rmtree(ck, ignore_errors=True)
        except (LeaseLost, LeaseHeld):
            continue
        except RelayError as exc:
            with open(work / CONTENDER_ERRORS, "a") as f:
                f.write(f"{name}: {type(exc).__name__}: {exc}\n")
            time.sleep(0.1)


def _rolled_back(store, head: str, payload_leg: int) -> bool:
    """Whether a repair commit restored leg `payload_leg`'s payload after a later push failed to verify."""
    from .history_check import PUSH_TITLE

    for rec in store.history(head):
        if rec.title.startswith("relay: repair "):
            return True
        m = PUSH_TITLE.match(rec.title)
        if m and int(m.group(1)) <= payload_leg:
            return False
    return False


def run_chaos(store_kind: str, *, legs: int, procs: int, lease_s: float = 1.5, heartbeat_s: float = 0.25,
              seed: int = 0, work: Path | None = None, timeout_s: float = 600, faults: bool = True) -> dict:
    """Run one chaos round; return the report (legs, faults injected, violations...)."""
    from ..local_store import LocalStore
    from ..relay import Relay
    from . import disable_xet
    from .fake_hub import FakeHub
    from .history_check import check_history

    disable_xet()
    rng = random.Random(seed)
    work = Path(work or tempfile.mkdtemp(prefix=f"relay-chaos-{store_kind}-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    hub = None
    if store_kind == "hub":
        # The Hub's commit quota (128 per hour at D = 1200 s), scaled to this run's lease duration.
        hub = FakeHub(data_dir=work / "hub", commit_rate_limit=(128, 3600.0 * lease_s / 1200.0)).start()
        env["HF_ENDPOINT"] = hub.endpoint
        from ..hub import HubStore

        store = HubStore("chaos/relay", endpoint=hub.endpoint)
        spec = "hf://chaos/relay"
    else:
        store = LocalStore(work / "store")
        spec = str(work / "store")
    Relay(store, lease_duration_s=lease_s, heartbeat_s=heartbeat_s).init()
    if hub is not None and faults:
        hub.faults.set(**ALL_FAULTS)
    counter = iter(range(10**6))
    live: dict[str, subprocess.Popen] = {}

    def spawn() -> None:
        name = f"c{next(counter)}"
        cmd = [sys.executable, "-m", "colibri_relay.testing.chaos", "contender", "--store", spec, "--legs", str(legs),
               "--work", str(work), "--name", name, "--lease-s", str(lease_s), "--heartbeat-s", str(heartbeat_s),
               "--seed", str(rng.randrange(10**9))]
        live[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(work / f"{name}.err", "w"))

    for _ in range(procs):
        spawn()
    kills = stops = 0
    stopped: dict[str, float] = {}
    t0 = time.monotonic()
    next_action = t0 + rng.uniform(1.0, 3.0)
    try:
        while time.monotonic() - t0 < timeout_s:
            for name, until in list(stopped.items()):
                if time.monotonic() >= until:
                    live[name].send_signal(signal.SIGCONT)
                    del stopped[name]
            if all(p.poll() is not None for p in live.values()) and not stopped:
                break
            if faults and time.monotonic() >= next_action:
                next_action = time.monotonic() + rng.uniform(1.0, 3.0)
                try:
                    holder = Relay(store).status()[1].holder
                except Exception:  # noqa: BLE001 - a stale/faulted read just picks at random
                    holder = None
                running = [n for n, p in live.items() if p.poll() is None and n not in stopped]
                if running:
                    victim = holder if holder in running and rng.random() < 0.5 else rng.choice(running)
                    if rng.random() < 0.5:
                        live[victim].send_signal(signal.SIGKILL)
                        live[victim].wait()
                        kills += 1
                        spawn()
                    elif not stopped:
                        live[victim].send_signal(signal.SIGSTOP)
                        stopped[victim] = time.monotonic() + lease_s * rng.uniform(1.3, 2.5)  # longer than D
                        stops += 1
            time.sleep(0.05)
    finally:
        for name in stopped:
            live[name].send_signal(signal.SIGCONT)
        for p in live.values():
            if p.poll() is None:
                try:
                    p.wait(timeout=3 * lease_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        injected = dict(hub.faults.injected) if hub else {}
        if hub:
            hub.faults.set(**{k: 0 for k in ALL_FAULTS if k not in ("retry_after_s", "late_apply_s")})
    elapsed = time.monotonic() - t0
    acks_path = work / "acks.jsonl"
    acks = [json.loads(line) for line in acks_path.read_text().splitlines()] if acks_path.exists() else []
    report = check_history(store, min_legs=legs, acks=acks, check_counter=True)
    vlog = work / "violations.log"
    if vlog.exists():
        report["violations"] += vlog.read_text().splitlines()
    errors = (work / CONTENDER_ERRORS).read_text().splitlines() if (work / CONTENDER_ERRORS).exists() else []
    report.update(store=store_kind, procs=procs, kills=kills, stops=stops, faults_injected=injected,
                  contender_errors=len(errors), elapsed_s=round(elapsed, 1), work=str(work))
    if hub:
        hub.stop()
    return report


@click.group()
def cli() -> None:
    """Chaos run for colibri-relay (contender processes + orchestrator)."""


@cli.command("contender")
@click.option("--store", required=True)
@click.option("--legs", type=int, required=True)
@click.option("--work", type=click.Path(path_type=Path), required=True)
@click.option("--name", required=True)
@click.option("--lease-s", type=float, required=True)
@click.option("--heartbeat-s", type=float, required=True)
@click.option("--seed", type=int, default=0)
def contender_cmd(store, legs, work, name, lease_s, heartbeat_s, seed) -> None:
    """One contender process (spawned by `run`)."""
    sys.exit(contender(store, legs, work, name, lease_s, heartbeat_s, seed))


@cli.command("run")
@click.option("--store-kind", type=click.Choice(["hub", "local"]), default="hub")
@click.option("--legs", type=int, default=50, show_default=True)
@click.option("--procs", type=int, default=4, show_default=True)
@click.option("--lease-s", type=float, default=1.5, show_default=True)
@click.option("--heartbeat-s", type=float, default=0.25, show_default=True)
@click.option("--seed", type=int, default=0)
def run_cmd(store_kind, legs, procs, lease_s, heartbeat_s, seed) -> None:
    """Run a chaos round and print its report as JSON (exit 1 on any violation)."""
    report = run_chaos(store_kind, legs=legs, procs=procs, lease_s=lease_s, heartbeat_s=heartbeat_s, seed=seed)
    click.echo(json.dumps(report, indent=2))
    sys.exit(1 if report["violations"] else 0)


if __name__ == "__main__":
    cli()
