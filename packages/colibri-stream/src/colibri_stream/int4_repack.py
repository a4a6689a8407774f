"""Container nibbles -> torch's CPU int4-pack layout with a few byte shuffles, not a conversion.

The obvious repack (expert_compute.py's reference) unpacks every nibble, widens them to int32
and calls `torch.ops.aten._convert_weight_to_int4pack_for_cpu`. For a Colibri-Micro expert that
takes 22-24 ms on this machine (unpack 5 ms, int32 9 ms, convert 5 ms for gate|up alone), 15x
the 1.4 ms its O_DIRECT read takes, so a cold Micro run was bound by repacking, not by the disk.

The kernel's layout is a permutation of nibbles, found by probing the converter with
index-encoding matrices (torch 2.13, x86): rows go in blocks of 64; inside a block the layout is
k-major, and byte j of column k holds row j (low nibble) and row j + 32 (high nibble); a tail
block of fewer than 64 rows holds rows (2j, 2j + 1). Built from the container's packed bytes
(low nibble = even column) that is two masks, two shifts and one transpose per block, about
10x faster (measured by `repack_timings`, printed by the benchmark).

Because this layout is a kernel implementation detail that may differ by torch version or CPU,
`pack_for_cpu_kernel` checks itself against the converter once per (rows, cols) shape, on a
random matrix, and falls back to the converter for good if they ever disagree.
"""

from __future__ import annotations

import time

import numpy as np
import torch

BLOCK_ROWS = 64
_verified: dict[tuple[int, int], bool] = {}


def reference_pack(packed: np.ndarray) -> torch.Tensor:
    """The converter route: packed uint8 [N, K/2] (low nibble = even column) -> [N, K/2] uint8."""
    from colibri_int4 import unpack_nibbles

    nibbles = torch.from_numpy(unpack_nibbles(packed)).to(torch.int32)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)


def shuffle_pack(packed: np.ndarray) -> torch.Tensor:
    """The same layout by byte shuffles (see the module docstring); no self-check."""
    p = torch.from_numpy(np.ascontiguousarray(packed))
    rows, half = p.shape
    main = rows - rows % BLOCK_ROWS
    pieces = []
    if main:
        blocks = p[:main].view(main // BLOCK_ROWS, 2, BLOCK_ROWS // 2, half)
        lo_rows, hi_rows = blocks[:, 0], blocks[:, 1]  # rows j and j + 32 of each block
        even = (lo_rows & 0x0F) | ((hi_rows & 0x0F) << 4)  # columns 2c
        odd = (lo_rows >> 4) | (hi_rows & 0xF0)  # columns 2c + 1
        by_column = torch.stack((even, odd), dim=-1).view(main // BLOCK_ROWS, BLOCK_ROWS // 2, 2 * half)
        pieces.append(by_column.transpose(1, 2).reshape(-1))  # k-major inside each block
    tail = rows - main
    if tail:
        pairs = p[main:].view(tail // 2, 2, half)
        first, second = pairs[:, 0], pairs[:, 1]  # rows 2j and 2j + 1
        even = (first & 0x0F) | ((second & 0x0F) << 4)
        odd = (first >> 4) | (second & 0xF0)
        by_column = torch.stack((even, odd), dim=-1).view(tail // 2, 2 * half)
        pieces.append(by_column.t().reshape(-1))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out.view(rows, half)


def shuffle_matches_converter(rows: int, cols: int) -> bool:
    """Whether `shuffle_pack` reproduces the converter for this shape (checked once, cached)."""
    key = (rows, cols)
    if key not in _verified:
        ok = rows % 2 == 0 and cols % 2 == 0
        if ok:
            probe = np.random.default_rng(rows * 7919 + cols).integers(0, 256, (rows, cols // 2), dtype=np.uint8)
            try:
                ok = torch.equal(shuffle_pack(probe), reference_pack(probe))
            except RuntimeError:
                ok = False
        _verified[key] = ok
    return _verified[key]


def pack_for_cpu_kernel(packed: np.ndarray) -> torch.Tensor:
    """packed uint8 [N, K/2] -> the [N, K/2] uint8 weight of `_weight_int4pack_mm_for_cpu`."""
    rows, half = packed.shape
    if shuffle_matches_converter(rows, 2 * half):
        return shuffle_pack(packed)
    return reference_pack(packed)


def repack_timings(rows: int, cols: int, repeats: int = 3) -> dict:
    """Median ms of the converter route and of the shuffle route for one [rows, cols] matrix."""
    packed = np.random.default_rng(0).integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    out = {}
    for name, fn in (("converter_ms", reference_pack), ("shuffle_ms", shuffle_pack)):
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn(packed)
            times.append((time.perf_counter() - started) * 1e3)
        out[name] = round(sorted(times)[len(times) // 2], 3)
    out["speedup"] = round(out["converter_ms"] / out["shuffle_ms"], 2) if out["shuffle_ms"] else None
    out["matches"] = shuffle_matches_converter(rows, cols)
    return out
