"""The outer step of a DiLoCo round: the mean of the workers' pseudo-gradients, then Nesterov SGD.

    g     = mean over workers of (base - local)          per tensor; experts: see below
    buf   = g                     (first round)          torch.optim.SGD(nesterov=True) semantics,
    buf   = momentum * buf + g    (later rounds)         dampening 0, as torchft's DiLoCo uses it
    base' = base - lr * (g + momentum * buf)

Defaults lr 0.7, momentum 0.9 (DiLoCo). The momentum buffer is part of the base (the repo's
`outer_momentum.safetensors`), so any merger continues the same outer optimizer. Everything is
fp32, in fixed slot order, with the same tensor ops as torch.optim.SGD: the result equals
SGD's bit for bit on CPU (tests/test_parallel_rounds.py).

MoE parts, which are not ordinary gradients:
* routed experts a worker never routed a token to in the round moved only by weight decay on that
  worker: its pseudo-gradient for that expert is left out, the expert's mean is over the workers
  that routed to it, and an expert nobody routed to gets g = 0 (its momentum still decays it on);
* the router's expert biases move by sign steps (balancing), not by gradients: the new bias is
  the plain mean of the workers' biases (no outer lr, no momentum, which would overshoot);
* token counts per expert (summed over workers) give the round's MaxVio and dead experts.
"""

from __future__ import annotations

import re

import torch

_EXPERTS = re.compile(r"^(.*\.moe)\.experts\.")
COUNTS_SUFFIX = ".router.tokens_per_expert"
BIAS_SUFFIX = ".router.expert_bias"


def moe_prefix(name: str) -> str | None:
    """`layers.3.moe` for a routed expert tensor (first dim = experts), else None."""
    m = _EXPERTS.match(name)
    return m.group(1) if m else None


def mean_pseudograd(deltas: list[dict[str, torch.Tensor]], counts: list[dict[str, torch.Tensor]]
                    ) -> dict[str, torch.Tensor]:
    """The mean over workers (slot order). `counts[w][f"{prefix}.router.tokens_per_expert"]` says which
    experts worker w routed to; an expert's mean is over those workers only (0 if none)."""
    out = {}
    for name in deltas[0]:
        stack = torch.stack([d[name] for d in deltas])  # [W, ...]
        prefix = moe_prefix(name)
        key = None if prefix is None else prefix + COUNTS_SUFFIX
        if key is None or any(key not in c for c in counts):
            out[name] = stack.mean(dim=0)
            continue
        routed = torch.stack([(c[key] > 0).to(torch.float32) for c in counts])  # [W, E]
        mask = routed.view(*routed.shape, *([1] * (stack.dim() - 2)))
        n = routed.sum(dim=0).clamp(min=1).view(-1, *([1] * (stack.dim() - 2)))
        out[name] = (stack * mask).sum(dim=0) / n
    return out


def nesterov_step(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                  momentum: dict[str, torch.Tensor] | None, *, lr: float, mu: float
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(new params, new momentum buffers) for the tensors in `grads`; the inputs are not changed."""
    new_params, new_buf = {}, {}
    for name, g in grads.items():
        if momentum is not None and name in momentum:
            buf = momentum[name].clone().mul_(mu).add_(g)
        else:
            buf = g.clone()
        update = g.add(buf, alpha=mu)
        new_params[name] = params[name].clone().add_(update, alpha=-lr)
        new_buf[name] = buf
    return new_params, new_buf


def merged_biases(biases: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Expert biases: the plain mean of the workers' (slot order)."""
    return {name: torch.stack([b[name] for b in biases]).mean(dim=0) for name in biases[0]}


def balance_report(counts: list[dict[str, torch.Tensor]]) -> dict:
    """MaxVio (max load / mean load - 1) and dead experts per MoE layer over the round's tokens, all
    workers summed."""
    layers = {}
    for key in sorted(counts[0]):
        total = torch.stack([c[key] for c in counts]).sum(dim=0)
        mean = float(total.mean())
        layers[key[: -len(COUNTS_SUFFIX)]] = {
            "max_vio": round(float(total.max()) / mean - 1.0, 5) if mean > 0 else 0.0,
            "dead_experts": int((total == 0).sum()),
        }
    worst = max((v["max_vio"] for v in layers.values()), default=0.0)
    dead = sum(v["dead_experts"] for v in layers.values())
    return {"max_vio": worst, "dead_experts": dead, "layers": layers}
