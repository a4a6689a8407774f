"""Warm decode tokens/s: colibri-stream's engine vs transformers on the same imported model.

A Qwen3-MoE-shaped model, small but not trivial (d 512, 8 layers, 32 experts of 256, top-4,
GQA 8/2 heads of 64, vocab 8192), random-initialised with transformers' own config class and
saved as a bf16 checkpoint, then imported with `colibri-int4 import-hf --quant bf16` (the same
weights, bit for bit) and `--quant int4`. Both run bf16 with `--threads` torch threads in one
process; the engine at a budget that caches every expert (warm: after a warm-up run nothing is
read from disk). Each repeat runs transformers, then the engines, one after the other
(interleaved, so a neighbour's load on a shared machine hits both); the median and the best
(fastest, least disturbed) repeat are reported, with their ratios.

Measured: decode tokens/s = (new tokens - 1) / time after the first token, greedy, the same
prompt; transformers decodes with its KV cache (`past_key_values`), one token per forward.

    python bench/hf_vs_engine.py [--threads 2] [--tokens 64] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from colibri_int4.import_hf import import_hf, quant_scheme
from colibri_stream import Engine
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 8192
SHAPE = dict(vocab_size=VOCAB, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, intermediate_size=1536, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
             norm_topk_prob=True, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.05,
             tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
PROMPT_TOKENS = 16


def build(directory: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**SHAPE))
    hf = directory / "hf"
    model.to(torch.bfloat16).save_pretrained(hf)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(hf / "tokenizer.json"))
    return hf


@torch.inference_mode()
def transformers_decode(model, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """(greedy tokens, decode seconds after the first token), with the KV cache."""
    out = model(torch.tensor([prompt]), use_cache=True)
    past, token = out.past_key_values, int(out.logits[0, -1].argmax())
    ids = [token]
    began = time.perf_counter()
    for _ in range(tokens - 1):
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        ids.append(token)
    return ids, time.perf_counter() - began


def engine_decode(engine, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    result = engine.generate(prompt, tokens, stop_token_ids=[])
    return result.token_ids, result.decode_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompt = torch.randint(2, VOCAB, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        hf = build(directory)
        reference = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).eval()
        engines = {}
        for quant in ("bf16", "int4"):
            import_hf(hf, directory / f"{quant}.coli", quant_scheme(quant))
            plan = Engine.plan(directory / f"{quant}.coli", dtype="bf16")
            engines[quant] = Engine.open(directory / f"{quant}.coli", ram_budget=plan.full_budget, dtype="bf16")
        runs = {"transformers": (lambda: transformers_decode(reference, prompt, args.tokens))}
        runs.update({f"engine {q}": (lambda e=e: engine_decode(e, prompt, args.tokens)) for q, e in engines.items()})
        tokens, seconds = {}, {name: [] for name in runs}
        for name, run in runs.items():  # warm-up: the engines read every expert they need once
            tokens[name] = run()[0]
        for engine in engines.values():
            engine.reset_stats()
        for _ in range(args.repeats):
            for name, run in runs.items():
                seconds[name].append(run()[1])
        misses = {q: e.stats.misses for q, e in engines.items()}  # warm: 0 expected
        for engine in engines.values():
            engine.close()
    rates = {name: (args.tokens - 1) / statistics.median(s) for name, s in seconds.items()}
    best = {name: (args.tokens - 1) / min(s) for name, s in seconds.items()}
    report = {
        "shape": {k: v for k, v in SHAPE.items() if not k.endswith("token_id")},
        "threads": args.threads, "prompt_tokens": PROMPT_TOKENS, "new_tokens": args.tokens, "repeats": args.repeats,
        "tokens_per_s": {k: round(v, 2) for k, v in rates.items()},  # median
        "best_tokens_per_s": {k: round(v, 2) for k, v in best.items()},  # fastest repeat: least disturbed
        "ratio_engine_bf16_vs_transformers": round(rates["engine bf16"] / rates["transformers"], 3),
        "ratio_engine_int4_vs_transformers": round(rates["engine int4"] / rates["transformers"], 3),
        "best_ratio_engine_bf16_vs_transformers": round(best["engine bf16"] / best["transformers"], 3),
        "best_ratio_engine_int4_vs_transformers": round(best["engine int4"] / best["transformers"], 3),
        "same_greedy_tokens_bf16": tokens["engine bf16"] == tokens["transformers"],
        "first_difference_bf16": next((i for i, (a, b) in enumerate(zip(tokens["engine bf16"], tokens["transformers"]))
                                       if a != b), None),
        "engine_misses_while_timed": misses,
        "seconds": {k: [round(x, 4) for x in v] for k, v in seconds.items()},
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    if args.json:
        print(json.dumps(report))
        return
    for name, rate in rates.items():
        print(f"{name:14s} median {rate:8.2f} tok/s, best {best[name]:8.2f} tok/s "
              f"({args.repeats} repeats: {[round(x, 3) for x in seconds[name]]} s)")
    print(f"engine / transformers, median: bf16 x{report['ratio_engine_bf16_vs_transformers']}, int4 "
          f"x{report['ratio_engine_int4_vs_transformers']}; best: bf16 x{report['best_ratio_engine_bf16_vs_transformers']}, "
          f"int4 x{report['best_ratio_engine_int4_vs_transformers']}; same greedy tokens (bf16): "
          f"{report['same_greedy_tokens_bf16']} (first difference at {report['first_difference_bf16']})")


if __name__ == "__main__":
    main()
