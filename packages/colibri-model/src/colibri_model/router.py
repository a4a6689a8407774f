"""The DeepSeek-V3-style router and its load statistics.

- scores `s = sigmoid(x W_r^T)`, in fp32;
- a per-expert `expert_bias` is added to the scores ONLY to choose the top-k; it never scales an
  output, so it carries no gradient and can be nudged freely by the balancer (balancing.py);
- gate weights are the chosen raw scores, divided by their sum (route_norm), times route_scale.

Imported checkpoints configure the same router differently (ColibriConfig): `router_score =
"softmax"` scores with a softmax over all experts (fp32, Qwen-MoE / OLMoE / Mixtral), and
`selection_bias = False` removes the bias (those routers were trained without one). Mixtral's
"softmax over the top-k logits" is the same as softmax over all, top-k, renormalised
(route_norm): the softmax's denominator cancels. GPT-OSS's router adds a trained bias to its
logits before that softmax (`router_bias`, a parameter `bias`, unlike the selection bias).

DeepSeek's group-limited routing is configuration too (`router_groups > 1`, `limit_to_groups`):
only experts of the best `router_topk_groups` groups may be chosen; the gates are unchanged.

NOTE: with route_norm at top_k=1 the gate is s/s = 1 for every token, so the LM loss sends the
router no gradient at all: the router only learns at top_k >= 2. That is NanoColibri's lesson
(train at top-2, serve at top-1) and a regression test. The normalisation runs in fp64 so that
this zero is exact to ~1e-16 instead of fp32 rounding noise (it touches only N x k numbers).

The router counts tokens per expert in a buffer that the balancer reads and resets after each
optimizer step, so the count covers the whole accumulated batch. The count is a scatter-add on
the device (no `bincount`, whose output length needs a host read), so routing never syncs.

NOTE: autocast would recast `F.linear(x.float(), w.float())` to bf16, whose step near 0.5
(~0.004) exceeds the balancing step gamma=1e-3: the scores are computed with autocast disabled,
as torchtitan does, so routing decisions and gates stay fp32 under bf16 training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ColibriConfig
from .experts import count_per_expert


class Router(nn.Module):
    def __init__(self, config: ColibriConfig):
        super().__init__()
        self.n_experts = config.n_experts
        self.route_norm = config.route_norm
        self.route_scale = config.route_scale
        self.score = config.router_score
        self.groups, self.topk_groups, self.group_score = (
            config.router_groups, config.router_topk_groups, config.router_group_score)
        self.weight = nn.Parameter(torch.empty(config.n_experts, config.d_model))
        self.bias = nn.Parameter(torch.zeros(config.n_experts)) if config.router_bias else None
        # Persistent: the bias is part of the trained model (it decides routing at inference).
        bias = torch.zeros(config.n_experts, dtype=torch.float32) if config.selection_bias else None
        self.register_buffer("expert_bias", bias)
        # Not persistent: a running count since the last balancer step.
        self.register_buffer(
            "tokens_per_expert", torch.zeros(config.n_experts, dtype=torch.float32), persistent=False
        )
        self.count_tokens = True

    def forward(self, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, d]. Returns (expert_ids [N, k] int64, gates [N, k] in x's dtype, scores [N, E] fp32)."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
            scores = torch.sigmoid(logits) if self.score == "sigmoid" else torch.softmax(logits, dim=-1)
            choice = scores.detach() if self.expert_bias is None else scores.detach() + self.expert_bias.float()
            if self.groups > 1:
                choice = limit_to_groups(choice, self.groups, self.topk_groups, self.group_score)
            _, expert_ids = torch.topk(choice, top_k, dim=-1)
            chosen = scores.gather(-1, expert_ids)
            if self.route_norm:
                chosen64 = chosen.double()
                chosen = (chosen64 / chosen64.sum(-1, keepdim=True)).float()
            gates = chosen * self.route_scale
        if self.count_tokens:
            with torch.no_grad():
                self.tokens_per_expert += count_per_expert(expert_ids, self.n_experts).float()
        return expert_ids, gates.to(x.dtype), scores


def limit_to_groups(choice: torch.Tensor, groups: int, topk_groups: int, group_score: str) -> torch.Tensor:
    """Group-limited selection (DeepSeek): `choice` [N, E] with every expert outside the best
    `topk_groups` of `groups` equal groups set to -inf. A group scores the sum of its two best
    selection scores ("top2_sum", V3) or its best one ("max", V2)."""
    n, n_experts = choice.shape
    grouped = choice.view(n, groups, n_experts // groups)
    if group_score == "top2_sum":
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    else:
        group_scores = grouped.amax(-1)
    best = group_scores.topk(topk_groups, dim=-1).indices  # [N, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(n, n_experts)


def sequence_aux_loss(scores: torch.Tensor, expert_ids: torch.Tensor, batch: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (before multiplying by alpha).

    For each sequence: sum_i f_i * P_i, with f_i = E / (k T) * (tokens choosing i) and P_i the
    mean over its tokens of s_i / sum_j s_j. Averaged over sequences.
    """
    n_tokens, n_experts = scores.shape
    seq_len = n_tokens // batch
    probs = (scores / scores.sum(-1, keepdim=True)).view(batch, seq_len, n_experts)
    counts = torch.zeros(batch, n_experts, device=scores.device)
    counts.scatter_add_(1, expert_ids.view(batch, -1), torch.ones(batch, seq_len * top_k, device=scores.device))
    f = counts * n_experts / (top_k * seq_len)
    return (f * probs.mean(1)).sum(-1).mean()


@dataclass
class RouterStats:
    """Load of one MoE layer over a counting window (e.g. one optimizer step)."""

    layer: int
    load: list[float]  # share of routed slots per expert, sums to 1
    max_vio: float  # max load / mean load - 1 (0 = perfectly balanced)
    dead_experts: int  # experts that received no token
    load_entropy: float  # entropy of the load share / log(E) (1 = uniform)

    @classmethod
    def from_counts(cls, layer: int, counts: torch.Tensor | list[float]) -> RouterStats:
        """From the per-expert token counts (a host tensor or list; plain Python math from here)."""
        counts = [float(c) for c in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
        total = sum(counts)
        n = len(counts)
        if total == 0:
            return cls(layer, [0.0] * n, 0.0, n, 0.0)
        share = [c / total for c in counts]
        entropy = -sum(p * math.log(p) for p in share if p > 0) / math.log(n) if n > 1 else 1.0
        return cls(
            layer=layer,
            load=[round(p, 6) for p in share],
            max_vio=max(counts) / (total / n) - 1.0,
            dead_experts=sum(c == 0 for c in counts),
            load_entropy=entropy,
        )
