"""K = 1 vs K = 2, 3 parallel workers (DiLoCo rounds) on the tiny preset, at equal total tokens.

Each configuration runs K real `colibri train --parallel` worker processes on a LocalStore relay
(the same code as on the Hub), H inner steps per round, rounds = total_steps / (K * H), so every
configuration trains the same number of tokens. Afterwards every merged base in the history is
evaluated on the same validation batches: loss against tokens, against simulated wall-clock (the
sum over rounds of the slowest worker's training time: K machines in parallel; on this machine the
K processes share its cores, so the measured time is not that), and the ledger's utilisation.

    python bench/parallel_rounds.py --total-steps 24 --inner-steps 4 --workers 1,2,3

Prints one JSON object; the ratio `loss_vs_k1` compares each K with K = 1 at equal tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL = ["--seq-len", "64", "--batch-size", "4", "--lr", "3e-3", "--warmup-steps", "2", "--eval-every", "0"]


def run_config(root: Path, shards: Path, k: int, rounds: int, h: int) -> dict:
    relay = root / f"k{k}" / "relay"
    cmd = [sys.executable, "-m", "colibri.cli", "train", "--parallel", "--relay", str(relay), "--data", str(shards),
           "--rounds", str(rounds), "--preset", "tiny", "--workers", str(k), "--inner-steps", str(h),
           "--round-time", "900", "--min-round-time", "0", "--lease-duration", "60", "--heartbeat", "10",
           "--poll", "0.2", "--no-plan-check", "--no-progress", *SMALL]
    t0 = time.monotonic()
    procs = []
    for i in range(k):
        procs.append(subprocess.Popen([*cmd, "--slot", str(i), "--holder", f"k{k}-w{i}",
                                       "--work-dir", str(root / f"k{k}" / f"w{i}")],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        time.sleep(0.5 if i == 0 else 0)  # the first starts the run; the others join it
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"K={k}: a worker failed:\n" + "\n".join(o[-2000:] for o in outs))
    elapsed = time.monotonic() - t0
    return {"relay": str(relay), "elapsed_s": round(elapsed, 1)}


def evaluate_history(relay_dir: Path, shards: Path, work: Path) -> list[dict]:
    from colibri_model.training import TrainConfig, Trainer, read_training_state
    from colibri_relay import Relay
    from colibri_relay.round_state import rounds_of
    from colibri_relay.rounds import RoundRelay, RoundView

    relay = Relay(str(relay_dir))
    rr = RoundRelay(relay)
    ledger = {e.round: e for e in rr.ledger()}
    points, tokens, sim_s = [], 0, 0.0
    merges = [c for c in reversed(relay.store.history())
              if c.title.startswith(("relay: start parallel rounds", "relay: merge round "))]
    for c in merges:
        state = relay.read_state(c.sha)
        view = RoundView(c.sha, state, rounds_of(state))
        base = work / f"eval-{view.round}"
        rr.pull_base(view, base)
        cfg = TrainConfig.model_validate({**read_training_state(base).train_config, "progress": False})
        trainer = Trainer.for_pretraining(work / f"eval-run-{view.round}", shards, None, cfg, resume_from=base)
        val = trainer.evaluate()
        trainer.close()
        done = ledger.get(view.round - 1)
        if done is not None:
            tokens += done.tokens
            sim_s += max((x.train_s for x in done.contributions), default=0.0)
        points.append({"round": view.round, "tokens": tokens, "sim_wall_s": round(sim_s, 2), "val_loss": round(val, 5),
                       "utilisation": None if done is None or done.utilisation is None else round(done.utilisation, 3),
                       "workers": 0 if done is None else len(done.contributions)})
        shutil.rmtree(base, ignore_errors=True)
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-steps", type=int, default=24)
    ap.add_argument("--inner-steps", type=int, default=4)
    ap.add_argument("--workers", default="1,2,3")
    args = ap.parse_args()
    from colibri_model.corpus import prose_files
    from colibri_model.data import prepare

    root = Path(tempfile.mkdtemp(prefix="bench-rounds-"))
    shards = root / "shards"
    prepare([str(prose_files()[0])], shards, val_fraction=0.05, max_val_tokens=20_000, progress=False)
    out = {"preset": "tiny", "inner_steps": args.inner_steps, "total_steps": args.total_steps,
           "cpu_threads": os.cpu_count(), "configs": {}}
    for k in [int(x) for x in args.workers.split(",")]:
        rounds = args.total_steps // (k * args.inner_steps)
        run = run_config(root, shards, k, rounds, args.inner_steps)
        run["rounds"] = rounds
        run["curve"] = evaluate_history(Path(run["relay"]), shards, root / f"k{k}")
        out["configs"][str(k)] = run
    base = out["configs"].get("1")
    if base:
        for run in out["configs"].values():
            run["loss_vs_k1"] = round(run["curve"][-1]["val_loss"] / base["curve"][-1]["val_loss"], 4)
            run["sim_wall_vs_k1"] = round(run["curve"][-1]["sim_wall_s"] / max(base["curve"][-1]["sim_wall_s"], 1e-9), 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
