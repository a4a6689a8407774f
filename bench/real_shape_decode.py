"""Decode on a real-size MoE shape: a synthetic container written from a Hugging Face config.json.

The container has the model's real shapes (e.g. Qwen3-30B-A3B: 48 MoE layers x 128 experts,
top-8, ~17 GB as int4) and random weights, written by colibri-int4's synthetic writer (no
checkpoint needed) and deleted afterwards. The engine opens it at `--share` of the container's
size as its RAM budget, decodes `--tokens` tokens one at a time, and reports:

- decode tokens/s, hit rate, bytes read per token (the engine's counter and /proc's read_bytes);
- the hit rate against Belady's MIN replayed on the run's own routing trace (prompt, warm-up and
  measured tokens, from a cold cache, as the run itself), same slot count;
- where a decode step's time went: expert math, I/O, verify + repack, the copy of a prepared
  expert into its slab slot (which includes the first touch of that slot's pages: while the
  cache fills, the kernel must find fresh pages, reclaiming page cache), and the cache's own
  bookkeeping on the hot path (the rest of `ExpertCache.get`: policy events, eviction,
  lookups), each as a share of the step.

Random weights route close to uniformly, so the hit rate is the worst case of real routing.

With `--cap`, the run happens in a child process inside a memory cgroup limited to `--share` of
the container's size, with `ram_budget="auto"` (what the cap leaves); the report adds the cap,
the budget auto chose, the child's peak RSS and the cgroup's OOM kills. The container is dropped
from the page cache first (a cold start, as after a reboot).

    nice python bench/real_shape_decode.py packages/colibri-stream/tests/fixtures/qwen3_30b_a3b/config.json \
        --dir /var/tmp --share 0.25 --tokens 16 [--policy lfu] [--compute native] [--cap] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from colibri_int4 import SYNTHETIC_SCHEME, QuantScheme, write_synthetic_container
from colibri_int4.import_hf import read_hf_config
from colibri_stream import Engine, belady
from colibri_stream.cache.expert_cache import ExpertCache
from colibri_stream.compute.expert_compute import Int4Expert
from colibri_stream.compute.native_expert import NativeQ4Expert
from colibri_stream.io.accounting import ReadBytesCounter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a Hugging Face config.json (or its directory)")
    parser.add_argument("--dir", default="/var/tmp", help="where the container goes (real storage, not tmpfs)")
    parser.add_argument("--share", type=float, default=0.25, help="RAM budget as a share of the container")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=8,
                        help="decode tokens before the measured ones (the cache fills; slots are first touched)")
    parser.add_argument("--policy", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefetch", default="off", choices=["auto", "off", "predict", "on"],
                        help="off (default) keeps every read on the model thread, so the split below is exact")
    parser.add_argument("--compute", default="auto", help="the engine's compute route (auto, native, int4, dequant)")
    parser.add_argument("--cap", action="store_true",
                        help="run inside a memory cgroup of --share x the container, budget auto")
    parser.add_argument("--keep", action="store_true", help="keep the container (for a rerun)")
    parser.add_argument("--import-scheme", action="store_true",
                        help="the scheme `colibri-int4 import-hf` writes by default (int8 resident, bf16 embedding and "
                             "LM head) instead of the synthetic one (int4 everywhere)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config, _, _ = read_hf_config(args.config)
    scheme = QuantScheme(group_size=64) if args.import_scheme else SYNTHETIC_SCHEME
    suffix = "-import" if args.import_scheme else ""
    path = Path(args.dir) / f"synthetic-{Path(args.config).resolve().parent.name}{suffix}.coli"
    try:
        if not path.exists():
            started = time.perf_counter()
            write_synthetic_container(path, config, scheme)
            print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - started:.0f} s",
                  flush=True)
        if args.child:  # inside the cgroup: one JSON line for the parent
            print(json.dumps(run(path, "auto", args)))
            return
        report = capped(path, args) if args.cap else run(path, int(args.share * path.stat().st_size), args)
    finally:
        if not args.keep and not args.child:
            path.unlink(missing_ok=True)
    print(json.dumps(report, indent=None if args.json else 2))


def capped(path: Path, args) -> dict:
    """This run again in a child inside a memory cgroup of share x the container (budget auto)."""
    from llama_cpp_side_by_side import drop_from_page_cache, run_measured

    cap = int(args.share * path.stat().st_size)
    drop_from_page_cache(path)
    command = [sys.executable, __file__, args.config, "--dir", args.dir, "--share", args.share, "--tokens",
               args.tokens, "--warmup", args.warmup, "--threads", args.threads, "--prefetch", args.prefetch,
               "--compute", args.compute, "--child"] + (["--import-scheme"] if args.import_scheme else []) + (["--policy", args.policy] if args.policy else [])
    done = run_measured(command, cap, timeout=3600)
    row = {"cap_gb": round(cap / 1e9, 3), "max_rss_gb": round(done["max_rss"] / 1e9, 3),
           "oom_kills": done["oom_kills"], "returncode": done["returncode"]}
    if done["returncode"] != 0:
        lines = done["stderr"].strip().splitlines()
        return row | {"error": lines[-1] if lines else "no output"}
    return row | json.loads(done["stdout"].strip().splitlines()[-1])


def run(path: Path, budget: int, args) -> dict:
    bookkeeping, slot_copy = [0.0], [0.0]
    original_get = ExpertCache.get
    prepared_kinds = (Int4Expert, NativeQ4Expert)
    original_moves = [kind.move_into for kind in prepared_kinds]

    def timed(original_move):
        def timed_move(self, slot):  # the copy into the slab slot, first touch of its pages included
            started = time.perf_counter()
            try:
                return original_move(self, slot)
            finally:
                slot_copy[0] += time.perf_counter() - started
        return timed_move

    def timed_get(self, layer, expert, pinned=()):
        io, verify, copied_before = self.stats.io_seconds, self.stats.verify_seconds, slot_copy[0]
        started = time.perf_counter()
        try:
            return original_get(self, layer, expert, pinned)
        finally:
            spent = time.perf_counter() - started - (slot_copy[0] - copied_before)
            bookkeeping[0] += spent - (self.stats.io_seconds - io) - (self.stats.verify_seconds - verify)

    ExpertCache.get = timed_get
    for kind, original_move in zip(prepared_kinds, original_moves):
        kind.move_into = timed(original_move)
    try:
        with Engine.open(path, ram_budget=budget, cache_policy=args.policy, record_trace=True, prefill_chunk=1,
                         prefetch=args.prefetch, compute=args.compute) as eng:
            budget = eng.budget.ram_budget
            session = eng.session()
            session.append([1, 2, 3, 4])  # a short prompt; every measured step below is one decode token
            token = 5
            for _ in range(args.warmup):
                token = int(session.append([token])[-1].argmax())
            s = eng.stats
            before = {k: getattr(s, k) for k in ("io_seconds", "verify_seconds", "compute_seconds", "bytes_read",
                                                 "hits", "misses")}
            bookkeeping[0] = slot_copy[0] = 0.0
            os_counter = ReadBytesCounter()
            started = time.perf_counter()
            for _ in range(args.tokens):
                token = int(session.append([token])[-1].argmax())
            wall = time.perf_counter() - started
            os_read = os_counter.since()
            delta = {k: getattr(s, k) - v for k, v in before.items()}
            trace, total_hits, total_lookups = list(s.trace), s.hits, s.hits + s.misses
            slots, policy, compute = eng.budget.slots, s.policy, s.compute_mode
    finally:
        ExpertCache.get = original_get
        for kind, original_move in zip(prepared_kinds, original_moves):
            kind.move_into = original_move
    lookups = delta["hits"] + delta["misses"]
    ceiling = belady(trace, slots).hit_rate
    per_token = wall / args.tokens
    return {
        "container_gb": round(path.stat().st_size / 1e9, 2), "ram_budget_gb": round(budget / 1e9, 2),
        "slots": slots, "policy": policy, "compute": compute, "prefetch": args.prefetch, "tokens": args.tokens, "threads": args.threads,
        "decode_tok_s": round(args.tokens / wall, 3),
        "hit_rate_measured_tokens": round(delta["hits"] / lookups, 4),
        "hit_rate_whole_run": round(total_hits / total_lookups, 4), "belady_whole_run": round(ceiling, 4),
        "of_belady": round(total_hits / total_lookups / ceiling, 3) if ceiling else None,
        "mb_read_per_token": round(delta["bytes_read"] / args.tokens / 1e6, 1),
        "os_mb_read_per_token": None if os_read is None else round(os_read / args.tokens / 1e6, 1),
        "step_ms": round(1e3 * per_token, 1),
        "share_of_step": {
            "expert_math": round(delta["compute_seconds"] / wall, 3),
            "io": round(delta["io_seconds"] / wall, 3),
            "verify_and_repack": round(delta["verify_seconds"] / wall, 3),
            "slot_copy": round(slot_copy[0] / wall, 4),
            "cache_bookkeeping": round(bookkeeping[0] / wall, 4),
            "rest (resident math, routing, glue)": round(
                1 - (delta["compute_seconds"] + delta["io_seconds"] + delta["verify_seconds"] + slot_copy[0]
                     + bookkeeping[0]) / wall, 3),
        },
        "expert_lookups_per_token": lookups // args.tokens,
    }


if __name__ == "__main__":
    main()
