"""What a routing trace offers a cache that sees only expert ids: popularity, reuse by the next
token, and affinity between consecutive layers of the same token.

An online cache (or a prefetcher without hidden states) can only guess the experts a token will
need from what it has seen. This measures, per trace, how good those guesses can be:

- popularity: each layer's most used expert's share of the layer's uses, and the recall of a
  guess of the layer's k most popular experts (fit on the tuning trace);
- next-token reuse: P(expert used by the next token | used by this one) in the same layer,
  against the same probability were tokens drawn independently from the layer's popularity;
- reuse as a guess: the previous token's experts of layer l + 1, topped up by popularity;
- layer affinity: from the experts this token took in layer l, guess its k experts of layer
  l + 1 by the tuning trace's counts of (l, a) -> (l + 1, b); recall of the true ones, alone and
  with the previous token's experts of layer l + 1 added in (weight `--reuse-weight`).

Fit on the tuning trace, reported on the held-out one (as `colibri-stream policy-study` does):

    python bench/routing_signals.py HELDOUT.jsonl.gz --tuning TUNING.jsonl.gz [--guesses 2,3,4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

from colibri_stream.traces.routing_trace import read_trace


def steps_of(events) -> list[dict[int, tuple[int, ...]]]:
    """[step] -> {layer: experts}, steps in order (a layer a trace leaves out is absent)."""
    by_step: dict[int, dict[int, tuple[int, ...]]] = defaultdict(dict)
    for e in events:
        by_step[e.step][e.layer] = tuple(e.experts)
    return [by_step[s] for s in sorted(by_step)]


def popularity(steps, n_layers: int) -> list[Counter]:
    counts = [Counter() for _ in range(n_layers)]
    for step in steps:
        for layer, experts in step.items():
            counts[layer].update(experts)
    return counts


def reuse(steps, n_layers: int, n_experts: int) -> dict:
    """Next-token reuse in the same layer, and what independent tokens would give."""
    reused = used = 0
    for prev, cur in zip(steps, steps[1:]):
        for layer, experts in prev.items():
            if layer in cur:
                used += len(experts)
                reused += len(set(experts) & set(cur[layer]))
    counts = popularity(steps, n_layers)
    chance_num = chance_den = 0.0
    for layer in range(n_layers):
        n_steps = sum(1 for s in steps if layer in s)
        if not n_steps:
            continue
        p = [counts[layer][e] / n_steps for e in range(n_experts)]  # P(e used by a token)
        chance_num += sum(x * x for x in p)
        chance_den += sum(p)
    return {"p_reuse": round(reused / used, 4) if used else None,
            "p_reuse_if_independent": round(chance_num / chance_den, 4) if chance_den else None}


def recall_of_guesses(heldout, guess, k: int) -> float:
    """Share of the held-out experts of layer l + 1 that `guess(t, l, k)` named."""
    hit = total = 0
    for t, step in enumerate(heldout):
        for layer in sorted(step):
            if layer + 1 not in step:
                continue
            truth = set(step[layer + 1])
            hit += len(set(guess(t, layer, k)) & truth)
            total += len(truth)
    return round(hit / total, 4) if total else 0.0


def study(tuning, heldout, n_layers: int, n_experts: int, guesses: list[int], reuse_weight: float) -> dict:
    affinity: Counter = Counter()
    for step in tuning:
        for layer, experts in step.items():
            for b in step.get(layer + 1, ()):
                for a in experts:
                    affinity[(layer, a, b)] += 1
    popular = popularity(tuning, n_layers)

    def ranked(scores: list[float], k: int) -> list[int]:
        return sorted(range(n_experts), key=lambda e: (-scores[e], e))[:k]

    def by_popularity(t, layer, k):
        return ranked([popular[layer + 1][e] for e in range(n_experts)], k)

    def by_reuse(t, layer, k):  # the previous token's experts of layer l + 1, then the most popular
        previous = heldout[t - 1].get(layer + 1, ()) if t > 0 else ()
        return ranked([(1e6 if e in previous else 0) + popular[layer + 1][e] for e in range(n_experts)], k)

    def by_affinity(t, layer, k, weight=0.0):
        scores = [sum(affinity[(layer, a, b)] for a in heldout[t][layer]) + 1e-3 * popular[layer + 1][b]
                  for b in range(n_experts)]
        if weight and t > 0:
            for b in heldout[t - 1].get(layer + 1, ()):
                scores[b] += weight
        return ranked(scores, k)

    top_share = [max(c.values()) / sum(c.values()) for c in popularity(heldout, n_layers) if c]
    out = {"top_expert_share": {"min": round(min(top_share), 4), "max": round(max(top_share), 4)},
           **reuse(heldout, n_layers, n_experts), "guesses": {}}
    for k in guesses:
        out["guesses"][k] = {
            "chance": round(k / n_experts, 4),
            "popularity": recall_of_guesses(heldout, by_popularity, k),
            "reuse": recall_of_guesses(heldout, by_reuse, k),
            "layer_affinity": recall_of_guesses(heldout, by_affinity, k),
            "layer_affinity_and_reuse": recall_of_guesses(
                heldout, lambda t, layer, kk: by_affinity(t, layer, kk, reuse_weight), k),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heldout", type=Path, help="routing trace to report on")
    parser.add_argument("--tuning", type=Path, required=True, help="routing trace to fit on")
    parser.add_argument("--guesses", default="2,3,4", help="experts guessed per layer")
    parser.add_argument("--reuse-weight", type=float, default=100.0,
                        help="score added to the previous token's experts, in affinity counts")
    parser.add_argument("--json", type=Path, default=None, help="write the result here too")
    args = parser.parse_args(argv)
    heldout, tuning = read_trace(args.heldout), read_trace(args.tuning)
    h = heldout.header
    if (h.n_moe_layers, h.n_experts) != (tuning.header.n_moe_layers, tuning.header.n_experts):
        parser.error(f"{args.tuning}: {tuning.header.n_moe_layers} x {tuning.header.n_experts} experts, "
                     f"{args.heldout} has {h.n_moe_layers} x {h.n_experts}")
    try:
        guesses = [int(k) for k in args.guesses.split(",") if k.strip()]
    except ValueError:
        parser.error(f"--guesses {args.guesses!r}: not a comma-separated list of integers")
    if not guesses or any(not 0 < k <= h.n_experts for k in guesses):
        parser.error(f"--guesses {args.guesses!r}: each between 1 and the {h.n_experts} experts of a layer")
    result = {"heldout": str(args.heldout), "tuning": str(args.tuning), "model": h.model,
              "layers": h.n_moe_layers, "experts": h.n_experts, "top_k": h.top_k,
              **study(steps_of(tuning.events), steps_of(heldout.events), h.n_moe_layers, h.n_experts, guesses,
                      args.reuse_weight)}
    print(f"{h.model}: {h.n_moe_layers} layers x {h.n_experts} experts, top-{h.top_k}")
    print(f"  top expert's share of a layer: {result['top_expert_share']['min']}-{result['top_expert_share']['max']}")
    print(f"  next-token reuse: {result['p_reuse']} (independent tokens: {result['p_reuse_if_independent']})")
    print("  recall of layer l+1's experts: guesses | chance | popularity | reuse | layer affinity | affinity + reuse")
    for k, r in result["guesses"].items():
        print(f"  {k} | {r['chance']} | {r['popularity']} | {r['reuse']} | {r['layer_affinity']} | "
              f"{r['layer_affinity_and_reuse']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
