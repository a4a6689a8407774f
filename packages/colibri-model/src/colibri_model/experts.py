"""Routed experts behind a small backend interface.

An `ExpertBackend` maps tokens, the experts each token chose and the gate weights to the
weighted sum of those experts' SwiGLU outputs. The MoE layer does not care where the weights
live: `GroupedExperts` holds them as stacked trainable parameters; colibri-stream supplies a
backend that streams int4 experts from disk through a RAM-budgeted cache.

`GroupedExperts.forward` sorts the (token, slot) pairs by expert and runs each projection as
ONE grouped matmul over contiguous per-expert row groups (dropless: no capacity factor, no token
is ever dropped; the op and its backward are in grouped_mm.py). `reference_forward` is the slow,
readable per-expert loop it is tested against (and the fallback when a torch build has no
`_grouped_mm`). bench/moe_layer.py measures both against a dense SwiGLU of equal active FLOPs.

Precision: the weights are fp32 masters; the matmuls run in the compute dtype, which is
autocast's dtype when autocast is on (bf16 on CUDA, where `_grouped_mm`'s fast kernel is
bf16-only) and else the activations' dtype. The weights are cast to it, never the activations to
the weights' fp32. Gates multiply and the top-k outputs sum in fp32.

Variants (ColibriConfig, schema 1.2, GPT-OSS): `ExpertGlu` is the one definition of the
activation between the projections (SwiGLU, or the clamped SwiGLU), and `bias=True` adds a bias
to each of gate, up and down per expert. colibri-stream's streamed experts call the same
`ExpertGlu`, so both packages compute one activation.

Sync-free: the expert counts come from a scatter-add on the device (not `bincount`, whose
output length needs the host to read the largest id), so a block compiles as one graph with
`fullgraph=True` and forward/backward never wait for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .grouped_mm import grouped_linear, has_grouped_mm, warn_if_slow_grouped_mm


@dataclass(frozen=True)
class ExpertGlu:
    """The gated activation `hidden = act(gate, up)` of a routed expert (CHECKPOINT.md).

    - "swiglu": `silu(gate) * up`.
    - "clamped_swiglu" (GPT-OSS): `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
      `g * sigmoid(alpha * g) * (u + 1)`. The clamp bounds what a bf16 checkpoint trained with it
      can produce; the `+ 1` means an up projection of 0 passes the gate through.

    Computed in the inputs' dtype, like the matmuls around it.
    """

    kind: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def from_config(cls, config) -> ExpertGlu:
        return cls(config.expert_glu, config.glu_alpha, config.glu_limit)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


SWIGLU = ExpertGlu()


class ExpertBackend(nn.Module):
    """Interface: `forward(x [N, d], expert_ids [N, k], gates [N, k]) -> [N, d]`."""

    n_experts: int

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on `x` run in: autocast's when it is on for x's device, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def count_per_expert(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """int64 [n_experts]: how many of the (token, slot) pairs chose each expert, on the device."""
    flat = expert_ids.flatten()
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def sort_by_expert(expert_ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the flattened (token, slot) pairs by expert.

    Returns (order, token_index, counts): `order` permutes the N*k slots so that equal experts
    are contiguous (stable, so the result is deterministic), `token_index` is the token each
    sorted slot belongs to, `counts[e]` the rows of expert e.
    """
    order = torch.argsort(expert_ids.flatten(), stable=True)
    token_index = order // expert_ids.shape[1]
    return order, token_index, count_per_expert(expert_ids, n_experts)


class GroupedExperts(ExpertBackend):
    """Stacked expert weights (names and layouts as in CHECKPOINT.md); with `bias`, also
    `gate_bias`, `up_bias` `[n_experts, expert_dim]` and `down_bias` `[n_experts, d_model]`."""

    def __init__(self, n_experts: int, d_model: int, expert_dim: int, glu: ExpertGlu = SWIGLU, bias: bool = False):
        super().__init__()
        self.n_experts, self.d_model, self.expert_dim = n_experts, d_model, expert_dim
        self.glu = glu
        self.gate_proj = nn.Parameter(torch.empty(n_experts, expert_dim, d_model))
        self.up_proj = nn.Parameter(torch.empty(n_experts, expert_dim, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, expert_dim))
        if bias:
            self.gate_bias = nn.Parameter(torch.empty(n_experts, expert_dim))
            self.up_bias = nn.Parameter(torch.empty(n_experts, expert_dim))
            self.down_bias = nn.Parameter(torch.empty(n_experts, d_model))
        else:
            self.gate_bias = self.up_bias = self.down_bias = None
        self.use_grouped_mm = has_grouped_mm()
        if not self.use_grouped_mm:
            warn_if_slow_grouped_mm("cpu", torch.float32)  # the one warning: no _grouped_mm at all

    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.gate_proj, std=std)
        nn.init.normal_(self.up_proj, std=std)
        nn.init.normal_(self.down_proj, std=out_std)
        for bias in (self.gate_bias, self.up_bias, self.down_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        if not self.use_grouped_mm:
            return self.reference_forward(x, expert_ids, gates)
        order, token_index, counts = sort_by_expert(expert_ids, self.n_experts)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        dtype = compute_dtype(x)
        xs = x.index_select(0, token_index).to(dtype)  # [N*k, d], rows grouped by expert
        gate = grouped_linear(xs, self.gate_proj, offsets)
        up = grouped_linear(xs, self.up_proj, offsets)
        if self.gate_bias is not None:  # each sorted row gets its own expert's bias
            row_expert = expert_ids.flatten().index_select(0, order)
            gate = gate + self.gate_bias.index_select(0, row_expert).to(dtype)
            up = up + self.up_bias.index_select(0, row_expert).to(dtype)
        hidden = self.glu(gate, up)
        out_sorted = grouped_linear(hidden, self.down_proj, offsets)
        if self.down_bias is not None:
            out_sorted = out_sorted + self.down_bias.index_select(0, row_expert).to(dtype)
        weighted = out_sorted.float() * gates.flatten().index_select(0, order).unsqueeze(-1).float()
        out = torch.zeros(x.shape[0], self.d_model, dtype=torch.float32, device=x.device)
        out.index_add_(0, token_index, weighted)
        return out.to(x.dtype)

    def reference_forward(self, x: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """One expert at a time, by mask: slow and obviously right (same dtypes as `forward`)."""
        dtype = compute_dtype(x)
        out = torch.zeros(x.shape[0], self.d_model, dtype=torch.float32, device=x.device)
        for e in range(self.n_experts):
            tokens, slots = torch.nonzero(expert_ids == e, as_tuple=True)
            if tokens.numel() == 0:
                continue
            xe = x[tokens].to(dtype)
            gate_w, up_w, down_w = (w[e].to(dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
            gate, up = xe @ gate_w.T, xe @ up_w.T
            if self.gate_bias is not None:
                gate, up = gate + self.gate_bias[e].to(dtype), up + self.up_bias[e].to(dtype)
            ye = self.glu(gate, up) @ down_w.T
            if self.down_bias is not None:
                ye = ye + self.down_bias[e].to(dtype)
            ye = ye.float() * gates[tokens, slots].unsqueeze(-1).float()
            out.index_add_(0, tokens, ye)
        return out.to(x.dtype)
