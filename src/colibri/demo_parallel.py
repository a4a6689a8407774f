"""`make demo-parallel`: parallel DiLoCo rounds on this machine, offline, in a few minutes.

Two `colibri train --parallel` workers on a local relay (the same protocol as on the Hub), 2
rounds of 3 inner steps on the tiny preset. Worker 1 is killed (SIGKILL) while it trains round 0,
then restarted: the merger merges round 0 at its deadline with what landed, the restarted worker
joins the round it finds, and `colibri status` shows the rounds, the workers and the utilisation.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL = ["--seq-len", "32", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "1", "--eval-every", "0"]


def main(out: Path | None = None) -> int:
    from colibri_model.corpus import prose_files
    from colibri_model.data import prepare

    out = Path(out or tempfile.mkdtemp(prefix="colibri-demo-parallel-"))
    shards, relay = out / "shards", out / "relay"
    print(f"demo-parallel: everything under {out}")
    prepare([str(prose_files()[0])], shards, val_fraction=0.05, max_val_tokens=20_000, progress=False)
    cmd = [sys.executable, "-m", "colibri.cli", "train", "--parallel", "--store", str(relay), "--data", str(shards),
           "--rounds", "2", "--preset", "tiny", "--workers", "2", "--inner-steps", "3", "--round-time", "45",
           "--min-round-time", "0", "--lease-duration", "8", "--heartbeat", "1", "--poll", "0.2", "--no-plan-check",
           "--no-progress", *SMALL]

    def worker(slot: int) -> subprocess.Popen:
        return subprocess.Popen([*cmd, "--slot", str(slot), "--holder", f"worker-{slot}",
                                 "--work-dir", str(out / f"w{slot}")])

    first = worker(0)
    time.sleep(1.0)
    second = worker(1)
    deadline = time.monotonic() + 300
    while not (out / "w1" / "run").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # worker 1 is training round 0 once its run directory exists
    time.sleep(1.0)
    second.kill()
    second.wait()
    print("demo-parallel: killed worker 1 (SIGKILL) while it trained round 0; restarting it")
    second = worker(1)
    codes = [first.wait(timeout=600), second.wait(timeout=600)]
    status = subprocess.run([sys.executable, "-m", "colibri.cli", "status", "--store", str(relay)])
    ok = codes == [0, 0] and status.returncode == 0
    print("demo-parallel: " + ("done" if ok else f"FAILED (exit codes {codes}, status {status.returncode})"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
