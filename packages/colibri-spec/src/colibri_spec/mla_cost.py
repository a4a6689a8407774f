"""Which of MLA's two forms (colibri_model.mla) is cheaper for one attention pass, by counted FLOPs.

A pass: T new tokens attending S = past + T key positions, H heads, r = kv_lora_rank, n / p / v =
qk_nope / qk_rope / v head dims. Counted per batch row as 2 x multiply-adds, only the steps that
differ between the forms (q_proj or q_a/q_b, kv_a_proj_with_mqa, the latent norm, RoPE and o_proj
are the same work in both; the softmax is T x S x H in both):

    absorbed      q_nope W_k (the query into the latent)      T H n r
                  scores over [latent, rope key]              T S H (r + p)
                  probabilities x latent                      T S H r
                  W_v (the latent output to the value width)  T H r v
    decompressed  kv_b_proj over every cached latent          S r H (n + v)
                  scores over [k_nope, rope key]              T S H (n + p)
                  probabilities x values                      T S H v

The counts are for the whole T x S score matrix, which is what SDPA computes under an explicit
mask (a pass through the cache); the causal half it may skip without one is the same fraction of
both forms' scores. Removing the common terms, decompressed is cheaper exactly when
`past * r * (n + v) < T * S * (2r - n - v)`: a fresh prompt (past = 0) always decompresses when
2r > n + v (every DeepSeek config), a decode step (T = 1) over a past always absorbs, and a chunked
prefill decompresses while its past is short against the chunk (at DeepSeek's r 512, n 128,
v 128: past < T S / 170.7, so for chunks of 128 the first three and, at a tie, absorbed for the
fourth). H cancels: the choice does not depend on the head count.

Ties go to the absorbed form: it never materialises [B, H, S, n + v] decompressed keys and values.
"""

from __future__ import annotations

from typing import Literal

MlaForm = Literal["absorbed", "decompressed"]
MLA_FORMS = ("auto", "absorbed", "decompressed")  # what MultiHeadLatentAttention.form accepts


def mla_form_flops(new_tokens: int, keys: int, heads: int, kv_rank: int, nope: int, rope: int,
                   v_dim: int) -> dict[str, int]:
    """FLOPs (2 x multiply-adds) per batch row of the steps where the forms differ, for `new_tokens`
    queries over `keys` positions (past + new): {"absorbed": ..., "decompressed": ...}."""
    T, S, H, r = new_tokens, keys, heads, kv_rank
    absorbed = T * H * nope * r + T * S * H * (r + rope) + T * S * H * r + T * H * r * v_dim
    decompressed = S * r * H * (nope + v_dim) + T * S * H * (nope + rope) + T * S * H * v_dim
    return {"absorbed": 2 * absorbed, "decompressed": 2 * decompressed}


def cheaper_mla_form(new_tokens: int, keys: int, heads: int, kv_rank: int, nope: int, rope: int,
                     v_dim: int) -> MlaForm:
    """"decompressed" when it costs strictly fewer FLOPs than "absorbed" (mla_form_flops), else "absorbed"."""
    flops = mla_form_flops(new_tokens, keys, heads, kv_rank, nope, rope, v_dim)
    return "decompressed" if flops["decompressed"] < flops["absorbed"] else "absorbed"


def most_decompressed_keys(new_tokens: int, max_keys: int, kv_rank: int, nope: int, v_dim: int) -> int:
    """The most key positions S <= `max_keys` over which a pass of `new_tokens` takes the decompressed
    form (0: never), so a memory plan can size its per-head keys and values [B, H, S, n + rope]
    and [B, S, H (n + v)]. From the inequality in the module docstring: with a = 2r - n - v and
    b = r (n + v), past (b - T a) < T^2 a; every past qualifies when b <= T a (long chunks)."""
    T, a, b = new_tokens, 2 * kv_rank - nope - v_dim, kv_rank * (nope + v_dim)
    if a <= 0 or T > max_keys:
        return 0
    if b <= T * a:
        return max_keys
    longest_past = -(-(T * T * a) // (b - T * a)) - 1  # the largest past with past (b - T a) < T^2 a
    return min(max_keys, longest_past + T)
