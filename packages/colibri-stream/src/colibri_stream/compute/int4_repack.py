"""Container nibbles -> torch's CPU int4-pack layout with a few byte shuffles, learned by probing.

The obvious repack (`reference_pack`) unpacks every nibble, widens them to int32 and calls
`torch.ops.aten._convert_weight_to_int4pack_for_cpu`. For a Colibri-Micro expert that took
22-24 ms on a Xeon (unpack 5 ms, int32 9 ms, convert 5 ms for gate|up alone) and 7.5-31 ms on an
AVX2 EPYC, 5-20x the 1.4 ms its O_DIRECT read takes, so a cold run was bound by repacking.

The converter's output is a permutation of nibbles that depends on the CPU capability torch
dispatches to (and may change between torch versions). Seen with torch 2.13 on x86:

    capability   rows per block   byte b of column k in a block holds rows (low, high nibble)
    AVX-512      64               (b, b + 32)
    AVX2         32               (b, b + 16)
    default      32               (2b, 2b + 1)
    (a last block of fewer rows, any capability: (2b, 2b + 1))

Every one of them is "row-blocked, column-major inside a block, two rows of one column per
byte"; they differ only in the block height and in which two rows share a byte. So instead of
hard-coding one, `learn_layout` asks the converter on the running machine: it packs matrices
whose nibbles spell out their own row index (one hexadecimal digit per probe) and reads back,
for every output nibble, the row it came from. From that it finds the blocks and their row
pairs (`PackLayout`). `shuffle_pack` then builds the same bytes from the container's packed
bytes (low nibble = even column) with two row gathers, two masks, two shifts and a transpose per
block: no int32 widening and no nibble unpacking (`repack_timings` measures both routes).

A layout that is not of that family (the converter on another architecture, a future torch)
is never guessed at: `learn_layout` returns None and `pack_for_cpu_kernel` uses the converter.
Every learned layout is also checked once against the converter on a random matrix of the same
shape before it is used, and `fast_path_taken` says which route a shape takes, so a test can
assert the fast one was taken on whatever machine it runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RowBlocks:
    """`count` consecutive blocks of `rows` rows each, starting at row `first_row`.

    Attributes:
        low_rows, high_rows: for byte b of a block's column, the rows (relative to the block)
            whose nibbles of that column sit in the byte's low and high halves.
    """

    first_row: int
    count: int
    rows: int
    low_rows: tuple[int, ...]
    high_rows: tuple[int, ...]


@dataclass(frozen=True)
class PackLayout:
    """The converter's layout for one [rows, cols] shape: its row blocks, top to bottom."""

    rows: int
    cols: int
    runs: tuple[RowBlocks, ...]


_layouts: dict[tuple[int, int], PackLayout | None] = {}


def converter_available() -> bool:
    return hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def reference_pack(packed: np.ndarray) -> torch.Tensor:
    """The converter route: packed uint8 [N, K/2] (low nibble = even column) -> [N, K/2] uint8."""
    from colibri_int4 import unpack_nibbles

    nibbles = torch.from_numpy(unpack_nibbles(packed)).to(torch.int32)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)


def _source_rows(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """For each output byte of the converter, the source rows of its low and high nibbles."""
    row_index = torch.arange(rows, dtype=torch.int32)[:, None].expand(rows, cols)
    low = np.zeros(rows * cols // 2, dtype=np.int64)
    high = np.zeros_like(low)
    shift = 0
    while (1 << shift) < rows or shift == 0:  # one probe per hexadecimal digit of the row index
        digit = ((row_index >> shift) & 0xF).contiguous()
        out = torch.ops.aten._convert_weight_to_int4pack_for_cpu(digit, 1).reshape(-1).numpy()
        if out.size != low.size:
            raise ValueError(f"converter gave {out.size} bytes for a [{rows}, {cols}] matrix")
        low |= (out & 0xF).astype(np.int64) << shift
        high |= (out >> 4).astype(np.int64) << shift
        shift += 4
    return low, high


def _fit_runs(low: np.ndarray, high: np.ndarray, rows: int, cols: int) -> tuple[RowBlocks, ...] | None:
    """Read the row blocks off the probed source rows, or None if they are not of the family."""
    blocks: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = []
    first_row, offset = 0, 0
    while first_row < rows:
        start = (low[offset], high[offset])
        # the block's byte count per column: where the first byte's row pair comes back (column 1)
        repeats = np.nonzero((low[offset + 1 :] == start[0]) & (high[offset + 1 :] == start[1]))[0]
        per_column = int(repeats[0]) + 1 if repeats.size else (low.size - offset) // cols
        height = 2 * per_column
        if per_column < 1 or first_row + height > rows:
            return None
        span = slice(offset, offset + per_column * cols)
        low_rows = low[offset : offset + per_column] - first_row
        high_rows = high[offset : offset + per_column] - first_row
        expected_low = np.tile(low_rows + first_row, cols)
        expected_high = np.tile(high_rows + first_row, cols)
        if not (np.array_equal(low[span], expected_low) and np.array_equal(high[span], expected_high)):
            return None  # not column-major with fixed row pairs
        if sorted(np.concatenate([low_rows, high_rows]).tolist()) != list(range(height)):
            return None  # the pairs do not cover the block's rows exactly once
        blocks.append((first_row, height, tuple(low_rows.tolist()), tuple(high_rows.tolist())))
        first_row += height
        offset += per_column * cols
    runs: list[RowBlocks] = []
    for first, height, lows, highs in blocks:  # merge equal consecutive blocks into runs
        last = runs[-1] if runs else None
        if last and (last.rows, last.low_rows, last.high_rows) == (height, lows, highs):
            runs[-1] = RowBlocks(last.first_row, last.count + 1, height, lows, highs)
        else:
            runs.append(RowBlocks(first, 1, height, lows, highs))
    return tuple(runs)


PROBE_COLS = 64  # the row blocks are read off a narrow matrix; `layout_for` checks the full width


def learn_layout(rows: int, cols: int) -> PackLayout | None:
    """Probe the converter for a [rows, cols] shape; None if its layout is not one we can shuffle
    into (then the converter itself must be used). Costs log16(rows) rounded up converter calls on
    a [rows, 64] matrix, well under a millisecond each."""
    if rows < 2 or rows % 2 or cols < 2 or cols % 2 or not converter_available():
        return None
    probe_cols = min(cols, PROBE_COLS)
    try:
        low, high = _source_rows(rows, probe_cols)
    except (RuntimeError, ValueError):
        return None
    runs = _fit_runs(low, high, rows, probe_cols)
    return PackLayout(rows, cols, runs) if runs else None


def _pick_rows(blocks: torch.Tensor, picks: tuple[int, ...]) -> torch.Tensor:
    """blocks [n, rows, half] -> [n, len(picks), half]: a strided view when the picks are evenly
    spaced (every layout seen so far), a gather otherwise."""
    step = picks[1] - picks[0] if len(picks) > 1 else 1
    if step > 0 and picks == tuple(range(picks[0], picks[0] + step * len(picks), step)):
        return blocks[:, picks[0] : picks[0] + step * (len(picks) - 1) + 1 : step]
    return blocks.index_select(1, torch.tensor(picks))


def shuffle_pack(packed: np.ndarray, layout: PackLayout) -> torch.Tensor:
    """The converter's bytes for `layout`, by byte shuffles (see the module docstring); no check."""
    p = torch.from_numpy(np.ascontiguousarray(packed))
    rows, half = p.shape
    if (rows, 2 * half) != (layout.rows, layout.cols):
        raise ValueError(f"layout is for [{layout.rows}, {layout.cols}], got [{rows}, {2 * half}]")
    pieces = []
    for run in layout.runs:
        blocks = p[run.first_row : run.first_row + run.count * run.rows].view(run.count, run.rows, half)
        low, high = _pick_rows(blocks, run.low_rows), _pick_rows(blocks, run.high_rows)
        even = (low & 0x0F) | ((high & 0x0F) << 4)  # columns 2c
        odd = (low >> 4) | (high & 0xF0)  # columns 2c + 1
        by_column = torch.stack((even, odd), dim=-1).view(run.count, run.rows // 2, 2 * half)
        pieces.append(by_column.transpose(1, 2).reshape(-1))  # column-major inside each block
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out.view(rows, half)


def layout_for(rows: int, cols: int) -> PackLayout | None:
    """The learned layout for this shape if it reproduces the converter (learned and checked
    once per shape and process, then cached), else None."""
    key = (rows, cols)
    if key not in _layouts:
        layout = learn_layout(rows, cols)
        if layout is not None:
            probe = np.random.default_rng(rows * 7919 + cols).integers(0, 256, (rows, cols // 2), dtype=np.uint8)
            if not torch.equal(shuffle_pack(probe, layout), reference_pack(probe)):
                layout = None
        _layouts[key] = layout
    return _layouts[key]


def fast_path_taken(rows: int, cols: int) -> bool:
    """Whether `pack_for_cpu_kernel` shuffles (True) or calls the converter (False) for this shape."""
    return layout_for(rows, cols) is not None


def pack_for_cpu_kernel(packed: np.ndarray) -> torch.Tensor:
    """packed uint8 [N, K/2] -> the [N, K/2] uint8 weight of `_weight_int4pack_mm_for_cpu`."""
    rows, half = packed.shape
    layout = layout_for(rows, 2 * half)
    return shuffle_pack(packed, layout) if layout is not None else reference_pack(packed)


def repack_timings(rows: int, cols: int, repeats: int = 3) -> dict:
    """Median ms of the converter route and of the shuffle route for one [rows, cols] matrix."""
    packed = np.random.default_rng(0).integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    layout = layout_for(rows, cols)
    routes = {"converter_ms": reference_pack}
    if layout is not None:
        routes["shuffle_ms"] = lambda m: shuffle_pack(m, layout)
    out: dict = {"capability": torch.backends.cpu.get_cpu_capability(), "matches": layout is not None}
    for name, fn in routes.items():
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn(packed)
            times.append((time.perf_counter() - started) * 1e3)
        out[name] = round(sorted(times)[len(times) // 2], 3)
    shuffle_ms = out.get("shuffle_ms")
    out["speedup"] = round(out["converter_ms"] / shuffle_ms, 2) if shuffle_ms else None
    if layout is not None:
        out["block_rows"] = [run.rows for run in layout.runs]
    return out
