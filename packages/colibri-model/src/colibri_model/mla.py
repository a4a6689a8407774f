"""Multi-head latent attention (MLA, DeepSeek-V2/V3): `attention_kind = "mla"` in ColibriConfig.

Shapes (B batch, T new tokens, S cached + new positions, H heads, r = kv_lora_rank):

    q     = q_proj(x)                          or  q_b_proj(norm(q_a_proj(x)))     [B, T, H, nope + rope]
    c, kr = kv_a_proj_with_mqa(x)              -> [B, T, r], [B, T, rope]  (kr: one head)
    kn, v = kv_b_proj(kv_a_layernorm(c))       -> [B, T, H, nope], [B, T, H, v_head_dim]
    k     = [kn, rope(kr) for every head];  q = [q_nope, rope(q_rope)]
    out   = o_proj(softmax(q k^T * scale) v),  scale = (nope + rope)^-0.5 * yarn's softmax_scale_factor

Only the last `qk_rope_head_dim` dims carry position (RoPE, interleaved pairs when
`rope_interleave`); the first `qk_nope_head_dim` dims of a key come from the latent alone.

Two ways to compute the same thing, chosen per pass by counted FLOPs (mla_cost.py; `form`
forces one), and either way the cache holds only the LATENT, one "head" of
`[kv_a_layernorm(c), rope(kr)]` (r + rope numbers per layer and position,
`ColibriConfig.kv_cache_heads` / `key_head_dim`; no values):
- decompressed: the keys and values of every position the pass attends (the cached latents and
  the new ones) are decompressed per head, as written above. The cheaper form when most positions
  are new: training, a whole prompt, the first chunks of a chunked prefill;
- absorbed: kv_b_proj is absorbed instead of applied to every cached position: with kv_b_proj =
  per head [W_k (nope x r); W_v (v x r)], `q_nope . kn = (q_nope W_k) . c`, so the query becomes
  `[q_nope W_k, rope(q_rope)]` (r + rope wide), one attention over the latent (multi-query: every
  head reads the same cached row, so the heads fold into the query axis) gives `softmax(.) c` per head, and `W_v` maps it to the value
  width. The cheaper form when the past dominates: decode steps, late prefill chunks.
At DeepSeek-V3's shapes the cache takes 576 numbers per layer and position instead of the
128 x (192 + 128) = 40,960 of decompressed keys and values (71x less), and an absorbed decode step
reads the latent once. The price of absorbing: attention over r + rope = 576 dims instead of 192,
~3x the attention FLOPs; decompressing instead costs kv_b_proj over all S latents of the pass.

The module and parameter names are DeepSeek's own (`q_a_layernorm`, `kv_a_proj_with_mqa`, ...),
so a checkpoint maps by prefix. The two latent RMSNorms use eps 1e-6 whatever `norm_eps` is:
transformers builds them with the RMSNorm default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention_rules import attention_allowed
from .config import ColibriConfig
from .layers import KVCache, RMSNorm, RotaryEmbedding
from .mla_cost import MLA_FORMS, cheaper_mla_form

LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    """MLA with the forward signature of `Attention`: (x [B, T, d], positions, cache, attention_mask).

    `form`: "auto" (the cheaper form per pass, mla_cost.py), or "absorbed" / "decompressed" to
    force one (tests, benchmarks); the outputs agree to rounding either way."""

    form = "auto"

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
        """`positions` [T] or [B, T]; `attention_mask` (optional) [B, S] (True where a key may be
        attended: a padded batch masks its padding) or [B, T, S] per query (packed sequences), as
        for `Attention`; causality is always applied."""
        B, T, _ = x.shape
        H = self.n_heads
        q = self._queries(x).view(B, T, H, self.nope + self.rope_dim).transpose(1, 2)  # [B, H, T, Dq]
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q_rope = self.rope(q_rope, positions)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rope = self.rope(k_rope.view(B, 1, T, self.rope_dim), positions)  # one rope key shared by all heads
        rows = torch.cat([latent.view(B, 1, T, self.kv_rank), k_rope], dim=-1)  # [B, 1, T, r + rope]
        past = 0
        if cache is not None:  # only the latent is cached, whichever form computes this pass
            past = cache.length
            rows, _ = cache.update(self.layer_index, rows, rows[..., :0])  # [B, 1, S, r + rope]; no values
            if cache.first_column(self.layer_index):  # only sliding-window layers drop columns
                raise ValueError(f"layer {self.layer_index}: an MLA layer needs every cached column")
        if self.form_for(T, past + T) == "decompressed":
            out = self._decompressed(q_nope, q_rope, rows, past, attention_mask)
        else:
            out = self._absorbed(q_nope, q_rope, rows, past, attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * self.v_dim))  # out: [B, H, T, v]

    def form_for(self, new_tokens: int, keys: int) -> str:
        """The form of a pass of `new_tokens` queries over `keys` positions: `self.form` when forced,
        else the one with fewer FLOPs (cheaper_mla_form)."""
        if self.form not in MLA_FORMS:
            raise ValueError(f"MultiHeadLatentAttention.form: {self.form!r} is not one of {', '.join(MLA_FORMS)}")
        if self.form != "auto":
            return self.form
        return cheaper_mla_form(new_tokens, keys, self.n_heads, self.kv_rank, self.nope, self.rope_dim, self.v_dim)

    def _decompressed(self, q_nope, q_rope, rows, past: int, attention_mask) -> torch.Tensor:
        """rows [B, 1, S, r + rope] (latent, rope key) -> [B, H, T, v], every key decompressed."""
        B, H, S = q_nope.shape[0], q_nope.shape[1], rows.shape[2]
        latent, k_rope = rows[:, 0, :, : self.kv_rank], rows[..., self.kv_rank:]  # [B, S, r], [B, 1, S, rope]
        kv = self.kv_b_proj(latent).view(B, S, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, H, S, self.rope_dim)], dim=-1)
        return self._attend(q, k, v, past, attention_mask)

    def _absorbed(self, q_nope, q_rope, rows, past: int, attention_mask) -> torch.Tensor:
        """rows [B, 1, S, r + rope] -> [B, H, T, v], attending the latent rows themselves."""
        H = q_nope.shape[1]
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.kv_rank)
        w_k, w_v = w[:, : self.nope], w[:, self.nope:]  # [H, nope, r], [H, v, r]
        q = torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w_k), q_rope], dim=-1)  # [B, H, T, r + rope]
        out = self._attend_shared_key(q, rows, past, attention_mask)  # [B, H, T, r]
        return torch.einsum("bhtr,hvr->bhtv", out, w_v)

    def _attend(self, q, k, v, past: int, attention_mask) -> torch.Tensor:
        B, T, S = q.shape[0], q.shape[2], k.shape[2]
        if past == 0 and attention_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        # the one masking rule of both attentions (attention_rules.attention_allowed): causal on cache
        # columns, ANDed with a [B, S] key mask or a [B, T, S] per-query mask
        allowed = attention_allowed(B, T, past, S, attention_mask, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)

    def _attend_shared_key(self, q, rows, past: int, attention_mask) -> torch.Tensor:
        """q [B, H, T, r + rope] over the one latent "head" rows [B, 1, S, r + rope] -> [B, H, T, r].
        Every head reads the same keys, so the heads fold into the query axis (row h T + t): one
        [H T, r + rope] x [r + rope, S] product per batch row instead of SDPA's enable_gqa, which
        on CPU expands the keys to every head (measured at V2-Lite's shapes, S 1024, one thread:
        a decode step 36 ms -> 0.7 ms, a 128-token chunk 90 -> 52 ms); the mask repeats per head."""
        B, H, T, D = q.shape
        S = rows.shape[2]
        allowed = attention_allowed(B, T, past, S, attention_mask, q.device)  # [T, S] or [B, 1, T, S]
        allowed = allowed.repeat(H, 1) if allowed.dim() == 2 else allowed.repeat(1, 1, H, 1)
        out = F.scaled_dot_product_attention(q.reshape(B, 1, H * T, D), rows, rows[..., : self.kv_rank],
                                             attn_mask=allowed, scale=self.scale)
        return out.view(B, H, T, self.kv_rank)
