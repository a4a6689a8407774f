"""Routing traces of Hugging Face transformers MoE models (OLMoE, Mixtral, Qwen-MoE, DeepSeek-V3,
GPT-OSS, Granite-MoE, ...), for `colibri-stream policy-study`.

Why: a cache policy should be judged on a real trained MoE's routing, and the models worth
judging on (the issue's reference is OLMoE) are too big to serve through our engine in a test.
Their routing is all the policy study needs. transformers >= 5 gives every MoE router one
contract, `forward(hidden) -> (router_logits, weights, indices)` with `indices` of shape
[tokens, top_k], so one forward hook per router records exactly the experts the model used,
group-limited and bias-corrected routers included (the hook reads the router's own choice
rather than recomputing it from logits).

Each token is its own step, the access pattern of decoding that text one token at a time.
A whole passage runs as one causal forward pass: with causal attention a token's hidden
states, hence its routing, are the same as in token-by-token decoding with a KV cache (up to
floating-point summation order), and one pass is far faster.

transformers is not a dependency of colibri-stream: install it (`pip install
'colibri-stream[hf]'`) to use this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..errors import NoRouterError
from .events import TraceEvent

_LAYER_INDEX = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


@dataclass(frozen=True)
class RouterSite:
    name: str
    layer: int
    n_experts: int
    module: torch.nn.Module


def find_routers(model: torch.nn.Module) -> list[RouterSite]:
    """The MoE routers of a transformers model, by block index: modules whose class name says
    Router and that know their expert count (every router class of transformers 5 does)."""
    sites = []
    for name, module in model.named_modules():
        if "router" not in type(module).__name__.lower():
            continue
        n_experts = getattr(module, "num_experts", None)
        if n_experts is None and isinstance(getattr(module, "weight", None), torch.Tensor):
            n_experts = module.weight.shape[0]
        match = _LAYER_INDEX.search(name)
        if n_experts is None or match is None:
            continue
        sites.append(RouterSite(name, int(match.group(1)), int(n_experts), module))
    if not sites:
        raise NoRouterError(
            f"found no MoE router in {type(model).__name__}: expected modules named *Router whose forward returns "
            "(logits, weights, indices), as transformers >= 5 writes them"
        )
    layers = [s.layer for s in sites]
    if len(set(layers)) != len(layers):
        raise NoRouterError(f"{type(model).__name__} has several routers in one layer ({layers}); not supported")
    if len({s.n_experts for s in sites}) != 1:
        raise NoRouterError("the routers disagree on the number of experts; not supported")
    return sorted(sites, key=lambda s: s.layer)


@dataclass(frozen=True)
class HFTrace:
    events: list[TraceEvent]
    n_moe_layers: int
    n_experts: int
    top_k: int
    tokens: int


def record_routing(model: torch.nn.Module, sequences: Iterable[Sequence[int]]) -> HFTrace:
    """Run each token sequence through `model` (one causal forward pass each) and return the
    routing: for every token (one step) and MoE layer, the experts its router selected."""
    sites = find_routers(model)
    captured: dict[int, torch.Tensor] = {}

    def hook_for(site: RouterSite):
        def hook(module, args, output):
            indices = output[2] if isinstance(output, tuple) and len(output) == 3 else None
            if not isinstance(indices, torch.Tensor) or indices.is_floating_point():
                raise NoRouterError(f"{site.name} returned {type(output).__name__}, not (logits, weights, indices)")
            captured[site.layer] = indices.detach().reshape(-1, indices.shape[-1]).cpu()

        return hook

    # where the token ids must go: the embedding's device (also right for a model spread over
    # devices by accelerate's device_map)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    device = embeddings.weight.device if embeddings is not None else torch.device("cpu")
    handles = [s.module.register_forward_hook(hook_for(s)) for s in sites]
    events: list[TraceEvent] = []
    step = top_k = 0
    try:
        with torch.inference_mode():
            for ids in sequences:
                ids = list(ids)
                if not ids:
                    continue
                captured.clear()
                model(input_ids=torch.tensor([ids], dtype=torch.long, device=device), use_cache=False)
                missing = [s.name for s in sites if s.layer not in captured]
                if missing:
                    raise NoRouterError(f"routers {missing} did not run in the forward pass")
                top_k = captured[sites[0].layer].shape[1]
                for t in range(len(ids)):
                    for site in sites:
                        # a batched MoE computes each distinct expert once, in index order
                        experts = tuple(sorted(set(captured[site.layer][t].tolist())))
                        events.append(TraceEvent(step, site.layer, experts))
                    step += 1
    finally:
        for handle in handles:
            handle.remove()
    return HFTrace(events, len(sites), sites[0].n_experts, top_k, step)


def token_windows(token_ids: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive windows of at most `max_tokens` tokens (each becomes one forward pass)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return [list(token_ids[i : i + max_tokens]) for i in range(0, len(token_ids), max_tokens)]
