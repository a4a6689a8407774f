"""One decode token of one session with less torch glue: colibri-model's grouped-query attention
(`NativeDecodeAttention`) and RMSNorm (`NativeRowNorm`) with a fast path for that case.

A decode step of a 24-layer MoE spent about as long in the torch calls around attention (view,
transpose, two RMSNorms and two rotations of one row, the cache write, a [1, S] mask, SDPA: a
dozen dispatches and allocations per layer) as in the attention's four projections themselves.
For one query row of one session, q and k are normed and rotated by one C call each
(compute/native/decode_step.c), and the newest position sees every cached column, so SDPA runs
unmasked; the projections stay the native kernel's. A layer's input norms of one row (about ten
torch dispatches each) are one C call.

Every other case runs colibri-model's own forward, unchanged: batches, prefill chunks, masks,
sliding windows, sinks, an OLMoE-style norm over the whole projection, interleaved rotary, a
non-f32 engine. The C paths equal that forward to float rounding (sums in another order), tested
against it (tests/test_native_decode.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from colibri_model import Attention, ColibriConfig, RMSNorm

from .native_kernel import MAX_HEAD_DIM, norm_rope, rms_norm


def decode_attention_supported(config: ColibriConfig) -> bool:
    """Whether this config's attention layers have the decode fast path (the rest never change)."""
    return (config.attention_kind == "gqa" and not config.attn_sinks and not config.rope_interleave
            and not (config.qk_norm and config.qk_norm_scope == "projection")
            and config.head_dim % 8 == 0 and config.head_dim <= MAX_HEAD_DIM)


class NativeDecodeAttention(Attention):
    """An `Attention` whose one decode token of one session skips the torch glue (module docstring)."""

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


class NativeRowNorm(RMSNorm):
    """An `RMSNorm` whose one f32 row [1, 1, D] (a decode token's layer input) is one C call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != 1 or x.dtype != torch.float32 \
                or self.weight.dtype != torch.float32 or x.shape[2] % 8:
            return super().forward(x)
        return rms_norm(x.reshape(-1).contiguous(), self).view(x.shape)


def install_decode_paths(model: torch.nn.Module, config: ColibriConfig) -> int:
    """Give `model`'s attention layers (where its config has the path) and RMSNorms the decode fast
    paths; returns how many modules took one. Same parameters, same names: only the class of each
    module changes."""
    count = 0
    attention = decode_attention_supported(config)
    for module in model.modules():
        if attention and type(module) is Attention:
            module.__class__ = NativeDecodeAttention
            count += 1
        elif type(module) is RMSNorm:
            module.__class__ = NativeRowNorm
            count += 1
    return count
