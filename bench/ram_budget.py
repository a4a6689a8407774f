"""Does colibri-stream stay inside its RAM budget? Measured, not accounted.

The engine plans its budget from sizes it can compute (resident weights, KV cache, workspace
estimate, staging, tokenizer estimate, cache slots); this script checks the plan against what
the process really holds. For each budget it starts a fresh Python process that imports
everything, records its anonymous RSS (`RssAnon` in /proc/self/status: heap and anonymous
mmaps, which is where the engine's tensors and O_DIRECT buffers live; the page cache is not in
it), opens the engine, generates, and samples `RssAnon` every 2 ms on a thread. Growth = peak
minus the pre-open baseline, compared with the budget. One process per point, so one point's
freed heap cannot hide the next one's allocations.

    python bench/ram_budget.py                      # NanoColibri-shaped random container, 3 budgets
    python bench/ram_budget.py --preset micro --fractions 0.1
    python bench/ram_budget.py --slab both          # per point: per-expert heap tensors, then the slab

The container is written to --workdir (a real disk) and deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

PROMPT = "The history of the river town begins with the mills"


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line (not Linux?)")


class PeakSampler(threading.Thread):
    """Polls RssAnon until stopped; `peak` is the largest value seen."""

    def __init__(self, interval: float = 0.002):
        super().__init__(daemon=True)
        self.interval, self.peak, self._done = interval, rss_anon_bytes(), threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_anon_bytes())
            time.sleep(self.interval)

    def stop(self) -> int:
        self._done.set()
        self.join()
        self.peak = max(self.peak, rss_anon_bytes())
        return self.peak


def child(path: str, budget: int, tokens: int, threads: int, slab: bool) -> dict:
    """One measured point, in this (fresh) process."""
    import torch
    from colibri_stream import Engine

    torch.set_num_threads(threads)
    torch.ones(64, 64) @ torch.ones(64, 64)  # torch's own first-use allocations are not the engine's
    baseline = rss_anon_bytes()
    sampler = PeakSampler()
    sampler.start()
    with Engine.open(path, ram_budget=budget, dtype="bf16", slab=slab) as engine:
        result = engine.generate(PROMPT, max_new_tokens=tokens, stop_token_ids=[])
        plan, stats = engine.budget, engine.stats.to_dict()
    peak = sampler.stop()
    return {
        "ram_budget": budget,
        "accounted_bytes": plan.accounted_bytes,
        "cache_slots": plan.slots,
        "total_experts": plan.total_experts,
        "baseline_rss_anon": baseline,
        "peak_rss_anon": peak,
        "growth": peak - baseline,
        "growth_over_budget": round((peak - baseline) / budget, 4),
        "hit_rate": stats["hit_rate"],
        "tokens_per_s": round(result.tokens_per_s, 3),
        "slab": slab,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/var/tmp/colibri-bench")
    parser.add_argument("--preset", default="nano", choices=["tiny", "nano", "micro"])
    parser.add_argument("--fractions", default="0,0.1,0.25",
                        help="share of the routed experts the cache holds on top of the minimum")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--slab", choices=["on", "off", "both"], default="on",
                        help="cache slots in one slab (the default) or per-expert heap tensors; both: A/B per point")
    parser.add_argument("--child", nargs=2, metavar=("CONTAINER", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.tokens, args.threads, args.slab == "on")))
        return

    from colibri_stream import BudgetError, Engine
    from colibri_stream.studies.synthetic_container import synthetic_container

    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with synthetic_container(args.workdir, args.preset) as path:
        try:
            Engine.open(str(path), ram_budget=1, dtype="bf16").close()
        except BudgetError as exc:
            minimum = exc.minimum_bytes
        with Engine.open(str(path), ram_budget=1 << 50, dtype="bf16") as probe:
            slot_bytes, total = probe.budget.slot_bytes, probe.budget.total_experts
        rows = []
        for fraction in (float(f) for f in args.fractions.split(",")):
            budget = minimum + int(fraction * total) * slot_bytes
            for slab in (["off", "on"] if args.slab == "both" else [args.slab]):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(path), str(budget), "--tokens", str(args.tokens),
                     "--threads", str(args.threads), "--slab", slab],
                    capture_output=True, text=True, check=True,
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["fraction"] = fraction
                rows.append(row)
                print(f"budget {budget / 1e6:8.1f} MB ({row['cache_slots']}/{row['total_experts']} experts cached), "
                      f"slab {slab:>3}: peak anonymous RSS growth {row['growth'] / 1e6:8.1f} MB = "
                      f"{row['growth_over_budget']:.3f} of the budget; hit rate {row['hit_rate']:.1%}, "
                      f"{row['tokens_per_s']} tok/s", flush=True)
    print(json.dumps({"preset": args.preset, "tokens": args.tokens, "points": rows}, indent=1))


if __name__ == "__main__":
    main()
