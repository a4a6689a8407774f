"""Multi-head latent attention (MLA, DeepSeek-V2/V3): `attention_kind = "mla"` in ColibriConfig.

Shapes (B batch, T new tokens, S cached + new positions, H heads, r the latent ranks):

    q     = q_proj(x)                          or  q_b_proj(norm(q_a_proj(x)))     [B, T, H, nope + rope]
    c, kr = kv_a_proj_with_mqa(x)              -> [B, T, kv_lora_rank], [B, T, rope]  (kr: one head)
    kn, v = kv_b_proj(kv_a_layernorm(c))       -> [B, T, H, nope], [B, T, H, v_head_dim]
    k     = [kn, rope(kr) for every head];  q = [q_nope, rope(q_rope)]
    out   = o_proj(softmax(q k^T * scale) v),  scale = (nope + rope)^-0.5 * yarn's softmax_scale_factor

Only the last `qk_rope_head_dim` dims carry position (RoPE, interleaved pairs when
`rope_interleave`); the first `qk_nope_head_dim` dims of a key come from the latent alone.

The KV cache holds the DECOMPRESSED per-head keys ([.., H, S, nope + rope]) and values
([.., H, S, v_head_dim]), exactly the layout of a GQA cache with n_kv_heads = n_heads, so
`KVCache`, colibri-stream's SessionKV and every KV size (`ColibriConfig.kv_bytes_per_position`)
work unchanged. It costs H * (nope + rope + v) numbers per layer and position, against
kv_lora_rank + rope for the latent: 40,960 vs 576 at DeepSeek-V3's sizes, 71x. The next step is
the latent cache (store c and rope(kr), absorb kv_b_proj into q and o_proj at decode): that is
MLA's memory win, and it changes the cache's interface, not this module's math.

The module and parameter names are DeepSeek's own (`q_a_layernorm`, `kv_a_proj_with_mqa`, ...),
so a checkpoint maps by prefix. The two latent RMSNorms use eps 1e-6 whatever `norm_eps` is:
transformers builds them with the RMSNorm default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ColibriConfig
from .layers import KVCache, RMSNorm, RotaryEmbedding

LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    """MLA with the forward signature of `Attention`: (x [B, T, d], positions, cache, attention_mask)."""

    def __init__(self, config: ColibriConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.n_heads = config.n_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        d, q_dim = config.d_model, config.n_heads * config.head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, d, bias=False)
        scaling = config.rope_scaling
        self.rope = RotaryEmbedding(self.rope_dim, config.rope_theta, config.max_seq_len, scaling,
                                    config.rope_interleave)
        self.scale = config.head_dim ** -0.5 * (1.0 if scaling is None else scaling.softmax_scale_factor)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`attention_mask` [B, S] (optional): True where a key position may be attended (a padded
        batch masks its padding); causality is always applied."""
        B, T, _ = x.shape
        H = self.n_heads
        q = self._queries(x).view(B, T, H, self.nope + self.rope_dim).transpose(1, 2)  # [B, H, T, Dq]
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = self.rope(k_rope.view(B, 1, T, self.rope_dim), positions)  # one rope key shared by all heads
        q = torch.cat([q_nope, self.rope(q_rope, positions)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, H, T, self.rope_dim)], dim=-1)

        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.update(self.layer_index, k, v)
        if past == 0 and attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            S = k.shape[2]
            allowed = torch.arange(S, device=x.device)[None, :] <= (past + torch.arange(T, device=x.device))[:, None]
            if attention_mask is not None:  # [B, S] keys -> [B, 1, T, S]
                allowed = allowed[None, None] & attention_mask[:, None, None, :S].bool()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * self.v_dim))
