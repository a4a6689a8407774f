"""The MoE feed-forward: router + routed experts (from any ExpertBackend) + shared expert.

Dropless token choice: every token goes to exactly top_k experts. Which top_k is used follows
the module's mode unless overridden: `top_k_train` in training, `top_k_infer` in eval mode
(serving a top-2-trained model at top-1); `set_top_k` pins it for experiments.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ColibriConfig
from .experts import ExpertBackend, ExpertGlu, GroupedExperts
from .layers import SwiGLU
from .router import Router, sequence_aux_loss


class MoELayer(nn.Module):
    def __init__(self, config: ColibriConfig, layer_index: int, experts: ExpertBackend | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.top_k_train, self.top_k_infer = config.top_k_train, config.top_k_infer
        self.top_k_override: int | None = None
        self.aux_loss_alpha = config.aux_loss_alpha
        self.router = Router(config)
        self.shared = SwiGLU(config.d_model, config.shared_expert_dim) if config.shared_expert_dim else None
        # Qwen2-MoE scales the shared expert per token by sigmoid(x . w): a [1, d] projection.
        gated = config.shared_expert_gate and self.shared is not None
        self.shared_gate = nn.Linear(config.d_model, 1, bias=False) if gated else None
        self.experts = experts if experts is not None else GroupedExperts(
            config.n_experts, config.d_model, config.expert_dim, ExpertGlu.from_config(config), config.expert_proj_bias
        )
        self.aux_loss: torch.Tensor | None = None
        self.last_expert_ids: torch.Tensor | None = None  # kept only when record_routing is on
        self.record_routing = False

    @property
    def top_k(self) -> int:
        if self.top_k_override is not None:
            return self.top_k_override
        return self.top_k_train if self.training else self.top_k_infer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        flat = x.reshape(B * T, d)
        k = self.top_k
        expert_ids, gates, scores = self.router(flat, k)
        if self.record_routing:
            self.last_expert_ids = expert_ids.detach().view(B, T, k)
        # The shared expert runs before the routed ones (same sum, same bits: one addition of
        # two tensors): a streaming backend's prefetcher reads its output through a forward hook
        # and predicts the next layer's experts from `h + shared(x)` while the routed experts
        # are fetched and computed (colibri-stream, prefetch.py).
        shared_out = self.shared(flat) if self.shared is not None else None
        if self.shared_gate is not None:
            shared_out = torch.sigmoid(self.shared_gate(flat)) * shared_out
        out = self.experts(flat, expert_ids, gates)
        if shared_out is not None:
            out = out + shared_out
        if self.training and self.aux_loss_alpha > 0:
            self.aux_loss = self.aux_loss_alpha * sequence_aux_loss(scores, expert_ids, B, k)
        else:
            self.aux_loss = None
        return out.view(B, T, d)
