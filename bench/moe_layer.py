"""MoE layer forward+backward vs a dense SwiGLU of equal active FLOPs, and vs the per-expert loop.

NanoColibri's MoE layer: T tokens of width d=1024, 64 routed experts of width 512 at top-2, plus
a 2048-wide shared expert; its active FLOPs equal a dense SwiGLU of width 2048 + 2*512 = 3072.
All three run in one process, interleaved, and the script prints median ratios as JSON:

    moe_over_dense  = time(MoE grouped) / time(dense 3072)     goal <= 1.5
    loop_over_moe   = time(MoE per-expert loop) / time(MoE grouped)   goal >= 3

Usage: python bench/moe_layer.py [--tokens 4096] [--repeats 7] [--loop-repeats 2] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from colibri_model import get_preset
from colibri_model.layers import SwiGLU
from colibri_model.moe import MoELayer


def time_fwd_bwd(fn, x: torch.Tensor) -> float:
    x = x.detach().requires_grad_()
    start = time.perf_counter()
    out = fn(x)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--loop-repeats", type=int, default=2, help="the loop is slow: fewer runs")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    torch.manual_seed(0)

    config = get_preset("nano")
    moe = MoELayer(config, layer_index=1).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    dense = SwiGLU(config.d_model, config.shared_expert_dim + config.top_k_train * config.expert_dim).to(dtype)
    for p in dense.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, args.tokens, config.d_model, dtype=dtype)

    def moe_loop(inp):
        moe.experts.use_grouped_mm = False
        try:
            return moe(inp)
        finally:
            moe.experts.use_grouped_mm = True

    runs = {"dense": dense, "moe": moe, "loop": moe_loop}
    for fn in runs.values():  # warm-up
        time_fwd_bwd(fn, x)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.repeats):
        for name, fn in runs.items():
            if name == "loop" and i >= args.loop_repeats:
                continue
            times[name].append(time_fwd_bwd(fn, x))
    # Ratios of neighbours in time (interleaved), then the median: robust to a noisy machine.
    moe_over_dense = statistics.median(m / d for m, d in zip(times["moe"], times["dense"]))
    loop_over_moe = statistics.median(lp / m for lp, m in zip(times["loop"], times["moe"]))
    print(json.dumps({
        "tokens": args.tokens, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
        "moe_over_dense": round(moe_over_dense, 3),
        "loop_over_moe": round(loop_over_moe, 3),
        "goals": {"moe_over_dense": "<= 1.5", "loop_over_moe": ">= 3"},
    }, indent=2))


if __name__ == "__main__":
    main()
