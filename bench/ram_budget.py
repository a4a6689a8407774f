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
    python bench/ram_budget.py --fractions smallest,0     # also at the smallest budget the plan allows
    python bench/ram_budget.py --compute int4             # torch's int4 kernels instead of the native ones
    python bench/ram_budget.py --slab both          # per point: per-expert heap tensors, then the slab
    python bench/ram_budget.py --caps 1.0GB,1.2GB,1.4GB   # `generate --ram-budget auto` in memory cgroups

The budgets come from the plan (`Engine.plan(path, dtype="bf16")`: its minimum plus a share of
the experts). With `--caps`, each cap instead runs the real CLI, `colibri-stream generate
--ram-budget auto --json`, inside a fresh child memory cgroup of that limit (v1 or v2, needs
root; studies/memory_cgroup.py) and reports what auto chose, the peak anonymous RSS, the
cgroup's own peak, OOM kills and both byte counters; a cap too small must be refused (exit 2)
with the numbers, never OOM-killed.

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


def child(path: str, budget: int, tokens: int, threads: int, slab: bool, compute: str = "auto") -> dict:
    """One measured point, in this (fresh) process."""
    import torch
    from colibri_stream import Engine

    torch.set_num_threads(threads)
    torch.ones(64, 64) @ torch.ones(64, 64)  # torch's own first-use allocations are not the engine's
    baseline = rss_anon_bytes()
    sampler = PeakSampler()
    sampler.start()
    with Engine.open(path, ram_budget=budget, dtype="bf16", slab=slab, compute=compute) as engine:
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
        "compute": stats["compute_mode"],
    }


def capped(path: str, cap: str, tokens: int, threads: int) -> dict:
    """`colibri-stream generate --ram-budget auto` in a child memory cgroup limited to `cap`."""
    from colibri_stream import parse_size
    from colibri_stream.studies.memory_cgroup import run_capped

    limit = parse_size(cap)
    command = [str(Path(sys.executable).with_name("colibri-stream")), "generate", path, "--prompt", PROMPT,
               "--ram-budget", "auto", "--max-new-tokens", str(tokens), "--threads", str(threads), "--json"]
    run = run_capped(command, limit)
    row = {"cap": limit, "exit_code": run.returncode, "peak_rss_anon": run.peak_rss_anon,
           "cgroup_peak": run.cgroup_peak, "oom_kills": run.oom_kills, "seconds": round(run.seconds, 1)}
    if run.returncode == 0:
        out = json.loads(run.stdout.strip().splitlines()[-1])
        stats, budget = out["stats"], out["budget"]
        row.update(ram_budget=budget["ram_budget"], dtype=budget["dtype"], prefill_chunk=budget["prefill_chunk"],
                   max_context=budget["max_context"], cache_slots=budget["cache_slots"], hit_rate=stats["hit_rate"],
                   bytes_read=stats["bytes_read"], bytes_read_os=stats["bytes_read_os"],
                   io_agreement=stats["io_agreement"], tokens_per_s=out["tokens_per_s"])
    else:
        row["error"] = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ""
    print(f"cap {limit / 1e9:.2f} GB: exit {run.returncode}, peak anonymous RSS {run.peak_rss_anon / 1e6:.0f} MB, "
          f"cgroup peak {(run.cgroup_peak or 0) / 1e6:.0f} MB, OOM kills {run.oom_kills}"
          + (f", budget {row['ram_budget'] / 1e6:.0f} MB ({row['dtype']}, chunk {row['prefill_chunk']}), "
             f"{row['cache_slots']} slots, {row['io_agreement']}" if run.returncode == 0 else f": {row['error'][:300]}"),
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/var/tmp/colibri-bench")
    parser.add_argument("--preset", default="nano", choices=["tiny", "nano", "micro"])
    parser.add_argument("--fractions", default="0,0.1,0.25",
                        help="share of the routed experts the cache holds on top of the minimum; 'smallest': the "
                        "smallest budget the plan runs at (dtype, max_context and prefill chunk stepped down)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--slab", choices=["on", "off", "both"], default="on",
                        help="cache slots in one slab (the default) or per-expert heap tensors; both: A/B per point")
    parser.add_argument("--compute", choices=["auto", "native", "int4", "dequant"], default="auto",
                        help="the engine's kernels (Engine.open's compute) at every point of the sweep")
    parser.add_argument("--caps", default=None,
                        help="comma-separated cgroup memory limits (e.g. 1.0GB,1.2GB): run `generate --ram-budget auto` "
                        "under each instead of the budget sweep")
    parser.add_argument("--child", nargs=2, metavar=("CONTAINER", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.tokens, args.threads, args.slab == "on",
                               args.compute)))
        return

    from colibri_stream import Engine
    from colibri_stream.studies.synthetic_container import synthetic_container

    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with synthetic_container(args.workdir, args.preset) as path:
        if args.caps:
            rows = [capped(str(path), cap, args.tokens, args.threads) for cap in args.caps.split(",")]
            print(json.dumps({"preset": args.preset, "tokens": args.tokens, "caps": rows}, indent=1))
            return
        plan = Engine.plan(str(path), dtype="bf16", compute=args.compute)
        minimum, slot_bytes, total = plan.min_budget, plan.slot_bytes, plan.total_experts
        rows = []
        for entry in args.fractions.split(","):
            fraction = None if entry == "smallest" else float(entry)
            if fraction is None:  # the unset defaults stepped down as far as they go
                budget = Engine.plan(str(path), compute=args.compute).smallest_budget
            else:
                budget = minimum + int(fraction * total) * slot_bytes
            for slab in (["off", "on"] if args.slab == "both" else [args.slab]):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(path), str(budget), "--tokens", str(args.tokens),
                     "--threads", str(args.threads), "--slab", slab, "--compute", args.compute],
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
