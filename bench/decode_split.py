"""Where a decode token's time goes: one engine at full RAM, the native kernels' share of a step.

    nice python bench/decode_split.py CONTAINER [--tokens 64] [--context 1024] [--split] [--threads 1]

Opens CONTAINER with every expert cached (`compute="native"`, `--threads`, default one), fills the cache with
two prefills of `--context / 2` random ids, then times `--tokens` decode steps of random ids in a
fresh session (as llama-bench's tg feeds them). With `--split`, each native kernel entry point and
SDPA are wrapped with a timer (about a microsecond a call), and the report gives each one's ms a
token; the rest of the step is Python, torch dispatch and the cache. Run it with and without
`--split` to see the timers' own cost. Report the CPU beside the figures (`lscpu`).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

KERNELS = ("colibri_q8_quantize", "colibri_q4_matmul", "colibri_q4_experts", "colibri_q8w_matmul",
           "colibri_bf16w_matmul", "colibri_norm_rope", "colibri_rms_norm", "colibri_add_weighted_rows",
           "colibri_token_experts_in", "colibri_token_experts_out", "colibri_route_row", "colibri_attention_in",
           "colibri_attention_out", "colibri_token_experts", "colibri_swiglu_rows", "colibri_attend_row",
           "colibri_decode_layer_front", "colibri_decode_layers")


class _Timed:
    def __init__(self, name: str, call, totals: dict):
        self.name, self.call, self.totals = name, call, totals

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.call(*args, **kwargs)
        finally:
            self.totals[self.name] = self.totals.get(self.name, 0.0) + time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("container")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--split", action="store_true", help="time each kernel entry point and SDPA")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from colibri_stream import Engine
    from colibri_stream.compute import native_kernel

    path = Path(args.container)
    # the plan's full budget: every expert cached, and the f32 engine dtype the C decode paths take
    # (twice the file is too little for a dense model's KV cache, and the plan then steps down to bf16)
    engine = Engine.open(path, compute="native", ram_budget=Engine.plan(path, compute="native").full_budget,
                         prefetch="off")
    vocab, rng = engine.config.vocab_size, random.Random(0)
    warm = engine.session()
    for _ in range(2):  # every expert read once: the timed steps are hits
        warm.append([rng.randrange(vocab) for _ in range(args.context // 2)])
    totals: dict[str, float] = {}
    if args.split:
        library = native_kernel._library()
        for name in KERNELS:
            setattr(library, name, _Timed(name, getattr(library, name), totals))
        import torch.nn.functional as F

        F.scaled_dot_product_attention = _Timed("sdpa", F.scaled_dot_product_attention, totals)
    session = engine.session()
    session.append([rng.randrange(vocab) for _ in range(8)])
    totals.clear()
    started = time.perf_counter()
    for _ in range(args.tokens):
        session.append([rng.randrange(vocab)])
    step = (time.perf_counter() - started) / args.tokens
    report = {"container": path.name, "tokens": args.tokens, "ms_per_token": round(step * 1e3, 2),
              "tok_s": round(1 / step, 2), "threads": torch.get_num_threads(),
              "capability": torch.backends.cpu.get_cpu_capability()}
    if args.split:
        report["ms_per_token_in"] = {k: round(v / args.tokens * 1e3, 2)
                                     for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
        inside = sum(totals.values()) / args.tokens
        report["kernels_share"] = round(inside / step, 3)
        report["outside_kernels_ms"] = round((step - inside) * 1e3, 2)
    engine.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
