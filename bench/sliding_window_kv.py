"""A session's KV cache on a GPT-OSS-shaped model: sliding layers keeping only their window vs
every layer keeping every position, one run.

A random GPT-OSS-shaped model (sinks, biases, clamped experts; half the layers sliding over
`--window` positions) is exported to an int4 container, then one engine runs two arms in turn
over the same `--context` random tokens and `--new-tokens` greedy decode steps:
- "windowed": `engine.session()`, whose sliding layers drop what the window no longer sees
  (session_kv.py);
- "every_position": a session over a `SessionKV` without windows (what sessions held before).
The arms alternate `--repeats` times (medians reported: the machine is shared and noisy).
Prints one JSON object: per arm the KV bytes held at the end, prefill seconds, decode tokens/s,
and the largest |logit difference| between the arms over the decode steps (the same model and
kernels, so only the summation order of the shorter softmax may differ), plus the ratios.

    .venv/bin/python bench/sliding_window_kv.py                      # 4096-token context
    .venv/bin/python bench/sliding_window_kv.py --context 8000 --window 128 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from colibri_model import ColibriConfig
from colibri_stream import Engine
from colibri_stream.session import Session
from colibri_stream.session_kv import SessionKV
from colibri_stream.studies.synthetic_container import export_random_model


def gpt_oss_shaped(context: int, window: int) -> ColibriConfig:
    return ColibriConfig(
        name="gpt-oss-shaped", vocab_size=2048, d_model=256, n_layers=8, n_dense_layers=0, n_heads=8, n_kv_heads=4,
        head_dim=64, dense_ffn_dim=512, n_experts=16, expert_dim=128, top_k_train=2, top_k_infer=2,
        max_seq_len=context + 256, qk_norm=False, qkv_bias=True, o_bias=True, attn_sinks=True, sliding_window=window,
        sliding_layers=(0, 2, 4, 6), router_score="softmax", selection_bias=False, router_bias=True,
        expert_proj_bias=True, expert_glu="clamped_swiglu", glu_limit=7.0, shared_expert_dim=0)


def run_arm(engine: Engine, session: Session, context: list[int], new_tokens: int) -> tuple[dict, list[torch.Tensor]]:
    began = time.perf_counter()
    logits = session.append(context)
    prefill = time.perf_counter() - began
    steps = []
    began = time.perf_counter()
    for _ in range(new_tokens):
        steps.append(logits)
        logits = session.append([int(logits.argmax())])
    decode = time.perf_counter() - began
    return {"kv_bytes": session.kv.nbytes, "prefill_seconds": round(prefill, 3),
            "decode_tokens_per_s": round(new_tokens / decode, 2)}, steps


def median_of(records: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in records) for key in records[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = gpt_oss_shaped(args.context, args.window)
    context = torch.randint(0, config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(1)).tolist()
    out: dict = {"config": {"layers": config.n_layers, "sliding_layers": len(config.sliding_layers),
                            "window": args.window, "kv_heads": config.n_kv_heads, "head_dim": config.head_dim},
                 "context": args.context, "new_tokens": args.new_tokens, "prefill_chunk": args.prefill_chunk,
                 "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        path = export_random_model(tmp, config, bias_std=0.3)
        with Engine.open(path, ram_budget="2GB", dtype="f32", prefill_chunk=args.prefill_chunk,
                         max_context=args.context + args.new_tokens + 1) as eng:
            every = SessionKV(config.n_layers, config.kv_cache_heads, config.key_head_dim, eng.max_context, eng.device,
                              eng.runner.dtype, value_head_dim=config.value_head_dim)
            runs = {"windowed": [], "every_position": []}
            for _ in range(args.repeats):  # interleaved, so a load spike hits both arms alike
                runs["windowed"].append(run_arm(eng, eng.session(), context, args.new_tokens))
                runs["every_position"].append(run_arm(eng, Session(eng.runner, eng.codec, kv=every.copy()), context, args.new_tokens))
    windowed, full = (median_of([r[0] for r in runs[arm]]) for arm in ("windowed", "every_position"))
    windowed_steps, full_steps = runs["windowed"][0][1], runs["every_position"][0][1]
    out["windowed"], out["every_position"] = windowed, full
    out["max_abs_logit_difference"] = max(float((a - b).abs().max()) for a, b in zip(windowed_steps, full_steps))
    out["kv_bytes_ratio_every_over_windowed"] = round(full["kv_bytes"] / windowed["kv_bytes"], 3)
    out["decode_speed_ratio_windowed_over_every"] = round(
        windowed["decode_tokens_per_s"] / full["decode_tokens_per_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
