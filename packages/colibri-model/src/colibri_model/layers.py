"""Dense building blocks: RMSNorm, rotary embeddings, grouped-query attention with QK-norm and a
KV cache, and the SwiGLU feed-forward used by the dense layers and the shared expert.

Variants of imported checkpoints are configuration here (ColibriConfig): QK-norm per head or
over the whole projection, q/k/v biases, RoPE scaling ("linear", "llama3", "yarn";
`rope_inv_freq`), the interleaved RoPE layout, and GPT-OSS's o_proj bias, attention sinks and
sliding-window layers. The masking rules (causal, padding, packed, window) and the sink
softmax are in attention_rules.py; multi-head latent attention is in mla.py.

The math is specified in CHECKPOINT.md; colibri-stream runs these same modules (it only swaps
the routed experts), so there is exactly one definition of attention and norms.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention_rules import attention_allowed, key_positions, sink_attention, window_allowed
from .config import ColibriConfig, RopeScaling


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32 for stability under bf16."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, device=None) -> torch.Tensor:
    """fp64 inverse frequencies `theta^(-2j/head_dim)`, j < head_dim/2, after `scaling`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    # llama3: keep short wavelengths, stretch long ones by `factor`, blend the band between.
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    return torch.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), blended, out)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN (Peng et al. 2023): a frequency pair that turns more than `beta_fast` times over the
    original context keeps its frequency (extrapolation), fewer than `beta_slow` times is divided
    by `factor` (interpolation), with a linear ramp over the pair index between the two."""

    def pair_index(rotations: float) -> float:  # the (fractional) pair that turns `rotations` times
        return head_dim * math.log(scaling.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index(scaling.beta_fast), pair_index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


@functools.lru_cache(maxsize=16)
def _rope_tables(head_dim: int, theta: float, scaling: RopeScaling | None, size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables [size, head_dim], built once and shared by every layer (and model) of the
    same rope: an imported model with a 40,960-token max_seq_len would otherwise hold one 42 MB pair
    per layer. Built outside inference mode whatever the caller's: a table cached by a first
    forward under `torch.inference_mode()` (an eval, a generation) would otherwise be an inference
    tensor, and every later training forward of the same rope in the process would fail ("Inference
    tensors cannot be saved for backward")."""
    with torch.inference_mode(False):
        inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
        angles = torch.outer(torch.arange(size, device=device, dtype=torch.float64), inv_freq)
        factor = 1.0 if scaling is None else scaling.attention_factor  # yarn scales cos and sin
        # cos and sin of the half, in fp32, then repeated: cos and sin are elementwise, so the same
        # values as repeating the angles first (up to which of torch's vector or scalar loops takes
        # an element), with a fifth of the float64 temporaries (84 MB at 40,960 positions otherwise)
        cos, sin = (angles.cos() * factor).float(), (angles.sin() * factor).float()
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over fp32 tables of `max_len` positions (the config's max_seq_len).

    The table length comes from the config, never from the positions' values: reading
    `positions.max()` would be a host sync per layer and a graph break under torch.compile.
    `ensure(length, device)` builds the tables (lazily, so a model created on the meta device or
    moved between devices needs no special care) or grows them for a longer KV cache; it looks only
    at host-side metadata. The model calls it once per forward, before its blocks, so a compiled
    block always finds the tables ready. Positions past the table raise an index error.
    """

    def __init__(self, head_dim: int, theta: float, max_len: int = 2048, scaling: RopeScaling | None = None,
                 interleave: bool = False):
        super().__init__()
        self.head_dim = head_dim
        self.interleave = interleave  # pairs (0,1), (2,3), ...: DeepSeek's layout of the rope dims
        self.theta = theta
        self.max_len = max_len
        self.scaling = scaling
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def limit(self, max_len: int) -> None:
        """Build tables of `max_len` positions from now on (a runtime whose KV cache holds fewer
        positions than the config's max_seq_len need not hold tables for all of them)."""
        self.max_len = max_len
        if self._cos is not None and self._cos.shape[0] > max_len:
            self._cos = self._sin = None

    def ensure(self, length: int, device: torch.device) -> None:
        if self._cos is not None and self._cos.shape[0] >= length and self._cos.device == device:
            return
        self._cos, self._sin = _rope_tables(self.head_dim, self.theta, self.scaling, max(length, self.max_len), device)

    def at(self, position: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 (cos, sin) rows [D] of one position (< the table length), as `forward` applies
        them: for a runtime that rotates a decode token itself (colibri-stream's native attention)."""
        self.ensure(self.max_len, torch.device(device))
        return self._cos[position], self._sin[position]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, H, T, D]; positions: absolute positions (< the table length), [T] shared by the
        batch or [B, T] per row (a padded batch whose rows stand at different positions)."""
        self.ensure(self.max_len, x.device)
        cos, sin = self._cos[positions], self._sin[positions]  # [T, D], or [B, T, D]
        if positions.dim() == 2:  # per row: broadcast over the heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        half = self.head_dim // 2
        xf = x.float()
        if self.interleave:  # even dims then odd dims: the pairs become (j, j + half); q and k alike
            xf = torch.cat([xf[..., 0::2], xf[..., 1::2]], dim=-1)
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)


class KVCache:
    """Keys and values of past positions for incremental decoding, one slot per layer.

    Preallocated to `max_len` so a decode step is an in-place write, not a concatenation.
    `first[layer]` counts the key columns no longer stored at the front of that layer (0: none):
    its storage column j holds cache column first + j. colibri-stream's sessions drop what a
    sliding-window layer can no longer see (its session_kv.py), and a batch copied from such a
    session carries the offsets; attention reads them through `first_column`.
    """

    def __init__(self, config: ColibriConfig, batch_size: int, max_len: int, device=None, dtype=torch.float32):
        keys = (batch_size, config.kv_cache_heads, max_len, config.key_head_dim)
        values = (batch_size, config.kv_cache_heads, max_len, config.value_head_dim)
        self.keys = [torch.zeros(keys, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros(values, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.length = 0  # positions filled, shared by all layers
        self.max_len = max_len
        self.first = [0] * config.n_layers

    def first_column(self, layer: int) -> int:
        """The cache column `update`'s returned keys start at for `layer`."""
        return self.first[layer]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the T new columns after `length`; the layer's keys and values from column
        `first_column(layer)` through the new ones."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions exceed max_len={self.max_len}")
        offset = self.first[layer]
        self.keys[layer][:, :, start - offset : end - offset] = k
        self.values[layer][:, :, start - offset : end - offset] = v
        return self.keys[layer][:, :, : end - offset], self.values[layer][:, :, : end - offset]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (a 1-D index, in the order given): a batch whose finished
        rows leave decoding. Copies what is kept (the storage shrinks with the batch)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]


class Attention(nn.Module):
    """Grouped-query attention with QK-norm (per head, or over the projection), RoPE and SDPA
    (`enable_gqa`).

    forward(x [B, T, d], positions, cache=None, attention_mask=None) -> [B, T, d]

    - `positions`: absolute positions for RoPE, [T] (every row alike: training, plain prefill and
      decode) or [B, T] (per row: a padded batch whose rows stand at different positions).
    - `cache`: a KV cache (`KVCache`, or anything with `length`, `update(layer, k, v)` and
      `first_column(layer)`); its `length` (`past`) is the cache column the first of the T tokens
      is written to, shared by the batch. Without one, past = 0. `update` returns the keys from
      column `first_column(layer)` on: a cache may drop columns no query can see any more (a
      sliding-window layer's, GPT-OSS), and the rules below still count every column from 0.
    - `attention_mask`: None, or [B, S] over every key column the pass attends, S = past + T (the
      cache's columns and the T new ones), bool or 0/1, True/1 = a real key. It is ANDed with the
      causal rule on cache columns: the query at column past + i sees key columns <= past + i. So
      a right-padded batch hides row r's padding columns by setting them False, and a row's real
      tokens see exactly what they would alone. A query that would see no key at all (a padding
      query with everything before it hidden) sees its own column instead, so no row is NaN.
      Or [B, T, S], per query (True = query i may see key j), also ANDed with the causal rule:
      packed rows, several sequences side by side, each seeing only its own tokens (an eval's
      tree of a shared context and its continuations; colibri-eval's packing.py).

    With `attention_mask=None` the rule is causal alone: SDPA's fast `is_causal=True` kernel when
    past == 0, else a [T, S] prefix mask; outputs are bit-identical to a forward without the
    argument. The mask is checked against (B, S) from shapes alone (no host sync).

    GPT-OSS's variants (config schema 1.2): an o_proj bias; on `sliding_layers` a window of
    `sliding_window` positions (a mask in positions, not cache columns: a padded or packed row's
    key positions come from its mask, `key_positions`; a cache may drop the columns before the
    window, see `cache`); learned sinks (`sink_attention`, an explicit fp32 softmax, since SDPA has no
    sink column). A layer with neither keeps the SDPA fast path, bit for bit as before.
    """

    def __init__(self, config: ColibriConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        d = config.d_model
        bias = config.qkv_bias
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=config.o_bias)
        # GPT-OSS: one extra logit per head in every softmax, with no value (an "attend to
        # nothing" slot); fp32 like the other 1-D tensors (tensor_names.held_dtype).
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if config.attn_sinks else None
        self.window = config.sliding_window if config.is_sliding_layer(layer_index) else None
        # "projection" (OLMoE): one RMSNorm over all heads' q (and k) before the head split.
        self.norm_projection = config.qk_norm and config.qk_norm_scope == "projection"
        if config.qk_norm:
            per_q, per_k = (self.n_heads, self.n_kv_heads) if self.norm_projection else (1, 1)
            self.q_norm = RMSNorm(per_q * self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(per_k * self.head_dim, config.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rope = RotaryEmbedding(self.head_dim, config.rope_theta, config.max_seq_len, config.rope_scaling,
                                    config.rope_interleave)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        q, k = self.rope(q, positions), self.rope(k, positions)

        past = first = 0
        if cache is not None:
            past = cache.length
            k, v = cache.update(self.layer_index, k, v)
            first = cache.first_column(self.layer_index)
        if attention_mask is None and past == 0 and self.window is None and self.sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            S = past + T  # every cache column, the dropped ones included: the rules count from 0
            allowed = attention_allowed(B, T, past, S, attention_mask, x.device)
            if self.window is not None:  # a query's own key is always inside its window
                allowed = allowed & window_allowed(positions, key_positions(S, attention_mask, x.device), self.window)
            if first:  # the columns the cache no longer holds (none of them inside a window)
                allowed = allowed[..., first:]
            if self.sinks is None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
            else:
                out = sink_attention(q, k, v, allowed, self.sinks)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense FFN and the shared expert."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
