"""The rules of who sees whom in attention, shared by `layers.Attention` and `mla.py`: the causal
rule on cache columns ANDed with a padding ([B, S]) or per-query ([B, T, S]) mask
(`attention_allowed`), key positions under such a mask and the sliding window over positions
(`key_positions`, `window_allowed`; GPT-OSS), and the softmax with one sink logit per head
(`sink_attention`; GPT-OSS), which SDPA cannot express.
"""

from __future__ import annotations

import torch


def attention_allowed(batch: int, queries: int, past: int, keys: int, attention_mask: torch.Tensor | None,
                      device: torch.device) -> torch.Tensor:
    """The boolean SDPA mask of `Attention`: [T, S] from the causal rule alone (query i at cache
    column past + i sees key columns <= past + i), or [B, 1, T, S] with a [B, S] or [B, T, S]
    `attention_mask` ANDed in (see Attention's docstring; a query left with no key sees its own column)."""
    query_columns = past + torch.arange(queries, device=device)
    causal = torch.arange(keys, device=device)[None, :] <= query_columns[:, None]  # [T, S]
    if attention_mask is None:
        return causal
    if tuple(attention_mask.shape) == (batch, keys):
        allowed = causal[None] & (attention_mask != 0)[:, None, :]  # [B, T, S]
    elif tuple(attention_mask.shape) == (batch, queries, keys):
        allowed = causal[None] & (attention_mask != 0)
    else:
        raise ValueError(f"attention_mask must be [batch, past + T] = [{batch}, {keys}] or [batch, T, past + T] = "
                         f"[{batch}, {queries}, {keys}], got {list(attention_mask.shape)}")
    own_column = torch.arange(keys, device=device)[None, :] == query_columns[:, None]
    allowed = allowed | (own_column[None] & ~allowed.any(-1, keepdim=True))
    return allowed[:, None]  # broadcast over the heads


def key_positions(keys: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The position of every key column: the column itself without a mask; with one, the count of
    the allowed keys before it ([B, S] -> [B, S], [B, T, S] -> [B, T, S]), since a row's real keys
    (a query's visible keys) hold its positions 0, 1, ... in column order while padding (or
    another packed sequence) sits between them in the cache."""
    if attention_mask is None:
        return torch.arange(keys, device=device)
    return (attention_mask != 0).cumsum(-1) - 1


def window_allowed(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """bool: a query at position p sees keys at positions > p - window (its own and the window - 1
    before it); ANDed with the causal mask on sliding layers (GPT-OSS). `query_positions` [T] or
    [B, T]; `key_positions` [S], [B, S] or [B, T, S]. Returns [T, S], or [B, 1, T, S] (the heads
    broadcast) when either is per row."""
    keys = key_positions if key_positions.dim() == 3 else key_positions.unsqueeze(-2)
    allowed = keys > (query_positions - window).unsqueeze(-1)
    return allowed[:, None] if allowed.dim() == 3 else allowed


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                   sinks: torch.Tensor) -> torch.Tensor:
    """softmax([q k^T / sqrt(D), sink_h]) over the allowed keys plus one sink logit per head,
    the sink's probability dropped (it has no value): GPT-OSS's attention. SDPA cannot take the
    extra column, so this is explicit, in fp32 (scores, softmax) whatever the activations' dtype.

    q [B, H, T, D]; k, v [B, Hkv, S, D]; allowed: bool broadcastable to [B, H, T, S]; sinks [H].
    Every query must be allowed at least one key (its own, under the causal rule).

    The query heads that share a KV head are folded into the query axis ([B, Hkv, groups x T, D]
    against [B, Hkv, S, D]) instead of repeating the keys and values per query head: at GPT-OSS's
    8 query heads per KV head that copy was 8x the cache, in fp32, every layer of every step.
    """
    B, H, T, D = q.shape
    kv_heads = k.shape[1]
    groups = H // kv_heads
    queries = q.float().reshape(B, kv_heads, groups * T, D)
    scores = torch.matmul(queries, k.float().transpose(-1, -2)).view(B, kv_heads, groups, T, -1) * D**-0.5
    if allowed.dim() == 4:  # [B, 1 or H, T, S] -> the grouped head axes
        allowed = allowed.unsqueeze(2) if allowed.shape[1] == 1 else allowed.reshape(B, kv_heads, groups, T, -1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().view(1, kv_heads, groups, 1, 1).expand(B, kv_heads, groups, T, 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    out = torch.matmul(probs.reshape(B, kv_heads, groups * T, -1), v.float())  # [B, Hkv, groups x T, Dv]
    return out.view(B, H, T, v.shape[-1]).to(q.dtype)
