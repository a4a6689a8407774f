"""Deterministic packed-sequence loading with a resumable position.

Every source (pretraining shards, or an SFT token stream) is a list of token arrays, each
optionally with a parallel 0/1 `loss_mask`. Documents already sit back to back with EOS
between them, so packing is slicing: a shard of n tokens holds `(n - 1) // seq_len` windows of
`seq_len + 1` tokens (inputs = window[:-1], targets = window[1:], consecutive windows share one
token so no target is lost). Attention crosses document boundaries, as in GPT-2/nanoGPT
packing; the EOS token tells the model where a document ended.

Order: each epoch visits the shards in a permutation drawn from `(seed, epoch)` and the
windows of a shard in a permutation drawn from `(seed, epoch, shard)`. The whole position is
`LoaderPosition(epoch, shard_cursor, window_cursor, seed, seq_len)`, a few integers saved in
`training_state.json`: a resumed run rebuilds the same permutations and continues with exactly
the windows it would have drawn. Shuffling within one shard at a time keeps reads local to one
memmapped file (page cache friendly) at the cost of a weaker shuffle than a global one.

A step draws the GLOBAL batch (all ranks, all micro-batches) from the one position, and each
rank then takes its slice, so the tokens of a step do not depend on the number of processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from ..errors import LoaderError

IGNORE_INDEX = -100


class LoaderPosition(BaseModel):
    """Where the loader stands: the next window to draw (part of training_state.json)."""

    model_config = ConfigDict(extra="forbid")
    epoch: int = 0
    shard_cursor: int = 0  # index into this epoch's shard order
    window_cursor: int = 0  # index into the current shard's window order
    seed: int = 0
    seq_len: int


@dataclass
class TokenSource:
    """Token arrays (uint16 memmaps or in-memory) with optional per-token loss masks."""

    tokens: Sequence[np.ndarray]
    loss_masks: Sequence[np.ndarray] | None = None
    names: Sequence[str] | None = None


class PackedLoader:
    """Draws `[batch, seq_len]` (inputs, targets) pairs in a reproducible shuffled order.

    Example:
        >>> loader = PackedLoader(source, seq_len=256, seed=0)
        >>> inputs, targets = loader.next_batch(8)      # int64 tensors [8, 256]
        >>> state = loader.position                      # save; later PackedLoader(..., position=state)
    """

    def __init__(self, source: TokenSource, seq_len: int, seed: int = 0,
                 position: LoaderPosition | None = None, shuffle: bool = True):
        self.source = source
        self.seq_len = seq_len
        self.shuffle = shuffle
        self.windows = [max(0, (len(t) - 1) // seq_len) for t in source.tokens]
        if sum(self.windows) == 0:
            longest = max((len(t) for t in source.tokens), default=0)
            raise LoaderError(
                f"no shard holds a full sequence: seq_len {seq_len} needs {seq_len + 1} tokens, "
                f"the longest shard has {longest}"
            )
        if position is None:
            position = LoaderPosition(seed=seed, seq_len=seq_len)
        elif position.seq_len != seq_len:
            raise LoaderError(f"loader position was saved for seq_len {position.seq_len}, not {seq_len}")
        elif position.shard_cursor > len(self.windows):
            raise LoaderError(
                f"loader position names shard {position.shard_cursor} but the data has {len(self.windows)} shards"
            )
        self.position = position.model_copy()
        self._order_cache: dict[tuple[int, int], np.ndarray] = {}

    # --- order ---------------------------------------------------------------------------------
    def _shard_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.windows))
        return np.random.default_rng([self.position.seed, epoch]).permutation(len(self.windows))

    def _window_order(self, epoch: int, shard: int) -> np.ndarray:
        key = (epoch, shard)
        if key not in self._order_cache:
            n = self.windows[shard]
            order = (np.random.default_rng([self.position.seed, epoch, shard, 1]).permutation(n)
                     if self.shuffle else np.arange(n))
            self._order_cache = {key: order}  # keep one shard's order: shards can hold 100k windows
        return self._order_cache[key]

    def position_at(self, index: int) -> LoaderPosition:
        """The position after drawing `index` windows from the start of this order (same seed), in
        O(shards) without drawing them: how a parallel worker starts on its own slice of the stream."""
        if index < 0:
            raise LoaderError(f"a window index must be >= 0, got {index}")
        epoch, rest = divmod(index, sum(self.windows))
        for cursor, shard in enumerate(self._shard_order(epoch)):
            n = self.windows[int(shard)]
            if rest < n:
                return LoaderPosition(epoch=epoch, shard_cursor=cursor, window_cursor=rest,
                                      seed=self.position.seed, seq_len=self.seq_len)
            rest -= n
        raise AssertionError("unreachable: rest < the epoch's windows")

    def next_windows(self, count: int) -> list[tuple[int, int]]:
        """The next `count` (shard, start token) pairs; advances the position, wrapping epochs."""
        out: list[tuple[int, int]] = []
        pos = self.position
        while len(out) < count:
            order = self._shard_order(pos.epoch)
            if pos.shard_cursor >= len(order):
                pos.epoch, pos.shard_cursor, pos.window_cursor = pos.epoch + 1, 0, 0
                continue
            shard = int(order[pos.shard_cursor])
            if pos.window_cursor >= self.windows[shard]:
                pos.shard_cursor, pos.window_cursor = pos.shard_cursor + 1, 0
                continue
            window = int(self._window_order(pos.epoch, shard)[pos.window_cursor])
            out.append((shard, window * self.seq_len))
            pos.window_cursor += 1
        return out

    # --- tensors -------------------------------------------------------------------------------
    def gather(self, windows: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        inputs = np.empty((len(windows), T), dtype=np.int64)
        targets = np.empty((len(windows), T), dtype=np.int64)
        for row, (shard, start) in enumerate(windows):
            chunk = np.asarray(self.source.tokens[shard][start:start + T + 1], dtype=np.int64)
            inputs[row] = chunk[:-1]
            targets[row] = chunk[1:]
            if self.source.loss_masks is not None:
                mask = np.asarray(self.source.loss_masks[shard][start + 1:start + T + 1], dtype=bool)
                targets[row][~mask] = IGNORE_INDEX
        return torch.from_numpy(inputs), torch.from_numpy(targets)

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gather(self.next_windows(batch_size))


def fixed_batches(source: TokenSource, seq_len: int, batch_size: int, max_batches: int):
    """The first `max_batches` batches in file order (validation: the same sequences every time)."""
    loader = PackedLoader(source, seq_len, shuffle=False)
    total = sum(loader.windows)
    n = min(max_batches * batch_size, total)
    windows = loader.next_windows(n)
    return [loader.gather(windows[i:i + batch_size]) for i in range(0, n, batch_size)]
