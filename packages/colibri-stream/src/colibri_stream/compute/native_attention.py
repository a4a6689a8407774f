"""`NativeDecodeAttention`: colibri-model's grouped-query attention with the glue around one decode
token of one session cut down.

A decode step of a 24-layer MoE spent about as long in the torch calls around attention (view,
transpose, two RMSNorms and two rotations of one row, the cache write, a [1, S] mask, SDPA: a
dozen dispatches and allocations per layer) as in the attention's four projections themselves.
For one query row of one session, q and k are normed and rotated by one C call each
(compute/native/decode_step.c), and the newest position sees every cached column, so SDPA runs
unmasked; the projections stay the native kernel's.

Every other case runs colibri-model's own forward, unchanged: batches, prefill chunks, masks,
sliding windows, sinks, an OLMoE-style norm over the whole projection, interleaved rotary, a
non-f32 engine. The C path equals that forward to float rounding (sums in another order), tested
against it (tests/test_native_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from colibri_model import Attention, ColibriConfig

from .native_kernel import MAX_HEAD_DIM, norm_rope


def decode_attention_supported(config: ColibriConfig) -> bool:
    """Whether this config's attention layers have the C decode path (the rest never change)."""
    return (config.attention_kind == "gqa" and not config.attn_sinks and not config.rope_interleave
            and not (config.qk_norm and config.qk_norm_scope == "projection")
            and config.head_dim % 8 == 0 and config.head_dim <= MAX_HEAD_DIM)


class NativeDecodeAttention(Attention):
    """An `Attention` whose single-token, single-sequence decode runs in C; see the module docstring."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if (cache is None or attention_mask is not None or x.shape[0] != 1 or x.shape[1] != 1
                or x.dtype != torch.float32 or positions.dim() != 1 or self.window is not None):
            return super().forward(x, positions, cache, attention_mask)
        heads, kv_heads, dim = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).reshape(heads, dim).contiguous()
        k = self.k_proj(x).reshape(kv_heads, dim).contiguous()
        v = self.v_proj(x).reshape(1, kv_heads, 1, dim)
        cos, sin = self.rope.at(int(positions[0]), x.device)
        norm_rope(q, self.q_norm, cos, sin)
        norm_rope(k, self.k_norm, cos, sin)
        keys, values = cache.update(self.layer_index, k.view(1, kv_heads, 1, dim), v)
        # one query row at the newest position sees every cached column: no mask to build, and
        # SDPA's unmasked kernel (faster here than a C loop of ours, measured)
        out = F.scaled_dot_product_attention(q.view(1, heads, 1, dim), keys, values, enable_gqa=True)
        return self.o_proj(out.view(1, 1, heads * dim))


def install_decode_attention(model: torch.nn.Module, config: ColibriConfig) -> int:
    """Give every attention layer of `model` the C decode path, where its config has one; returns
    how many layers took it. Same parameters, same names: only the class of each module changes."""
    if not decode_attention_supported(config):
        return 0
    count = 0
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = NativeDecodeAttention
            count += 1
    return count
