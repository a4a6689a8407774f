"""`SessionKV`: the keys and values of one session's context, grown on demand; on a
sliding-window layer, only what the window can still see.

It has the interface colibri-model's attention uses from a `KVCache` (`length`, `max_len`,
`update(layer, k, v)`, `first_column(layer)`), so a session's forward pass is colibri-model's own;
unlike that cache it is not preallocated to `max_len`: `reserve(n)` grows every full layer's
storage (doubling, capped at `max_len`) before a forward pass needs it, so many short sessions,
and forks of one, cost what they hold, not a whole context each. Growth copies the filled
positions once per doubling (amortised O(1) per token); the peak during a growth is old + new
storage.

Sliding-window layers (GPT-OSS's `sliding_layers`): a query at position p sees only the keys at
positions > p - window, so such a layer never holds more than
`windowed_positions(window, prefill_chunk)` columns, whatever the context. When a pass would not
fit, the layer drops its oldest columns and keeps `window - 1 + prefill_chunk` of them before the
new ones: the window - 1 that the pass's first query needs, plus one prefill chunk of slack, so a
truncate of up to a chunk (`Session.last_logits` re-running one token, a chat turn's re-rendered
tail) still finds its keys. `first[layer]` counts the columns dropped (colibri-model's
`KVCache.first_column`); `can_truncate` says whether a shorter context is still complete, and
the session re-runs its tokens where it is not (session.py). Dropping costs one copy of the kept
columns once per prefill chunk of new tokens (decode drops every `prefill_chunk` steps).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MIN_CAPACITY = 64  # positions allocated on first use: one short prompt without a regrowth


def sliding_windows(config) -> list[int | None]:
    """Per layer, the window of a layer whose cache keeps only that much (None: every column):
    GPT-OSS's `sliding_layers` (an MLA layer never slides)."""
    return [config.sliding_window if config.attention_kind != "mla" and config.is_sliding_layer(i) else None
            for i in range(config.n_layers)]


def windowed_positions(window: int, prefill_chunk: int) -> int:
    """The most columns a sliding-window layer stores: `window - 1 + prefill_chunk` kept before a
    pass of up to `prefill_chunk` new ones (footprint.py sizes the KV cache with it)."""
    return window - 1 + 2 * prefill_chunk


class SessionKV:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int, device, dtype,
                 capacity: int = 0, value_head_dim: int | None = None,
                 windows: Sequence[int | None] = (), prefill_chunk: int = 1):
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        # keys are head_dim wide, values value_head_dim: they differ under MLA, whose latent cache
        # has one "head" of keys and no values (ColibriConfig.kv_cache_heads, key/value_head_dim)
        self.value_head_dim = head_dim if value_head_dim is None else value_head_dim
        self.max_len, self.device, self.dtype = max_len, device, dtype
        self.windows = list(windows) if windows else [None] * n_layers  # per layer: None keeps every column
        if len(self.windows) != n_layers:
            raise ValueError(f"{len(self.windows)} windows for {n_layers} layers")
        self.prefill_chunk = prefill_chunk
        self.length = 0  # positions filled, shared by all layers
        self.first = [0] * n_layers  # columns a sliding layer has dropped from its front
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0  # columns allocated per full layer (a sliding layer: up to its limit)
        self.storage_version = 0  # bumped whenever a layer's storage is replaced (a caller may hold its address)
        if capacity:
            self.reserve(capacity)

    @classmethod
    def for_model(cls, config, max_len: int, device, dtype, capacity: int = 0, prefill_chunk: int = 1) -> SessionKV:
        return cls(config.n_layers, config.kv_cache_heads, config.key_head_dim, max_len, device, dtype, capacity,
                   config.value_head_dim, sliding_windows(config), prefill_chunk)

    @property
    def bytes_per_position(self) -> int:
        """Bytes per position over all layers (what a context costs while it is shorter than the windows)."""
        return self.n_layers * self._layer_width * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def _layer_width(self) -> int:
        return self.n_kv_heads * (self.head_dim + self.value_head_dim)

    @property
    def nbytes(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return sum(k.shape[2] for k in self.keys) * self._layer_width * elem

    def first_column(self, layer: int) -> int:
        return self.first[layer]

    def _limit(self, layer: int) -> int | None:
        window = self.windows[layer]
        return None if window is None else windowed_positions(window, self.prefill_chunk)

    def _allocate(self, layer: int, columns: int, filled: int) -> None:
        """Give `layer` storage for `columns` columns, its first `filled` copied over."""
        keys = torch.empty((1, self.n_kv_heads, columns, self.head_dim), device=self.device, dtype=self.dtype)
        values = torch.empty((1, self.n_kv_heads, columns, self.value_head_dim), device=self.device, dtype=self.dtype)
        if filled:
            keys[:, :, :filled] = self.keys[layer][:, :, :filled]
            values[:, :, :filled] = self.values[layer][:, :, :filled]
        self.keys[layer], self.values[layer] = keys, values
        self.storage_version += 1

    def reserve(self, positions: int) -> None:
        """Make room for `positions` filled positions (raises past `max_len`); a sliding layer
        grows only up to its limit (it drops columns instead, in `update`)."""
        if positions > self.max_len:
            raise ValueError(f"KV cache full: {positions} positions exceed max_len={self.max_len}")
        if positions <= self.capacity:
            return
        if not self.keys:
            self.keys, self.values = [None] * self.n_layers, [None] * self.n_layers
        new = min(self.max_len, max(positions, 2 * self.capacity, MIN_CAPACITY))
        for layer in range(self.n_layers):
            limit = self._limit(layer)
            columns = new if limit is None else min(new, limit)
            if self.keys[layer] is None or self.keys[layer].shape[2] < columns:
                self._allocate(layer, columns, self.length - self.first[layer] if self.keys[layer] is not None else 0)
        self.capacity = new

    def decode_slot(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(keys, values, column): where one new position of `layer` goes, for a caller that writes
        it there itself and then reads columns 0..column (a decode step's C path); `update`'s
        effect, without its copies. None for a sliding layer (`update` drops its old columns)."""
        if self.windows[layer] is not None:
            return None
        self.reserve(self.length + 1)
        return self.keys[layer], self.values[layer], self.length - self.first[layer]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = k.shape[2]
        self.reserve(self.length + new)  # a no-op when the session reserved before the pass (it does)
        stored = self.length - self.first[layer]
        if stored + new > self.keys[layer].shape[2]:  # only a sliding layer at its limit gets here
            keep = min(stored, self.windows[layer] - 1 + self.prefill_chunk)
            kept_keys = self.keys[layer][:, :, stored - keep : stored].clone()
            kept_values = self.values[layer][:, :, stored - keep : stored].clone()
            if keep + new > self.keys[layer].shape[2]:  # a pass longer than a prefill chunk
                self._allocate(layer, keep + new, 0)
            self.keys[layer][:, :, :keep], self.values[layer][:, :, :keep] = kept_keys, kept_values
            self.first[layer] += stored - keep
            stored = keep
        self.keys[layer][:, :, stored : stored + new] = k
        self.values[layer][:, :, stored : stored + new] = v
        return self.keys[layer][:, :, : stored + new], self.values[layer][:, :, : stored + new]

    def can_truncate(self, length: int) -> bool:
        """Whether the first `length` positions are still complete for what comes after them: every
        sliding layer still holds the window - 1 columns before `length`."""
        return all(window is None or self.first[layer] <= max(0, length - (window - 1))
                   for layer, window in enumerate(self.windows))

    def copy(self) -> SessionKV:
        """An independent copy of the filled positions (a fork)."""
        twin = SessionKV(self.n_layers, self.n_kv_heads, self.head_dim, self.max_len, self.device, self.dtype,
                         value_head_dim=self.value_head_dim, windows=self.windows, prefill_chunk=self.prefill_chunk)
        if self.length:
            twin.first = list(self.first)
            twin.reserve(self.length)
            for layer in range(self.n_layers):
                stored = self.length - self.first[layer]
                if twin.keys[layer].shape[2] < stored:  # a sliding layer grown past its limit by a long pass
                    twin._allocate(layer, stored, 0)
                twin.keys[layer][:, :, :stored] = self.keys[layer][:, :, :stored]
                twin.values[layer][:, :, :stored] = self.values[layer][:, :, :stored]
        twin.length = self.length
        return twin

    def load_row(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> None:
        """Fill positions [0, length) from per-layer [B=1, H, >=length, D] tensors (a batch row
        of a cache that kept every column); a sliding layer keeps its last
        `window - 1 + prefill_chunk` of them."""
        self.first = [0] * self.n_layers
        self.length = 0
        self.reserve(length)
        for layer in range(self.n_layers):
            window = self.windows[layer]
            start = 0 if window is None else max(0, length - (window - 1 + self.prefill_chunk))
            self.first[layer] = start
            self.keys[layer][:, :, : length - start] = keys[layer][:, :, start:length]
            self.values[layer][:, :, : length - start] = values[layer][:, :, start:length]
        self.length = length
