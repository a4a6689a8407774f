"""The chaos run of parallel rounds: K worker processes (one per slot) train integer "deltas" and merge
them (base total + sum of the merged deltas) while we kill -9 them (the merger too), SIGSTOP them
past the lease, and the fake Hub injects its faults on both repos. Afterwards
`round_history_check.check_round_history` must find zero violations, replaying every merge.

    python -m colibri_relay.testing.round_chaos run --rounds 100 --workers 4    # the long run

A worker killed after its contribution landed but before it wrote its ack is fine (unacknowledged,
yet merged or rejected all the same); an ack that no ledger entry names is a violation. One
delta in twenty is out of range and must be rejected by the merge as "failed check".
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from .chaos import ALL_FAULTS

BAD_DELTA = 10**6  # the merge refuses deltas this large: exercises "failed check"


def _train(rng: random.Random):
    def train(view, base_dir: Path, out_dir: Path) -> dict:
        time.sleep(rng.uniform(0.05, 0.3))
        delta = BAD_DELTA if rng.random() < 0.05 else rng.randint(1, 1000)
        (out_dir / "delta.json").write_text(json.dumps({"delta": delta}))
        return {"inner_steps": 1, "tokens": 10, "loss_start": 3.0, "loss_end": 2.9,
                "data_slice": {"round": view.round, "slot": None}}
    return train


def merge_totals(job):
    from ..round_loop import MergeOutput

    total = json.loads((job.base_dir / "total.json").read_text())["total"]
    failed = {}
    for meta, path in job.contributions:
        delta = json.loads((path / "delta.json").read_text())["delta"]
        if delta >= BAD_DELTA:
            failed[meta.slot] = f"delta {delta} out of range"
        else:
            total += delta
    (job.out_dir / "total.json").write_text(json.dumps({"round": job.round + 1, "total": total}))
    return MergeOutput(failed=failed, stats={"total": total})


def replay_totals(entry, base_dir: Path, new_dir: Path, contributions: list) -> list[str]:
    """The reference merge: new total = base total + the merged contributions' deltas."""
    base = json.loads((base_dir / "total.json").read_text())["total"]
    new = json.loads((new_dir / "total.json").read_text())["total"]
    deltas = {m.slot: json.loads((p / "delta.json").read_text())["delta"] for m, p in contributions}
    want = base + sum(deltas.values())
    out = [] if new == want else [f"total {new} != base {base} + merged deltas {sorted(deltas.values())}"]
    out += [f"slot {s} merged an out-of-range delta" for s, d in deltas.items() if d >= BAD_DELTA]
    return out


def worker(store_spec: str, slot: int, rounds: int, work: Path, lease_s: float, heartbeat_s: float, seed: int) -> int:
    from ..relay import Relay
    from ..round_loop import RoundWorker
    from ..rounds import RoundRelay

    rng = random.Random(seed)
    relay = Relay(store_spec, holder=f"w{slot}", lease_duration_s=lease_s, heartbeat_s=heartbeat_s)
    acks = work / "acks.jsonl"

    def on_ack(ack) -> None:
        line = json.dumps({"round": ack.round, "slot": ack.slot, "nonce": ack.nonce, "commit": ack.commit}) + "\n"
        fd = os.open(acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, line.encode())
        os.fsync(fd)
        os.close(fd)

    loop = RoundWorker(RoundRelay(relay), slot=slot, train=_train(rng), merge=merge_totals,
                       work_dir=work / f"w{slot}-{os.getpid()}", poll_s=0.1, on_ack=on_ack)
    while True:
        try:
            loop.run(rounds)
            return 0
        except Exception as exc:  # noqa: BLE001 - logged; the loop goes on, as a volunteer would
            with open(work / "worker-errors.log", "a") as f:
                f.write(f"w{slot}: {type(exc).__name__}: {exc}\n")
            time.sleep(0.2)


def start_run(spec: str, companion: str, *, workers: int, round_s: float, lease_s: float, heartbeat_s: float,
              work: Path) -> None:
    from ..relay import Relay
    from ..round_state import RoundsConfig
    from ..rounds import RoundRelay

    relay = Relay(spec, holder="starter", lease_duration_s=lease_s, heartbeat_s=heartbeat_s)
    relay.init()
    base = work / "start"
    base.mkdir(parents=True, exist_ok=True)
    (base / "total.json").write_text(json.dumps({"round": 0, "total": 0}))
    cfg = RoundsConfig(companion=companion, workers=workers, inner_steps=1, round_s=round_s)
    with relay.leg() as leg:
        RoundRelay(relay).start(leg, cfg, base)


def run_round_chaos(*, rounds: int, workers: int, lease_s: float = 2.0, heartbeat_s: float = 0.3,
                    round_s: float = 3.0, seed: int = 0, work: Path | None = None, timeout_s: float = 600,
                    faults: bool = True, kill_every_s: tuple[float, float] = (1.5, 3.0)) -> dict:
    """Run the chaos of rounds on the fake Hub; return the history check's report plus what was done."""
    from ..hub import HubStore
    from . import disable_xet
    from .fake_hub import FakeHub
    from .round_history_check import check_round_history

    disable_xet()
    rng = random.Random(seed)
    work = Path(work or tempfile.mkdtemp(prefix="rounds-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    hub = FakeHub(data_dir=work / "hub", commit_rate_limit=(128, 3600.0 * lease_s / 1200.0)).start()
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    os.environ["HF_ENDPOINT"] = hub.endpoint
    spec, companion = "hf://chaos/rounds", "hf://chaos/rounds-contributions"
    start_run(spec, companion, workers=workers, round_s=round_s, lease_s=lease_s, heartbeat_s=heartbeat_s, work=work)
    if faults:
        hub.faults.set(**ALL_FAULTS)
    live: dict[int, subprocess.Popen] = {}

    def spawn(slot: int) -> None:
        cmd = [sys.executable, "-m", "colibri_relay.testing.round_chaos", "worker", "--store", spec, "--slot",
               str(slot), "--rounds", str(rounds), "--work", str(work), "--lease-s", str(lease_s),
               "--heartbeat-s", str(heartbeat_s), "--seed", str(rng.randrange(10**9))]
        live[slot] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(work / f"w{slot}.err", "a"))

    for slot in range(workers):
        spawn(slot)
    store = HubStore("chaos/rounds", endpoint=hub.endpoint)
    kills = merger_kills = stops = 0
    stopped: dict[int, float] = {}
    t0 = time.monotonic()
    next_action = t0 + rng.uniform(*kill_every_s)
    try:
        while time.monotonic() - t0 < timeout_s:
            for slot, until in list(stopped.items()):
                if time.monotonic() >= until:
                    live[slot].send_signal(signal.SIGCONT)
                    del stopped[slot]
            if all(p.poll() is not None for p in live.values()) and not stopped:
                break
            if faults and time.monotonic() >= next_action:
                next_action = time.monotonic() + rng.uniform(*kill_every_s)
                try:
                    from ..relay import Relay

                    holder = Relay(store).status()[1].holder
                except Exception:  # noqa: BLE001 - a faulted read just picks at random
                    holder = None
                running = [s for s, p in live.items() if p.poll() is None and s not in stopped]
                if running:
                    merger = int(holder[1:]) if holder and holder[1:].isdigit() else None
                    victim = merger if merger in running and rng.random() < 0.5 else rng.choice(running)
                    if rng.random() < 0.75 or stopped:
                        live[victim].send_signal(signal.SIGKILL)
                        live[victim].wait()
                        kills += 1
                        merger_kills += victim == merger
                        spawn(victim)
                    else:
                        live[victim].send_signal(signal.SIGSTOP)
                        stopped[victim] = time.monotonic() + lease_s * rng.uniform(1.3, 2.0)
                        stops += 1
            time.sleep(0.05)
    finally:
        for slot in stopped:
            live[slot].send_signal(signal.SIGCONT)
        for p in live.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        injected = dict(hub.faults.injected)
        hub.faults.set(**{k: 0 for k in ALL_FAULTS if k not in ("retry_after_s", "late_apply_s")})
    acks_path = work / "acks.jsonl"
    acks = [json.loads(x) for x in acks_path.read_text().splitlines()] if acks_path.exists() else []
    report = check_round_history(store, HubStore("chaos/rounds-contributions", endpoint=hub.endpoint),
                                 min_rounds=rounds, acks=acks, replay=replay_totals)
    errors = work / "worker-errors.log"
    report.update(workers=workers, kills=kills, merger_kills=merger_kills, stops=stops, faults_injected=injected,
                  worker_errors=len(errors.read_text().splitlines()) if errors.exists() else 0,
                  elapsed_s=round(time.monotonic() - t0, 1), work=str(work))
    hub.stop()
    return report


@click.group()
def cli() -> None:
    """Chaos run of parallel rounds (worker processes + orchestrator)."""


@cli.command("worker")
@click.option("--store", required=True)
@click.option("--slot", type=int, required=True)
@click.option("--rounds", type=int, required=True)
@click.option("--work", type=click.Path(path_type=Path), required=True)
@click.option("--lease-s", type=float, required=True)
@click.option("--heartbeat-s", type=float, required=True)
@click.option("--seed", type=int, default=0)
def worker_cmd(store, slot, rounds, work, lease_s, heartbeat_s, seed) -> None:
    """One worker process (spawned by `run`)."""
    sys.exit(worker(store, slot, rounds, work, lease_s, heartbeat_s, seed))


@cli.command("run")
@click.option("--rounds", type=int, default=20, show_default=True)
@click.option("--workers", type=int, default=4, show_default=True)
@click.option("--lease-s", type=float, default=2.0, show_default=True)
@click.option("--round-s", type=float, default=3.0, show_default=True)
@click.option("--seed", type=int, default=0)
@click.option("--timeout-s", type=float, default=3600, show_default=True)
def run_cmd(rounds, workers, lease_s, round_s, seed, timeout_s) -> None:
    """Run the chaos of rounds and print its report as JSON (exit 1 on any violation)."""
    report = run_round_chaos(rounds=rounds, workers=workers, lease_s=lease_s, round_s=round_s, seed=seed,
                             timeout_s=timeout_s)
    click.echo(json.dumps(report, indent=2))
    sys.exit(1 if report["violations"] else 0)


if __name__ == "__main__":
    cli()
