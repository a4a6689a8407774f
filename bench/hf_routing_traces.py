"""Routing traces of the imported MoE families, streamed by the engine, and their policy study.

For each MoE family import-hf converts (qwen3_moe, qwen2_moe, olmoe, mixtral, gpt_oss), a small random
transformers model (its own config class, saved bf16, no download), imported `--quant bf16`,
generates greedily with `record_trace=True`; the trace is saved (ROUTING_TRACE.md) and replayed
as `colibri-stream policy-study` does: every policy against Belady's MIN at 25% of the experts,
tuned on the first half of the steps, scored on the second.

NOTE: these figures prove the path (a real architecture's router -> engine trace -> policy
study), not the hit rate a trained MoE gets: greedy decoding of random weights falls into a
loop of a few tokens (`distinct_tokens`), whose routing repeats, so hit rates come out near 1.
SmolLM2 (dense) has no routed experts, hence no routing trace.

    python bench/hf_routing_traces.py [--tokens 256] [--out-dir traces/] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import transformers
from colibri_int4.import_hf import import_hf, quant_scheme
from colibri_stream import Engine
from colibri_stream.studies.cache_studies import policy_study
from colibri_stream.traces.routing_trace import read_trace
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, initializer_range=0.08, rms_norm_eps=1e-6, eos_token_id=None,
              pad_token_id=None, bos_token_id=None)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=32,
        num_experts_per_tok=4, norm_topk_prob=True),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=128,
        num_experts=32, num_experts_per_tok=4, norm_topk_prob=False),
    "olmoe": lambda: transformers.OlmoeConfig(
        **COMMON, intermediate_size=64, num_experts=32, num_experts_per_tok=4, norm_topk_prob=False),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON, head_dim=32, intermediate_size=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=32),
}


def record(family: str, directory: Path, out_dir: Path, tokens: int) -> tuple[Path, int]:
    """(the trace file, distinct tokens generated)."""
    torch.manual_seed(17)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]())
    hf = directory / family
    model.to(torch.bfloat16).save_pretrained(hf)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(hf / "tokenizer.json"))
    container = directory / f"{family}.coli"
    import_hf(hf, container, quant_scheme("bf16"))
    prompt = torch.randint(2, VOCAB, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    with Engine.open(container, ram_budget=Engine.plan(container).full_budget, record_trace=True) as engine:
        result = engine.generate(prompt, tokens, stop_token_ids=[])
        path = engine.save_trace(out_dir / f"{family}.jsonl.gz",
                                 source=f"bench/hf_routing_traces.py: random {family}, greedy {tokens} tokens")
    return path, len(set(result.token_ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out-dir", type=Path, default=None, help="Keep the traces here (default: a temporary dir).")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    args = parser.parse_args()
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out_dir or Path(tmp) / "traces"
        out_dir.mkdir(parents=True, exist_ok=True)
        for family in args.families:
            path, distinct = record(family, Path(tmp), out_dir, args.tokens)
            trace = read_trace(path)
            h = trace.header
            tuning, heldout = trace.split(0.5)
            point = policy_study(tuning, heldout, h.total_experts, h.n_experts, h.top_k, [0.25])["points"][0]
            held = point["heldout"]
            report[family] = {
                "trace": str(out_dir / f"{family}.jsonl.gz") if args.out_dir else None,
                "shape": [h.n_moe_layers, h.n_experts, h.top_k], "events": len(trace.events),
                "distinct_tokens": distinct,
                "cache_slots_25pct": point["cache_slots"], "belady": held["belady_hit_rate"],
                "static_oracle": held["static_oracle_hit_rate"],
                **{p: held[p]["hit_rate"] for p in ("lru", "lfu") if p in held},
                "random_routing_belady": point["random"]["belady_hit_rate"],
            }
    if args.json:
        print(json.dumps(report))
        return
    for family, r in report.items():
        print(f"{family:10s} {r['shape'][0]} MoE layers x {r['shape'][1]} experts, top-{r['shape'][2]}; "
              f"25% = {r['cache_slots_25pct']} slots: belady {r['belady']:.3f}, lru {r.get('lru', 0):.3f}, "
              f"lfu {r.get('lfu', 0):.3f}, static oracle {r['static_oracle']:.3f} | random routing belady "
              f"{r['random_routing_belady']:.3f}; {r['distinct_tokens']} distinct tokens of {args.tokens}")


if __name__ == "__main__":
    main()
