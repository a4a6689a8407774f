"""Auxiliary-loss-free load balancing (DeepSeek-V3): nudge each expert's selection bias.

After each optimizer step, for every MoE layer:

    bias += gamma * sign(mean_load - load)

where `load` counts the tokens routed to each expert over the WHOLE accumulated batch. It runs
as an optimizer step pre-hook (as torchtitan does): micro-batches only add to the routers'
counters, and the update happens once per real optimizer step, however many micro-batches
gradient accumulation used. Under DDP the counts of all layers are all-reduced first, in ONE
all-reduce of an [n_layers, n_experts] tensor, so every rank applies the same update and the
biases stay identical.

Sync-free: the update runs on the device (no host read, no Python branch on a tensor); the
per-layer statistics (`last_stats`, read by the trainer at logging steps only) are built from the
step's counts on first access, with one device-to-host copy for all layers.
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
        self._handle = None
        self._last_counts: torch.Tensor | None = None  # [n_moe_layers, n_experts] of the last step
        self._last_stats: list[RouterStats] | None = None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        self._handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.step())

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def last_stats(self) -> list[RouterStats]:
        """RouterStats per MoE layer over the last step's counts (one host copy, on first access)."""
        if self._last_stats is None:
            if self._last_counts is None:
                return []
            counts = self._last_counts.tolist()  # [L][E]: the one host copy
            layers = self.model.moe_layers()
            self._last_stats = [RouterStats.from_counts(layer.layer_index, c) for layer, c in zip(layers, counts)]
        return self._last_stats

    @torch.no_grad()
    def step(self) -> None:
        layers = self.model.moe_layers()
        if not layers:
            return
        counts = torch.stack([layer.router.tokens_per_expert for layer in layers])  # [L, E]
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        if self.gamma > 0:
            # A layer that routed nothing (e.g. no token this step) keeps its bias: sign(0) = 0.
            routed = (counts.sum(dim=1, keepdim=True) > 0).to(counts.dtype)
            delta = self.gamma * torch.sign(counts.mean(dim=1, keepdim=True) - counts) * routed
            for layer, layer_delta in zip(layers, delta):
                if layer.router.expert_bias is not None:  # imported softmax routers have no bias
                    layer.router.expert_bias += layer_delta
        for layer in layers:
            layer.router.tokens_per_expert.zero_()
        self._last_counts, self._last_stats = counts, None
