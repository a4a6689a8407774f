"""`SessionKV`: the keys and values of one session's context, grown on demand.

It has the interface colibri-model's attention uses from a `KVCache` (`length`, `max_len`,
`update(layer, k, v)`), so a session's forward pass is colibri-model's own; unlike that cache it
is not preallocated to `max_len`: `reserve(n)` grows every layer's storage (doubling, capped at
`max_len`) before a forward pass needs it, so many short sessions, and forks of one, cost what
they hold, not a whole context each. Growth copies the filled positions once per doubling
(amortised O(1) per token); the peak during a growth is old + new storage.
"""

from __future__ import annotations

import torch

MIN_CAPACITY = 64  # positions allocated on first use: one short prompt without a regrowth


class SessionKV:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, device, dtype,
                 capacity: int = 0, value_head_dim: int | None = None):
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        # keys are head_dim wide, values value_head_dim: they differ under MLA, whose latent cache
        # has one "head" of keys and no values (ColibriConfig.kv_cache_heads, key/value_head_dim)
        self.value_head_dim = head_dim if value_head_dim is None else value_head_dim
        self.max_len, self.device, self.dtype = max_len, device, dtype
        self.length = 0  # positions filled, shared by all layers
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        if capacity:
            self.reserve(capacity)

    @classmethod
    def for_model(cls, config, max_len: int, device, dtype, capacity: int = 0) -> SessionKV:
        return cls(config.n_layers, config.kv_cache_heads, config.key_head_dim, max_len, device, dtype, capacity,
                   config.value_head_dim)

    @property
    def bytes_per_position(self) -> int:
        width = self.n_kv_heads * (self.head_dim + self.value_head_dim)
        return self.n_layers * width * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.capacity * self.bytes_per_position

    def reserve(self, positions: int) -> None:
        """Make room for `positions` filled positions (raises past `max_len`)."""
        if positions > self.max_len:
            raise ValueError(f"KV cache full: {positions} positions exceed max_len={self.max_len}")
        if positions <= self.capacity:
            return
        new = min(self.max_len, max(positions, 2 * self.capacity, MIN_CAPACITY))
        key_shape = (1, self.n_kv_heads, new, self.head_dim)
        value_shape = (1, self.n_kv_heads, new, self.value_head_dim)
        keys = [torch.empty(key_shape, device=self.device, dtype=self.dtype) for _ in range(self.n_layers)]
        values = [torch.empty(value_shape, device=self.device, dtype=self.dtype) for _ in range(self.n_layers)]
        for layer in range(len(self.keys)):
            keys[layer][:, :, : self.length] = self.keys[layer][:, :, : self.length]
            values[layer][:, :, : self.length] = self.values[layer][:, :, : self.length]
        self.keys, self.values, self.capacity = keys, values, new

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.length, self.length + k.shape[2]
        self.reserve(end)  # a no-op when the session reserved before the pass (it does)
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def copy(self) -> SessionKV:
        """An independent copy of the filled positions (a fork)."""
        twin = SessionKV(self.n_layers, self.n_kv_heads, self.head_dim, self.max_len, self.device, self.dtype,
                         value_head_dim=self.value_head_dim)
        if self.length:
            twin.reserve(self.length)
            for layer in range(self.n_layers):
                twin.keys[layer][:, :, : self.length] = self.keys[layer][:, :, : self.length]
                twin.values[layer][:, :, : self.length] = self.values[layer][:, :, : self.length]
        twin.length = self.length
        return twin

    def load_row(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        """Fill positions [0, length) from per-layer [B=1, H, >=length, D] tensors (a batch row)."""
        self.reserve(length)
        for layer in range(self.n_layers):
            self.keys[layer][:, :, :length] = keys[layer][:, :, :length]
            self.values[layer][:, :, :length] = values[layer][:, :, :length]
        self.length = length
