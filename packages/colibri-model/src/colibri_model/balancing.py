"""Auxiliary-loss-free load balancing (DeepSeek-V3): nudge each expert's selection bias.

After each optimizer step, for every MoE layer:

    bias += gamma * sign(mean_load - load)

where `load` counts the tokens routed to each expert over the WHOLE accumulated batch. It runs
as an optimizer step pre-hook (as torchtitan does): micro-batches only add to the routers'
counters, and the update happens once per real optimizer step, however many micro-batches
gradient accumulation used. Under DDP the counts are all-reduced first, so every rank applies
the same update and the biases stay identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .router import RouterStats


class ExpertBiasBalancer:
    """Owns the bias update and the per-step router statistics.

    Example:
        >>> balancer = ExpertBiasBalancer(model)
        >>> balancer.attach(optimizer)          # updates biases before every optimizer.step()
        >>> stats = balancer.last_stats          # RouterStats per layer of the last step
    """

    def __init__(self, model, gamma: float | None = None):
        self.model = model
        self.gamma = model.config.bias_update_gamma if gamma is None else gamma
        self.last_stats: list[RouterStats] = []
        self._handle = None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        self._handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.step())

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @torch.no_grad()
    def step(self) -> None:
        layers = self.model.moe_layers()
        if not layers:
            return
        counts = torch.stack([layer.router.tokens_per_expert for layer in layers])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        self.last_stats = [RouterStats.from_counts(layer.layer_index, c.cpu()) for layer, c in zip(layers, counts)]
        for layer, load in zip(layers, counts):
            if load.sum() > 0 and self.gamma > 0 and layer.router.expert_bias is not None:
                layer.router.expert_bias += self.gamma * torch.sign(load.mean() - load)
            layer.router.tokens_per_expert.zero_()
