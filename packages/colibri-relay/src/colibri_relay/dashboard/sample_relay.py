"""Build a small sample relay (LocalStore) with a few legs and a live run, through the real Relay API.

For the dashboard's tests and for trying the dashboard without training anything:

    python -m colibri_relay.dashboard.sample_relay /tmp/sample      # then:
    colibri-relay dashboard --store /tmp/sample/store --run /tmp/sample/run

Each leg claims the baton, pulls the previous payload, appends synthetic metrics lines (the shape
colibri-model writes, `metrics_version` 1.0, with per-layer router stats when `moe=True`, or
generic fields such as `reward` when not) to the payload's metrics.jsonl, pushes and releases.
The live leg claims, pulls into the run directory, appends a few more steps there and keeps the
baton held (its heartbeat stopped, as if the trainer were between renewals). Numbers are
synthetic (seeded `random`): they look like training curves, they are not measurements.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..ledger import LegSummary
from ..local_store import LocalStore
from ..relay import Leg, Relay

HOLDERS = ["alice@gpu-box", "bob@lab-h100", "dana@cloud-a100", "erin@home-4090"]
HARDWARE = ["1xH100", "8xH100", "1xA100", "1x4090"]


@dataclass
class SampleRelay:
    store_path: Path
    run_dir: Path
    legs: int
    live_holder: str | None
    live_leg: Leg | None = None


def _router(rng: random.Random, step: int, layers: int, experts: int) -> list[dict]:
    out = []
    for layer in range(layers):
        # Balance improves with training: the spread of raw weights shrinks with the step.
        spread = 1.5 / (1 + step / 40)
        weights = [math.exp(rng.gauss(0, spread)) for _ in range(experts)]
        if step < 30 and layer == layers - 1:
            weights[-1] = 0.0  # one dead expert early on, in the last layer
        total = sum(weights)
        load = [round(w / total, 6) for w in weights]
        mean = 1 / experts
        nonzero = [x for x in load if x > 0]
        out.append({"layer": layer, "max_vio": round(max(load) / mean - 1, 5), "dead_experts": experts - len(nonzero),
                    "load_entropy": round(-sum(x * math.log(x) for x in nonzero) / math.log(experts), 5),
                    "load": load})
    return out


def metrics_line(rng: random.Random, step: int, *, moe: bool, total_steps: int) -> dict:
    loss = 2.2 + 8.5 * math.exp(-step / 35) + rng.gauss(0, 0.05)
    warmup, decay_from = 10, int(total_steps * 0.8)
    lr = 3e-3 * min(1.0, step / warmup) * (1.0 if step < decay_from else (total_steps - step) / (total_steps - decay_from))
    tok_s = 41000 + rng.gauss(0, 1500)
    if not moe:  # a generic payload: not a language model, its own numeric fields
        return {"step": step, "time": time.time(), "loss": round(loss / 5, 4), "reward": round(1 - loss / 12, 4),
                "lr": lr, "episodes_per_s": round(tok_s / 1000, 2)}
    line = {"metrics_version": "1.0", "step": step, "time": time.time(), "kind": "pretrain", "loss": round(loss, 4),
            "aux_loss": None, "lr": lr, "phase": "warmup" if step < warmup else "stable", "grad_norm": round(
                abs(rng.gauss(1.0, 0.2)), 4), "tokens_seen": step * 16384, "tokens_per_s": round(tok_s, 1),
            "mfu": round(tok_s * 6 * 1.5e9 / 989e12, 5), "skipped": False, "skip_reason": None,
            "val_loss": round(loss + 0.15, 4) if step % 10 == 0 else None, "val_loss_infer": None,
            "router": _router(rng, step, layers=4, experts=8)}
    return line


def _append(path: Path, lines: list[dict]) -> None:
    with open(path, "a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def build_sample_relay(root: Path | str, *, legs: int = 3, steps_per_leg: int = 40, live_steps: int = 15,
                       moe: bool = True, live: bool = True, seed: int = 0, lease_duration_s: float = 1200.0) -> SampleRelay:
    """Create `root/store` (a relay with `legs` pushed legs) and `root/run` (the live leg's run dir)."""
    root = Path(root)
    rng = random.Random(seed)
    store = LocalStore(root / "store")
    Relay(store, lease_duration_s=lease_duration_s, heartbeat_s=lease_duration_s / 4).init()
    total = (legs + 1) * steps_per_leg
    step = 0
    for number in range(legs):
        holder = HOLDERS[number % len(HOLDERS)]
        relay = Relay(store, holder=holder, lease_duration_s=lease_duration_s, heartbeat_s=lease_duration_s / 4)
        work = root / "work" / f"leg-{number + 1}"
        leg = relay.claim(wait=False)
        try:
            leg.pull(work)
            lines = [metrics_line(rng, s, moe=moe, total_steps=total) for s in range(step + 1, step + steps_per_leg + 1)]
            _append(work / "metrics.jsonl", lines)
            (work / "model.bin").write_bytes(rng.randbytes(256))
            leg.push(work, LegSummary(steps=steps_per_leg, tokens=steps_per_leg * 16384, loss_start=lines[0]["loss"],
                                      loss_end=lines[-1]["loss"], hardware=HARDWARE[number % len(HARDWARE)],
                                      notes="synthetic sample leg"))
        finally:
            leg.release()
        step += steps_per_leg
    run_dir = root / "run"
    if not live:
        run_dir.mkdir(parents=True, exist_ok=True)
        return SampleRelay(root / "store", run_dir, legs, None)
    holder = "carol@h200-node"
    relay = Relay(store, holder=holder, lease_duration_s=lease_duration_s, heartbeat_s=lease_duration_s / 4)
    leg = relay.claim(wait=False)
    leg.pull(run_dir)
    _append(run_dir / "metrics.jsonl",
            [metrics_line(rng, s, moe=moe, total_steps=total) for s in range(step + 1, step + live_steps + 1)])
    leg.close()  # stop the heartbeat, keep the baton: RELAY.json still says held
    return SampleRelay(root / "store", run_dir, legs, holder, leg)


if __name__ == "__main__":  # pragma: no cover
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "sample-relay")
    sample = build_sample_relay(target)
    print(f"colibri-relay dashboard --store {sample.store_path} --run {sample.run_dir}")
