"""Batched decoding vs one row after another: expert bytes read and decode tokens/s, one run.

B prompts are prefilled as one padded batch in both arms; then
- "one_by_one": each row's session decodes alone (what `Engine.generate([...])` did before
  batch_decode.py: `prefill_batch`, then `Session.generate` per row);
- "batched": `Engine.generate([...])`, one [B, 1] pass per step for every row still going, each
  distinct expert of a step read once for the batch.
Each arm opens a fresh engine (cold expert cache, same budget: the plan's minimum plus
`--share` of the experts), on a random-weight container of a colibri-model preset's shapes
(random routing: the batch's rows share fewer experts than a trained model's would, so the
requests ratio is a floor; and at a small cache the B rows' working sets compete for the same
slots, so misses need not fall with the requests). `rows_with_same_tokens` compares the arms'
greedy tokens (under f32 kernels they must all agree; bf16 kernels may turn a near-tie, see
below; f32 kernels also compute on dequantized experts, so the same budget holds fewer of them).
Prints one JSON object:
per arm the median over `--repeats` interleaved runs of decode seconds, decode tokens/s, expert
requests ((layer, expert) cache lookups: a step asks once per distinct expert) and misses, bytes
read during decoding (the runtime's counter, and /proc/self/io's read_bytes beside it), and the
ratios one_by_one / batched (tokens/s: batched / one_by_one).

    .venv/bin/python bench/batch_decode.py                       # nano shapes, 6 layers, B=4
    .venv/bin/python bench/batch_decode.py --experts 16 --rows 8 --new-tokens 32 --share 0.1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from colibri_stream import Engine
from colibri_stream.session import prefill_batch
from colibri_stream.studies.synthetic_container import synthetic_container

PROMPTS = ["The history of the river town begins with the mills", "Once upon a time", "In the morning the",
           "A short note on the weather in", "She opened the door and", "The committee decided that",
           "Bread is made from flour", "Under the old bridge there"]


def run(path, budget, rows: int, new_tokens: int, batched: bool, kernel_dtype: str) -> dict:
    # prefetch off: no guessed reads, the bytes are the misses
    with Engine.open(path, ram_budget=budget, prefetch="off", kernel_dtype=kernel_dtype) as eng:
        ids = [eng.encode(p) for p in (PROMPTS * rows)[:rows]]
        began = time.perf_counter()
        if batched:
            results = eng.generate(ids, new_tokens, stop_token_ids=[])
            decode_seconds = max(r.decode_seconds for r in results)
            prefill_counts = None  # the same padded prefill as one_by_one's, from the same cold cache
        else:
            sessions = prefill_batch(eng.runner, eng.codec, ids)
            eng.runner.update_io()
            prefill_counts = (eng.stats.bytes_read, eng.stats.bytes_read_os, eng.stats.hits + eng.stats.misses,
                             eng.stats.misses)
            results = [s.generate((), new_tokens, stop_token_ids=[]) for s in sessions]
            decode_seconds = sum(r.decode_seconds for r in results)
        wall = time.perf_counter() - began
        eng.runner.update_io()
        decoded = sum(len(r.token_ids) - 1 for r in results)  # the first token comes from the prefill
        return dict(tokens=[r.token_ids for r in results], decode_seconds=decode_seconds, wall_seconds=wall,
                    decode_tokens_per_s=decoded / decode_seconds, bytes_read=eng.stats.bytes_read,
                    bytes_read_os=eng.stats.bytes_read_os, prefill_counts=prefill_counts, steps=eng.stats.steps,
                    expert_requests=eng.stats.hits + eng.stats.misses, misses=eng.stats.misses,
                    io_agreement=eng.stats.io_agreement)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=None, help="routed experts per layer (preset's if unset)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--share", type=float, default=0.25, help="share of the experts the cache holds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kernel-dtype", default="bf16", choices=["bf16", "f32"],
                        help="int4 kernels' activations (f32: the rows' tokens must agree exactly)")
    parser.add_argument("--workdir", default=None, help="where the container is written (a real disk)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    experts = {} if args.experts is None else dict(n_experts=args.experts)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir, \
            synthetic_container(workdir, args.preset, n_layers=args.layers, **experts) as path:
        plan = Engine.plan(path)
        budget = int(plan.min_budget + args.share * (plan.full_budget - plan.min_budget))
        arms: dict[str, list[dict]] = {"one_by_one": [], "batched": []}
        for _ in range(args.repeats):  # interleaved: both arms see the same machine noise
            for name in arms:
                arms[name].append(run(path, budget, args.rows, args.new_tokens, name == "batched",
                                      args.kernel_dtype))
    one, batch = arms["one_by_one"], arms["batched"]
    # bf16 kernels round a [4, d] product unlike four [1, d] ones (~1e-3 in a logit), so on a random
    # model's near-tied logits a row may turn; with f32 kernels the logits agree to ~1e-6
    same = [a == b for a, b in zip(one[0]["tokens"], batch[0]["tokens"])]
    if args.kernel_dtype == "f32":
        assert all(same), "batched tokens differ from one-by-one under f32 kernels"
    prefill_counts, prefill_os, prefill_requests, prefill_misses = one[0]["prefill_counts"]

    def median(runs, key, minus=0):
        return statistics.median(r[key] - minus for r in runs)

    summary = {}
    for name, runs in arms.items():
        summary[name] = dict(
            decode_seconds=round(median(runs, "decode_seconds"), 4),
            decode_tokens_per_s=round(median(runs, "decode_tokens_per_s"), 2),
            decode_expert_requests=median(runs, "expert_requests", prefill_requests),  # (layer, expert) lookups
            decode_misses=median(runs, "misses", prefill_misses),
            decode_bytes_read=median(runs, "bytes_read", prefill_counts),
            decode_bytes_read_os=median(runs, "bytes_read_os", prefill_os or 0) if prefill_os is not None else None,
            passes=median(runs, "steps"), io_agreement=runs[0]["io_agreement"])
    print(json.dumps(dict(
        preset=args.preset, layers=args.layers, experts=args.experts, rows=args.rows, new_tokens=args.new_tokens, budget=budget,
        cache_share=args.share, threads=args.threads, repeats=args.repeats, kernel_dtype=args.kernel_dtype,
        rows_with_same_tokens=sum(same), **summary,
        requests_ratio=round(summary["one_by_one"]["decode_expert_requests"]
                             / max(summary["batched"]["decode_expert_requests"], 1), 3),
        bytes_ratio=round(summary["one_by_one"]["decode_bytes_read"] / max(summary["batched"]["decode_bytes_read"], 1), 3),
        tokens_per_s_ratio=round(summary["batched"]["decode_tokens_per_s"] / summary["one_by_one"]["decode_tokens_per_s"], 3),
    ), indent=1))


if __name__ == "__main__":
    main()
