"""MLA prefill through the latent cache: the absorbed form on every chunk vs the chosen form.

One MultiHeadLatentAttention layer at DeepSeek-V2-Lite's attention shapes (d 2048, 16 heads,
no q LoRA, kv_lora_rank 512, nope 128, rope 64, v 128) prefills a prompt in chunks through a
KVCache, as colibri-stream does (`prefill_chunk`). Absorbed, chosen (`form = "auto"`) and, for
reference, decompressed on every chunk run in one process, interleaved, fp32; the script prints
JSON: the median seconds of each, absorbed_over_chosen (the speed-up of choosing), the forms
chosen per chunk, and the ratios mla_cost.py's FLOP counts predict (with the projections both
forms share, and over the differing steps alone); then one decode step over the prefilled context
(best of the repeats) and its attention kernel with the heads folded (mla.py) vs SDPA enable_gqa.

Usage: python bench/mla_prefill.py [--tokens 512] [--chunk 128] [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from colibri_model import ColibriConfig
from colibri_model.layers import KVCache
from colibri_model.mla import MultiHeadLatentAttention
from colibri_model.mla_cost import mla_form_flops

V2_LITE = dict(vocab_size=102400, d_model=2048, n_layers=1, n_dense_layers=1, n_heads=16, n_kv_heads=16,
               head_dim=192, dense_ffn_dim=10944, n_experts=0, expert_dim=0, qk_norm=False, max_seq_len=16384,
               attention_kind="mla", q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True)


def prefill(attn: MultiHeadLatentAttention, config: ColibriConfig, x: torch.Tensor, chunk: int) -> float:
    cache = KVCache(config, 1, x.shape[1])
    start = time.perf_counter()
    for s in range(0, x.shape[1], chunk):
        t = min(chunk, x.shape[1] - s)
        attn(x[:, s:s + t], torch.arange(s, s + t), cache)
        cache.length += t
    return time.perf_counter() - start


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_figures(attn: MultiHeadLatentAttention, config: ColibriConfig, context: int, repeats: int) -> dict:
    """One decode step over `context` cached positions (the absorbed form), and its attention
    kernel both ways: the heads folded into the query axis (mla.py) vs SDPA's enable_gqa."""
    cache = KVCache(config, 1, context + 1)
    cache.keys[0].normal_()
    x = torch.randn(1, 1, config.d_model)

    def step():
        cache.length = context
        attn(x, torch.tensor([context]), cache)

    attn.form = "auto"
    q, rows = torch.randn(1, 16, 1, 576), cache.keys[0][:, :, : context + 1]
    folded = best_of(lambda: F.scaled_dot_product_attention(q.reshape(1, 1, 16, 576), rows, rows[..., :512]), repeats)
    gqa = best_of(lambda: F.scaled_dot_product_attention(q, rows, rows[..., :512], enable_gqa=True), repeats)
    return {"decode_context": context, "decode_form": attn.form_for(1, context + 1),
            "decode_step_ms": round(best_of(step, repeats) * 1e3, 2),
            "decode_attention_ms": {"folded": round(folded * 1e3, 3), "enable_gqa": round(gqa * 1e3, 3)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ColibriConfig(**V2_LITE)
    attn = MultiHeadLatentAttention(config, 0).eval()
    x = torch.randn(1, args.tokens, config.d_model)
    shape = dict(heads=16, kv_rank=512, nope=128, rope=64, v_dim=128)
    passes = [(min(args.chunk, args.tokens - s), min(s + args.chunk, args.tokens)) for s in range(0, args.tokens,
                                                                                               args.chunk)]
    chosen = [attn.form_for(new, keys) for new, keys in passes]
    shared = 2 * args.tokens * 2048 * (16 * 192 + 576 + 16 * 128)  # q_proj, kv_a, o_proj: both forms

    def total_flops(forms: list[str]) -> int:
        return shared + sum(mla_form_flops(new, keys, **shape)[f] for (new, keys), f in zip(passes, forms))

    flops = {"absorbed": total_flops(["absorbed"] * len(passes)), "chosen": total_flops(chosen),
             "decompressed": total_flops(["decompressed"] * len(passes))}
    variants = {"absorbed": "absorbed", "chosen": "auto", "decompressed": "decompressed"}
    times = {key: [] for key in variants}
    with torch.no_grad():
        for form in variants.values():  # warm-up
            attn.form = form
            prefill(attn, config, x, args.chunk)
        for _ in range(args.repeats):
            for key, form in variants.items():
                attn.form = form
                times[key].append(prefill(attn, config, x, args.chunk))
        decode = decode_figures(attn, config, args.tokens, args.repeats)
    median = {key: statistics.median(t) for key, t in times.items()}
    print(json.dumps({
        "tokens": args.tokens, "chunk": args.chunk, "threads": torch.get_num_threads(), "repeats": args.repeats,
        "forms_chosen": chosen, "median_s": {k: round(v, 4) for k, v in median.items()},
        "min_s": {k: round(min(t), 4) for k, t in times.items()},  # the least disturbed run (shared CPUs)
        "absorbed_over_chosen_min": round(min(times["absorbed"]) / min(times["chosen"]), 3),
        "absorbed_over_chosen": round(median["absorbed"] / median["chosen"], 3),
        "decompressed_over_chosen": round(median["decompressed"] / median["chosen"], 3),
        "predicted_absorbed_over_chosen": round(flops["absorbed"] / flops["chosen"], 3),
        "predicted_absorbed_over_chosen_differing_steps": round((flops["absorbed"] - shared) / (flops["chosen"] - shared), 3),
        "gflops": {k: round(v / 1e9, 2) for k, v in flops.items()},
        **decode,
    }, indent=1))


if __name__ == "__main__":
    main()
