"""The native int4 kernel (native/q4_matvec.c): built on first use with the system C compiler,
cached, called through ctypes.

Why a kernel of our own: torch's `_weight_int4pack_mm_for_cpu` needs its own packed layout (a
repack per missed expert costing 2-4x the expert's read) and, for one token on AVX2, runs far
below memory bandwidth (measured on an AVX2-only AMD EPYC, 1 thread: 318 us for a 1024 x 1024
int4 matrix, 1.6 GB/s, where a dense f32 matmul of 4 MB takes 254 us). The kernel here reads the
container's q4 layout as stored and works as llama.cpp's Q4_0 x Q8_0 dot products do: int8
activations per 32 columns, byte multiply-adds, one scale per group.

The shared object is compiled once per source, compiler and flags into
`$COLIBRI_KERNEL_CACHE` (default `~/.cache/colibri-stream/kernels`), atomically, so concurrent
processes share it. Without a C compiler, `kernel_unavailable()` says why and the engine uses
torch's kernels. `level` follows torch's own CPU capability (`ATEN_CPU_CAPABILITY`), so a run forced
to a lower level runs the portable path here too.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from ..errors import NativeKernelError

# the q4/q8/bf16 products, and the small per-row pieces of a decode token (one shared object)
SOURCES = tuple(Path(__file__).with_name("native") / name for name in ("q4_matvec.c", "decode_step.c",
                                                                       "decode_layer.c", "attention.c"))
HEADERS = tuple(Path(__file__).with_name("native") / name for name in ("exp_f32.h", "transpose8.h"))  # in the digest too
# -ffp-contract=off: a product and a sum written apart stay apart (no fused multiply-add the source
# did not ask for), so the portable paths give the same bits on every CPU and compiler.
# -fno-trapping-math: a float compare-and-select may run in vector lanes (the clamps of exp_f32.h;
# without it gcc keeps those loops scalar); values are unchanged, only floating-point exception
# flags, which nothing here reads, may differ.
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math")
BLOCK = 32  # activation columns per int8 scale (the kernel's BLOCK)
SCALAR, AVX2, AVX512_VNNI = 0, 1, 2  # the kernel's levels (AVX512_VNNI: the same bits as AVX2, faster)


def _compiler() -> str | None:
    configured = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    for name in (configured, "cc", "gcc", "clang"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("COLIBRI_KERNEL_CACHE") or Path.home() / ".cache" / "colibri-stream" / "kernels")


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise NativeKernelError("no C compiler found (set CC, or install gcc)")
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"q4_matvec-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *FLAGS, "-o", str(built), *map(str, SOURCES), "-lm"], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                names = ", ".join(path.name for path in SOURCES)
                raise NativeKernelError(f"{compiler} failed on {names}: {done.stderr.strip()[-500:]}")
            os.replace(built, target)  # atomic: a concurrent build of the same digest is identical
    library = ctypes.CDLL(str(target))
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.colibri_q8_quantize.argtypes = [pointer, i64, i64, pointer, pointer, pointer, pointer, pointer, i32]
    library.colibri_q4_matmul.argtypes = [pointer, pointer, pointer, pointer, pointer, i64, i64, pointer, pointer,
                                          pointer, i32, i64, i64, pointer, i32, i32]
    library.colibri_q4_experts.argtypes = [pointer, pointer, pointer, pointer, pointer, i64, i64, i64, pointer,
                                           pointer, pointer, pointer, pointer, i32, i64, i64, pointer, i32, i32]
    library.colibri_q4_experts.restype = i32
    library.colibri_q8w_matmul.argtypes = [pointer, pointer, i64, i64, pointer, pointer, i32, i64, i64, pointer, i32,
                                           i32]
    library.colibri_bf16w_matmul.argtypes = [pointer, i64, i64, pointer, i64, pointer, i32, i32]
    library.colibri_bf16w_matmul.restype = i32
    library.colibri_q6w_matmul.argtypes = [pointer, pointer, pointer, pointer, pointer, i64, i64, pointer, pointer, i32,
                                           i64, i64, pointer, i32, i32]
    library.colibri_q6w_matmul.restype = i32
    library.colibri_dequantize_rows.argtypes = [pointer, i32, pointer, pointer, i32, i64, i64, i64, i64, pointer]
    library.colibri_dequantize_rows.restype = i32
    library.colibri_tile_rows.argtypes = [pointer, pointer, i64, i64, i32]
    library.colibri_tile_rows.restype = i32
    library.colibri_tile_q6_rows.argtypes = [pointer, pointer, i64, i64, i32]
    library.colibri_tile_q6_rows.restype = i32
    library.colibri_q8_quantize.restype = library.colibri_q4_matmul.restype = i32
    library.colibri_q8w_matmul.restype = i32
    library.colibri_q4_cpu_level.restype = i32
    library.colibri_norm_rope.argtypes = [pointer, i64, i64, pointer, ctypes.c_float, pointer, pointer]
    library.colibri_rms_norm.argtypes = [pointer, i64, pointer, ctypes.c_float, pointer]
    library.colibri_add_weighted_rows.argtypes = [pointer, pointer, pointer, i64, i64]
    library.colibri_norm_rope.restype = library.colibri_rms_norm.restype = i32
    experts = [pointer, i64, i64, pointer, pointer, pointer, i32, i64, i64]
    library.colibri_token_experts_in.argtypes = [*experts, pointer, i32, i32]
    library.colibri_token_experts_out.argtypes = [*experts, pointer, pointer, i32, i32]
    library.colibri_token_experts_in.restype = library.colibri_token_experts_out.restype = i32
    library.colibri_route_row.argtypes = [pointer, i64, pointer, pointer, pointer, i64, i64, i32, i32,
                                          ctypes.c_float, pointer, pointer, pointer]
    library.colibri_route_row.restype = i32
    f32 = ctypes.c_float
    library.colibri_attention_in.argtypes = [pointer, i64, pointer, f32, pointer, pointer, f32, pointer, f32, pointer,
                                             pointer, i64, i64, i64, pointer, pointer, pointer, i32, i32]
    library.colibri_attention_out.argtypes = [pointer, pointer, pointer, pointer, pointer, f32, pointer, i32, i32]
    library.colibri_attention_in.restype = library.colibri_attention_out.restype = i32
    library.colibri_add_weighted_rows.restype = i32
    library.colibri_swiglu_rows.argtypes = [pointer, i64, i64, pointer, i32]
    library.colibri_token_experts.argtypes = [pointer, i64, i64, pointer, i32, i64, i64, i64, pointer, pointer, i32,
                                              i32]
    library.colibri_swiglu_rows.restype = library.colibri_token_experts.restype = i32
    library.colibri_q8_token_experts.argtypes = library.colibri_token_experts.argtypes
    library.colibri_q8_token_experts.restype = i32
    library.colibri_attend_row.argtypes = [pointer, i64, i64, i64, pointer, i64, i64, pointer, i64, i64, i64,
                                           ctypes.c_float, pointer, i32, i32]
    library.colibri_attend_row.restype = i32
    library.colibri_decode_layer_front.argtypes = [pointer, pointer, pointer, pointer, pointer, pointer, i64, i64, i64,
                                                   i64, i64, pointer, pointer, i64, pointer, pointer, pointer, pointer,
                                                   pointer, pointer, i32, i32]
    library.colibri_decode_layer_front.restype = i32
    library.colibri_decode_layers.argtypes = [pointer, i64, i64, i64, pointer, pointer, pointer, pointer, i32, i32]
    library.colibri_decode_layers.restype = i32
    return library


def kernel_unavailable() -> str | None:
    """None when the native kernel runs here, else why not."""
    try:
        _library()
    except (NativeKernelError, OSError) as exc:
        return str(exc)
    return None


@lru_cache(maxsize=1)
def cpu_level() -> int:
    """The kernel level to run: the fastest this CPU has, but never above torch's own capability
    (`ATEN_CPU_CAPABILITY=avx2` runs the AVX2 path here, `default` the portable C). Fixed for the
    process: torch reads ATEN_CPU_CAPABILITY once; cached, as every matmul asks."""
    forced = torch.backends.cpu.get_cpu_capability().upper()
    if forced in ("DEFAULT", "NO AVX", "ZVECTOR", "VSX") or not forced.startswith("AVX"):
        return SCALAR
    ceiling = AVX512_VNNI if forced.startswith("AVX512") else AVX2
    return min(ceiling, _library().colibri_q4_cpu_level())


class QuantizedActivations:
    """Rows of activations as the kernel reads them: int8 per 32 columns with one f32 scale each
    (round to nearest even, scale = max|x| / 127), and per-block sums of the int8 values.

    Two buffers hold everything (a decode step quantizes about a hundred inputs, so five allocations
    and views each would show): `bytes_` [2, rows, cols] int8 (the values, then the same values in
    the order q4 bytes unpack to, 64 columns at a time: the kernel's fast path), `words` f32
    [rows * blocks * 6] (scales, int32 sums, then 4 pair scales a block). The kernel takes
    `pointers`; the arrays themselves are views made when asked for."""

    __slots__ = ("rows", "cols", "paired", "bytes_", "words", "pointers")

    def __init__(self, x: torch.Tensor | None, level: int | None = None):
        """`level`: the kernel level that quantizes (default `cpu_level()`; every level gives the
        same bits)."""
        if x is None:  # filled in by __getitem__
            return
        x = x.detach().to(torch.float32).contiguous()
        self.rows, self.cols = x.shape
        if self.cols % BLOCK:
            raise ValueError(f"the native kernel needs a multiple of {BLOCK} columns, got {self.cols}")
        self.paired = self.cols % (2 * BLOCK) == 0
        m, blocks = self.rows, self.cols // BLOCK
        self.bytes_ = torch.empty(2 if self.paired else 1, m, self.cols, dtype=torch.int8)
        self.words = torch.empty(m * blocks * (6 if self.paired else 2), dtype=torch.float32)
        self._point()
        _library().colibri_q8_quantize(x.data_ptr(), m, self.cols, *self.pointers,
                                       cpu_level() if level is None else level)

    def _point(self) -> None:
        m, cols, blocks = self.rows, self.cols, self.cols // BLOCK
        b, w = self.bytes_.data_ptr(), self.words.data_ptr()
        row_words = 4 * m * blocks  # bytes of one [rows, blocks] f32 array
        # q, scales, sums (int32), pairs, pair scales: colibri_q8_quantize's order
        self.pointers = (b, w, w + row_words, b + m * cols if self.paired else None,
                         w + 2 * row_words if self.paired else None)

    def _words(self, part: int, width: int = 1) -> torch.Tensor:
        m, blocks = self.rows, self.cols // BLOCK
        return self.words[part * m * blocks : (part + width) * m * blocks].view(m, width * blocks)

    @property
    def q(self) -> torch.Tensor:
        return self.bytes_[0]

    @property
    def pairs(self) -> torch.Tensor:
        return self.bytes_[1] if self.paired else self.bytes_[0][:, :0]

    @property
    def scales(self) -> torch.Tensor:
        return self._words(0)

    @property
    def sums(self) -> torch.Tensor:
        return self._words(1).view(torch.int32)

    @property
    def pair_scales(self) -> torch.Tensor:
        return self._words(2, 4) if self.paired else self._words(0)[:, :0]

    def __getitem__(self, rows: torch.Tensor) -> QuantizedActivations:
        """The given rows (an index tensor), without quantizing again."""
        picked = QuantizedActivations(None)
        picked.rows, picked.cols, picked.paired = int(rows.numel()), self.cols, self.paired
        picked.bytes_ = self.bytes_.index_select(1, rows)
        m, blocks = self.rows, self.cols // BLOCK
        two = self.words[: 2 * m * blocks].view(2, m, blocks).index_select(1, rows).reshape(-1)
        if self.paired:
            four = self.words[2 * m * blocks :].view(m, -1).index_select(0, rows).reshape(-1)
            two = torch.cat([two, four])
        picked.words = two
        picked._point()
        return picked


FP16_SCALES, ROW_TILES = 1, 2
"""Bits of the kernel's `flags` for a matrix: fp16 scales (else bf16); a q4 or q8 matrix in row tiles."""


def kernel_flags(fp16_scales: bool, tiled: bool = False) -> int:
    return (FP16_SCALES if fp16_scales else 0) | (ROW_TILES if tiled else 0)


def tileable(rows: int, row_bytes: int, q6: bool = False) -> bool:
    """Whether a q4, q8 or q6 matrix of `rows` rows of `row_bytes` (q4: K/2, q8: K, q6: 3K/4) can
    be held in row tiles (`tile_rows`)."""
    return row_bytes % (96 if q6 else 64) == 0 and rows % 4 == 0


def tile_rows(matrix: torch.Tensor, out: torch.Tensor | None = None, untile: bool = False,
              q6: bool = False) -> torch.Tensor:
    """A q4, q8 or q6 matrix (uint8 [N, K/2], int8 [N, K], uint8 [N, 3K/4] with `q6`; contiguous,
    row-major as colibri-int4 stores it) in row tiles: 4 rows at a time with their chunks of 128
    columns (q8: 64) interleaved, so a one-token product that reads 4 rows side by side reads one
    sequential stream (q4_matvec.c); into `out` (the same shape and dtype; `matrix` itself tiles in
    place), or back to row-major with `untile`. Needs `tileable`. The kernel takes such a matrix
    with `tiled=True`: the same results, bit for bit."""
    rows, row_bytes = matrix.shape[0], matrix.shape[-1]
    out = matrix if out is None else out
    if (matrix.dim() != 2 or matrix.dtype not in (torch.uint8, torch.int8) or out.dtype != matrix.dtype
            or out.shape != matrix.shape or not matrix.is_contiguous() or not out.is_contiguous()
            or not tileable(rows, row_bytes, q6)):
        raise ValueError(f"tile_rows needs a contiguous uint8 or int8 [N, row bytes] with N % 4 == 0 and row bytes "
                         f"% {96 if q6 else 64} == 0, got {matrix.dtype} {tuple(matrix.shape)} into {out.dtype} "
                         f"{tuple(out.shape)}")
    library = _library()
    if q6:
        status = library.colibri_tile_q6_rows(matrix.data_ptr(), out.data_ptr(), rows, row_bytes // 3 * 4, int(untile))
    else:
        status = library.colibri_tile_rows(matrix.data_ptr(), out.data_ptr(), rows, row_bytes, int(untile))
    if status != 0:
        raise MemoryError("tile_rows: no room for a tile's copy")
    return out


def q4_matmul(x: QuantizedActivations, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              group: int, fp16_scales: bool = False, level: int | None = None, tiled: bool = False) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] f32, W the q4 matrix of `packed` (uint8 [N, K/2], row tiles where
    `tiled`) and `scales` (int16 bits of bf16/fp16, [N, K/group]), `zeros` like scales or None."""
    rows = packed.shape[0]
    if packed.shape[1] * 2 != x.cols or scales.shape != (rows, x.cols // group):
        raise ValueError(f"q4 matrix {tuple(packed.shape)} / scales {tuple(scales.shape)} do not fit "
                         f"{x.cols} columns in groups of {group}")
    out = torch.empty(x.rows, rows, dtype=torch.float32)
    status = _library().colibri_q4_matmul(
        *_activation_pointers(x), packed.data_ptr(), scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(),
        kernel_flags(fp16_scales, tiled), rows, group, out.data_ptr(), torch.get_num_threads(),
        cpu_level() if level is None else level)
    if status != 0:
        raise ValueError(f"the native kernel refused {x.cols} columns in groups of {group} (multiples of {BLOCK})"
                         + (f", or {rows} x {x.cols} in row tiles" if tiled else ""))
    return out


def _activation_pointers(x: QuantizedActivations) -> tuple:
    return (*x.pointers, x.rows, x.cols)


def q4_experts(x: QuantizedActivations, matrices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
               group: int, row_each: bool, fp16_scales: bool = False, level: int | None = None,
               tiled: bool = False) -> torch.Tensor:
    """Several q4 matrices of one shape (a token's experts) in one call, as (packed, scales, zeros).

    `row_each=False`: every matrix times every row of x -> [E * M, N], matrix e's rows first.
    `row_each=True`: matrix e times row e of x (M == E) -> [E, N].
    Each result row is bitwise what `q4_matmul` gives for that matrix and row."""
    count = len(matrices)
    if row_each and x.rows != count:
        raise ValueError(f"{count} matrices, one row each, but {x.rows} activation rows")
    rows = [[e] for e in range(count)] if row_each else [list(range(x.rows))] * count
    return q4_grouped(x, matrices, rows, group, fp16_scales, level, tiled)


def q4_grouped(x: QuantizedActivations, matrices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
               rows: list[list[int]], group: int, fp16_scales: bool = False, level: int | None = None,
               tiled: bool = False) -> torch.Tensor:
    """Matrix e times the activation rows `rows[e]` (indices into x), for several q4 matrices of
    one shape in one call -> [sum of len(rows[e]), N], matrix e's rows first, in the order given:
    a step's experts, each on the tokens routed to it. Each result row is bitwise what
    `q4_matmul` gives for that matrix and row."""
    count = len(matrices)
    packed, scales = matrices[0][0], matrices[0][1]
    out_features = packed.shape[0]
    for p, s, _ in matrices:
        if p.shape != packed.shape or s.shape != scales.shape or p.shape[1] * 2 != x.cols \
                or s.shape != (out_features, x.cols // group):
            raise ValueError(f"q4 matrix {tuple(p.shape)} / scales {tuple(s.shape)} do not fit {x.cols} columns "
                             f"in groups of {group}, or differ from the first {tuple(packed.shape)}")
    if len(rows) != count:
        raise ValueError(f"{count} matrices but rows for {len(rows)}")
    act_rows = [r for picked in rows for r in picked]
    starts = [0]
    for picked in rows:
        starts.append(starts[-1] + len(picked))
    pointers = ctypes.c_void_p * count
    zeros = [z for _, _, z in matrices]
    out = torch.empty(len(act_rows), out_features, dtype=torch.float32)
    status = _library().colibri_q4_experts(
        *_activation_pointers(x), count, pointers(*(p.data_ptr() for p, _, _ in matrices)),
        pointers(*(s.data_ptr() for _, s, _ in matrices)),
        None if all(z is None for z in zeros) else pointers(*(0 if z is None else z.data_ptr() for z in zeros)),
        (ctypes.c_int64 * len(act_rows))(*act_rows), (ctypes.c_int64 * (count + 1))(*starts),
        kernel_flags(fp16_scales, tiled), out_features, group, out.data_ptr(), torch.get_num_threads(),
        cpu_level() if level is None else level)
    if status != 0:
        raise ValueError(f"the native kernel refused {x.cols} columns in groups of {group} (multiples of {BLOCK}), "
                         f"or an activation row outside 0..{x.rows - 1}")
    return out


def q8_matmul(x: QuantizedActivations, weights: torch.Tensor, scales: torch.Tensor, group: int,
              fp16_scales: bool = False, level: int | None = None, tiled: bool = False) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] f32, W the q8 matrix of `weights` (int8 [N, K], row tiles where
    `tiled`) and `scales` (int16 bits of bf16/fp16, [N, K/group])."""
    rows = weights.shape[0]
    if weights.shape[1] != x.cols or scales.shape != (rows, x.cols // group):
        raise ValueError(f"q8 matrix {tuple(weights.shape)} / scales {tuple(scales.shape)} do not fit "
                         f"{x.cols} columns in groups of {group}")
    out = torch.empty(x.rows, rows, dtype=torch.float32)
    status = _library().colibri_q8w_matmul(
        x.pointers[0], x.pointers[1], x.rows, x.cols, weights.data_ptr(), scales.data_ptr(),
        kernel_flags(fp16_scales, tiled), rows, group, out.data_ptr(), torch.get_num_threads(),
        cpu_level() if level is None else level)
    if status != 0:
        raise ValueError(f"the native kernel refused {x.cols} columns in groups of {group} (multiples of {BLOCK})"
                         + (f", or {rows} x {x.cols} in row tiles" if tiled else ""))
    return out


def q6_matmul(x: QuantizedActivations, data: torch.Tensor, scales: torch.Tensor, group: int,
              fp16_scales: bool = False, level: int | None = None, tiled: bool = False) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] f32, W the q6 matrix of `data` (uint8 [N, K * 3 / 4]: each row's
    lows then highs, colibri-int4 FORMAT.md) and `scales` (int16 bits of bf16/fp16, [N, K/group]);
    K a multiple of 64; row tiles where `tiled`. Each result row is what it gets alone, at any M and
    thread count."""
    rows = data.shape[0]
    if x.cols % 64 or data.shape[1] * 4 != x.cols * 3 or scales.shape != (rows, x.cols // group):
        raise ValueError(f"q6 matrix {tuple(data.shape)} / scales {tuple(scales.shape)} do not fit "
                         f"{x.cols} columns (a multiple of 64) in groups of {group}")
    out = torch.empty(x.rows, rows, dtype=torch.float32)
    status = _library().colibri_q6w_matmul(
        *_activation_pointers(x), data.data_ptr(), scales.data_ptr(), kernel_flags(fp16_scales, tiled), rows, group,
        out.data_ptr(), torch.get_num_threads(), cpu_level() if level is None else level)
    if status != 0:
        raise ValueError(f"the native kernel refused {x.cols} columns in groups of {group} (multiples of {BLOCK})"
                         + (f", or {rows} x {x.cols} in row tiles" if tiled else ""))
    return out


def bf16_matmul(x: torch.Tensor, weights: torch.Tensor, level: int | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype, computed in f32) @ W.T -> [M, N] f32, W bf16 as stored (`weights`:
    int16 bits [N, K]): exact products, f32 sums in one fixed order at every level, each row
    what it gets alone."""
    x = x.detach().to(torch.float32).contiguous()
    rows, cols = weights.shape
    if x.dim() != 2 or x.shape[1] != cols or cols % 16:
        raise ValueError(f"bf16 matrix {tuple(weights.shape)} does not fit activations {tuple(x.shape)} "
                         "(columns must match, a multiple of 16)")
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    status = _library().colibri_bf16w_matmul(x.data_ptr(), x.shape[0], cols, weights.data_ptr(), rows, out.data_ptr(),
                                             torch.get_num_threads(), cpu_level() if level is None else level)
    if status != 0:
        raise ValueError(f"the native kernel refused a bf16 matrix of {cols} columns (a multiple of 16)")
    return out


# From this many activation rows on, `matmul` may dequantize a block of weight rows at a time and
# run a dense f32 matmul: the int8 kernel's rows cost about 29 us each for 1024 x 1024 on one
# core even in tiles of four (47-52 us alone; AVX2 path on an AVX-512 EPYC), while dequantizing costs
# about one row's time once and the dense product of many rows runs near the CPU's peak. Off by default (None): a row's result
# would then depend on how many rows share its call (int8 vs f32 activations), and a padded batch,
# a packed scoring row or a server's batched choices must give each row what it gets alone.
DENSE_FROM_ROWS: int | None = None
DEQUANT_BLOCK_WEIGHTS = 1 << 18  # weights dequantized at a time (1 MB of f32): bounded scratch


def matmul(x: torch.Tensor | QuantizedActivations, weights: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor | None, group: int, encoding: str, fp16_scales: bool = False,
           tiled: bool = False) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] f32 for a q4, q6 or q8 matrix W (in row tiles where `tiled`): the
    int8 kernel (activation rows four at a time, each bitwise what it gets alone), or,
    from `DENSE_FROM_ROWS` rows on where that is set, blocks of dequantized rows and a dense matmul."""
    if isinstance(x, torch.Tensor) and DENSE_FROM_ROWS is not None and x.shape[0] >= DENSE_FROM_ROWS:
        return dense_matmul(x, weights, scales, zeros, group, encoding, fp16_scales, tiled)
    if isinstance(x, torch.Tensor):
        x = QuantizedActivations(x)
    if encoding == "q8":
        return q8_matmul(x, weights, scales, group, fp16_scales, tiled=tiled)
    if encoding == "q6":
        return q6_matmul(x, weights, scales, group, fp16_scales, tiled=tiled)
    return q4_matmul(x, weights, scales, zeros, group, fp16_scales, tiled=tiled)


DEQUANTIZE_KINDS = {"q4": 0, "q8": 1, "q6": 2}  # colibri_dequantize_rows' `kind`


def dense_matmul(x: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group: int, encoding: str, fp16_scales: bool = False, tiled: bool = False) -> torch.Tensor:
    """x [M, K] f32 @ W.T with W (`encoding` q4, q6 or q8; in row tiles where `tiled`)
    dequantized `DEQUANT_BLOCK_WEIGHTS` at a time (exact weights)."""
    kind = DEQUANTIZE_KINDS[encoding]
    x = x.detach().to(torch.float32).contiguous()
    rows, cols = weights.shape[0], x.shape[1]
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    step = max(4, DEQUANT_BLOCK_WEIGHTS // cols // 4 * 4)  # whole tiles
    block = torch.empty(min(step, rows), cols, dtype=torch.float32)
    library = _library()
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        status = library.colibri_dequantize_rows(
            weights.data_ptr(), kind, scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(),
            kernel_flags(fp16_scales, tiled), cols, group, start, stop,
            block.data_ptr())
        if status != 0:
            raise ValueError(f"the native kernel refused {cols} columns in groups of {group}")
        out[:, start:stop] = x @ block[: stop - start].T
    return out


# norm_rope's limit (a stack row of this many floats per head)
MAX_HEAD_DIM = 1024


def norm_rope(rows: torch.Tensor, norm, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on f32 rows [heads, D]: colibri-model's per-head RMSNorm (`norm`: its module, or
    None for none), then the rotation by one position's (cos, sin) rows [D]."""
    weight = None if norm is None else norm.weight
    if rows.dtype != torch.float32 or not rows.is_contiguous() or rows.shape[1] % 8 or rows.shape[1] > MAX_HEAD_DIM \
            or (weight is not None and (weight.dtype != torch.float32 or not weight.is_contiguous())):
        raise ValueError(f"norm_rope needs contiguous f32 rows of a multiple of 8 up to {MAX_HEAD_DIM} columns "
                         f"and an f32 weight, got {rows.dtype} {tuple(rows.shape)}")
    _library().colibri_norm_rope(rows.data_ptr(), rows.shape[0], rows.shape[1],
                                 None if weight is None else weight.data_ptr(), norm.eps if norm is not None else 0.0,
                                 cos.data_ptr(), sin.data_ptr())


def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """colibri-model's RMSNorm (`norm`: its module, f32 weight) of one f32 row [D], as a new row."""
    weight = norm.weight
    if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 1 or x.shape[0] % 8 \
            or weight.dtype != torch.float32 or weight.shape != x.shape:
        raise ValueError(f"rms_norm needs one contiguous f32 row of a multiple of 8 columns and an f32 weight "
                         f"of its width, got {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty_like(x)
    _library().colibri_rms_norm(x.data_ptr(), x.shape[0], weight.data_ptr(), norm.eps, out.data_ptr())
    return out


def add_weighted_rows(row: torch.Tensor, rows: torch.Tensor, weights: list[float]) -> None:
    """row [D] += rows[e] * weights[e], e in order, in place: bit for bit `row += rows[e] * w` one
    after another in torch (f32), in one call."""
    if row.dtype != torch.float32 or rows.dtype != torch.float32 or not row.is_contiguous() \
            or not rows.is_contiguous() or rows.dim() != 2 or rows.shape != (len(weights), row.shape[0]):
        raise ValueError(f"add_weighted_rows needs an f32 row [D] and f32 rows [{len(weights)}, D], got "
                         f"{row.dtype} {tuple(row.shape)} and {rows.dtype} {tuple(rows.shape)}")
    _library().colibri_add_weighted_rows(row.data_ptr(), rows.data_ptr(), (ctypes.c_float * len(weights))(*weights),
                                         len(weights), row.shape[0])


class TokenExperts:
    """The q4 matrices of one decode token's experts as the kernel takes them (`token_experts_in`,
    `token_experts_out`): pointer arrays built once per token from each expert's addresses
    (packed, scales, zeros or 0), the experts all of one shape [rows, cols] in groups of `group`
    (row tiles where `tiled`)."""

    __slots__ = ("count", "packed", "scales", "zeros", "rows", "cols", "group", "flags")

    def __init__(self, addresses: list[tuple[int, int, int]], rows: int, cols: int, group: int, fp16: bool,
                 tiled: bool = False):
        self.count = len(addresses)
        array = ctypes.c_void_p * self.count
        self.packed = array(*(a[0] for a in addresses))
        self.scales = array(*(a[1] for a in addresses))
        self.zeros = array(*(a[2] for a in addresses)) if any(a[2] for a in addresses) else None
        self.rows, self.cols, self.group, self.flags = rows, cols, group, kernel_flags(fp16, tiled)


def token_experts_in(x: torch.Tensor, experts: TokenExperts) -> torch.Tensor:
    """One row x [cols] f32 (contiguous) quantized once and through every matrix -> [count, rows]
    f32: bitwise `q4_experts(QuantizedActivations(x[None]), ..., row_each=False)`."""
    if x.shape != (experts.cols,) or not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError(f"token_experts_in: a row {x.dtype} {tuple(x.shape)} does not fit {experts.count} matrices "
                         f"of {experts.rows} x {experts.cols} (a contiguous f32 row of {experts.cols})")
    out = torch.empty(experts.count, experts.rows, dtype=torch.float32)
    status = _library().colibri_token_experts_in(
        x.data_ptr(), experts.cols, experts.count, experts.packed, experts.scales, experts.zeros, experts.flags,
        experts.rows, experts.group, out.data_ptr(), torch.get_num_threads(), cpu_level())
    if status != 0:
        raise ValueError(f"the native kernel refused {experts.cols} columns in groups of {experts.group}")
    return out


def token_experts_out(hidden: torch.Tensor, experts: TokenExperts, weights: list[float], out: torch.Tensor) -> None:
    """Row e of hidden [count, cols] f32 (contiguous) through matrix e, then out [rows] += that
    row * weights[e] for e in order, in place: bitwise `q4_experts(QuantizedActivations(hidden),
    ..., row_each=True)` and `add_weighted_rows`."""
    if hidden.shape != (experts.count, experts.cols) or not hidden.is_contiguous() or hidden.dtype != torch.float32 \
            or out.shape != (experts.rows,) or not out.is_contiguous() or len(weights) != experts.count:
        raise ValueError(f"token_experts_out: hidden {tuple(hidden.shape)}, out {tuple(out.shape)} and "
                         f"{len(weights)} weights do not fit {experts.count} matrices of {experts.rows} x {experts.cols}")
    status = _library().colibri_token_experts_out(
        hidden.data_ptr(), experts.cols, experts.count, experts.packed, experts.scales, experts.zeros, experts.flags,
        experts.rows, experts.group, (ctypes.c_float * experts.count)(*weights), out.data_ptr(),
        torch.get_num_threads(), cpu_level())
    if status != 0:
        raise ValueError(f"the native kernel refused {experts.cols} columns in groups of {experts.group}")


def swiglu_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [M, 2F] f32 (each row gate | up) -> [M, F] f32, each value alone
    (q4_matvec.c's colibri_swiglu_rows: the same bits at every level and for every row count)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.dtype != torch.float32:
        raise ValueError(f"swiglu_rows needs f32 rows of gate | up [M, 2F], got {gate_up.dtype} "
                         f"{tuple(gate_up.shape)}")
    gate_up = gate_up.contiguous()
    hidden = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=torch.float32)
    _library().colibri_swiglu_rows(gate_up.data_ptr(), gate_up.shape[0], hidden.shape[1], hidden.data_ptr(),
                                   cpu_level())
    return hidden


TOKEN_EXPERT_ADDRESSES = 6
"""What `token_experts` takes of each expert: gate|up's packed, scales, zeros (or 0), then down's."""


def token_experts(x: torch.Tensor, addresses: list[int], expert_dim: int, group_gate_up: int, group_down: int,
                  fp16_scales: bool, weights: list[float], out: torch.Tensor, q8: bool = False,
                  tiled: bool = False) -> None:
    """A decode token's swiglu experts whole: out [d] += down_e(silu(gate_e x) * up_e x) * weights[e]
    for e in order, for one f32 row x [d] (contiguous; out likewise), in one kernel call; bitwise
    `token_experts_in`, `swiglu_rows` and `token_experts_out` (`q8`: experts stored as q8, bitwise
    each one's own `q8_matmul`s, `swiglu_rows` and `add_weighted_rows`). `addresses`: each expert's
    six (`TOKEN_EXPERT_ADDRESSES`), which must stay valid through the call; `tiled`: q4 matrices in
    row tiles."""
    count = len(weights)
    d = x.shape[0] if x.dim() == 1 else -1
    if (len(addresses) != TOKEN_EXPERT_ADDRESSES * count or count < 1 or x.dtype != torch.float32
            or not x.is_contiguous() or out.shape != (d,) or not out.is_contiguous() or out.dtype != torch.float32
            or d % group_gate_up or expert_dim % group_down or group_gate_up % BLOCK or group_down % BLOCK):
        raise ValueError(f"token_experts: a row {tuple(x.shape)} into out {tuple(out.shape)} does not fit {count} "
                         f"experts of width {expert_dim} ({len(addresses)} addresses, groups {group_gate_up} and "
                         f"{group_down})")
    library = _library()
    call = library.colibri_q8_token_experts if q8 else library.colibri_token_experts
    status = call(
        x.data_ptr(), d, count, (ctypes.c_void_p * len(addresses))(*addresses), kernel_flags(fp16_scales, tiled),
        expert_dim,
        group_gate_up, group_down, (ctypes.c_float * count)(*weights), out.data_ptr(), torch.get_num_threads(),
        cpu_level())
    if status != 0:
        raise ValueError(f"the native kernel refused {count} experts of {d} x {expert_dim}")


def route_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, expert_bias: torch.Tensor | None,
              top_k: int, softmax: bool, route_norm: bool, route_scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row x [D] f32 routed as colibri-model's Router routes it (decode_step.c says how) ->
    (ids [1, k] int64, gates [1, k] f32, scores [1, E] f32). Every tensor f32 and contiguous."""
    experts = weight.shape[0]
    scores = torch.empty(1, experts, dtype=torch.float32)
    ids = torch.empty(1, top_k, dtype=torch.int64)
    gates = torch.empty(1, top_k, dtype=torch.float32)
    _route_row(x, weight, bias, expert_bias, top_k, softmax, route_norm, route_scale, scores.data_ptr(),
               ids.data_ptr(), gates.data_ptr())
    return ids, gates, scores


def attend_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
               level: int | None = None) -> None:
    """One query row's attention over a session's cache (attention.c): q [heads, D] f32 contiguous,
    keys and values [1, kv_heads, S, D] f32 with unit stride along D (a cache's first S columns),
    out [heads, D] f32 contiguous = softmax(q K^T / sqrt(D)) V per head, query head h on key/value
    head h // (heads / kv_heads): torch's SDPA with enable_gqa, to float rounding."""
    heads, dim = q.shape if q.dim() == 2 else (0, 0)
    kv_heads, columns = keys.shape[1], keys.shape[2]
    if (q.dim() != 2 or keys.dim() != 4 or values.shape != keys.shape or keys.shape[0] != 1
            or keys.shape[3] != dim or not q.is_contiguous() or out.shape != q.shape or not out.is_contiguous()
            or any(t.dtype != torch.float32 for t in (q, keys, values, out))
            or keys.stride(3) != 1 or values.stride(3) != 1 or heads % kv_heads):
        raise ValueError(f"attend_row: a query {q.dtype} {tuple(q.shape)} does not fit keys {keys.dtype} "
                         f"{tuple(keys.shape)}, values {tuple(values.shape)} and out {tuple(out.shape)}")
    status = _library().colibri_attend_row(
        q.data_ptr(), heads, kv_heads, dim, keys.data_ptr(), keys.stride(1), keys.stride(2), values.data_ptr(),
        values.stride(1), values.stride(2), columns, dim ** -0.5, out.data_ptr(),
        cpu_level() if level is None else level, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"attend_row refused heads of {dim} (a multiple of 8 up to {MAX_HEAD_DIM}) over {columns} "
                         f"columns")


class RowRoute:
    """Where `route_row_lists` routes one row of a router of `experts` experts: buffers made once,
    read back as Python lists (a decode step's router builds no tensors)."""

    def __init__(self, experts: int):
        self.scores = (ctypes.c_float * experts)()
        self.ids = (ctypes.c_int64 * experts)()
        self.gates = (ctypes.c_float * experts)()
        self.expert_seconds, self.experts_done = ctypes.c_double(), ctypes.c_int()  # (decode_layer_front's)
        self.addresses = tuple(ctypes.addressof(b) for b in (self.scores, self.ids, self.gates, self.expert_seconds,
                                                             self.experts_done))


def route_row_lists(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    expert_bias: torch.Tensor | None, top_k: int, softmax: bool, route_norm: bool,
                    route_scale: float, into: RowRoute) -> tuple[list[int], list[float]]:
    """`route_row` as (ids, gates) lists of the k chosen experts, through `into`'s buffers: the
    same experts and the same f32 gates."""
    _route_row(x, weight, bias, expert_bias, top_k, softmax, route_norm, route_scale, *into.addresses[:3])
    return into.ids[:top_k], into.gates[:top_k]


def _route_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, expert_bias: torch.Tensor | None,
               top_k: int, softmax: bool, route_norm: bool, route_scale: float, scores: int, ids: int,
               gates: int) -> None:
    experts = weight.shape[0]
    if weight.shape[1:] != x.shape[-1:] or x.dim() != 1 or any(
            t is not None and t.shape != (experts,) for t in (bias, expert_bias)):
        raise ValueError(f"route_row: a row {tuple(x.shape)} does not fit a router {tuple(weight.shape)} "
                         f"(biases of {experts})")
    status = _library().colibri_route_row(
        x.data_ptr(), x.shape[-1], weight.data_ptr(), None if bias is None else bias.data_ptr(),
        None if expert_bias is None else expert_bias.data_ptr(), experts, top_k, int(softmax), int(route_norm),
        route_scale, scores, ids, gates)
    if status != 0:
        raise ValueError(f"route_row: {x.shape[-1]} columns (a multiple of 8) and top-{top_k} of {experts} experts")


class Projection(ctypes.Structure):
    """A resident q4 or q8 projection as decode_layer.c takes it (its `colibri_projection`)."""

    _fields_ = [("q8", ctypes.c_int64), ("flags", ctypes.c_int64), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("group", ctypes.c_int64), ("data", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("zeros", ctypes.c_void_p)]

    @classmethod
    def of(cls, encoding: str, weights: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
           fp16_scales: bool, cols: int, tiled: bool = False) -> Projection:
        """The addresses of a projection's tensors (which must outlive it); `tiled`: in row tiles."""
        if encoding not in ("q4", "q8") or cols % group or group % BLOCK or (tiled and not tileable(*weights.shape)):
            raise ValueError(f"a {encoding} projection of {cols} columns in groups of {group}"
                             f"{' in row tiles' if tiled else ''} is not the kernel's")
        return cls(int(encoding == "q8"), kernel_flags(fp16_scales, tiled), weights.shape[0], cols, group, weights.data_ptr(),
                   scales.data_ptr(), None if zeros is None else zeros.data_ptr())


FFN_OUTSIDE, FFN_DENSE, FFN_SHARED = 0, 1, 2
"""`LayerFront.ffn_kind`: what `decode_layers` does with the layer's `ffn` projections (gate, up,
down of a swiglu): nothing (the FFN runs elsewhere); run it as the layer's FFN (a dense layer);
add it to the routed experts' sum (a shared expert)."""


class LayerFront(ctypes.Structure):
    """One layer's decode row up to its FFN as decode_layer.c takes it (its `colibri_layer_front`):
    what does not change from token to token, built once; every address must outlive it."""

    _fields_ = [("qkv", Projection * 3), ("o", Projection), ("ffn", Projection * 3), ("ffn_kind", ctypes.c_int64)] + [
        (name, ctypes.c_void_p) for name in ("attn_norm", "q_norm", "k_norm", "ffn_norm")] + [
        (name, ctypes.c_double) for name in ("attn_eps", "q_eps", "k_eps", "ffn_eps", "attention_scale",
                                             "route_scale")] + [
        (name, ctypes.c_int64) for name in ("D", "heads", "kv_heads", "head_dim")] + [
        (name, ctypes.c_void_p) for name in ("router_weight", "router_bias", "expert_bias")] + [
        (name, ctypes.c_int64) for name in ("experts", "softmax", "route_norm")] + [
        (name, ctypes.c_void_p) for name in ("q", "k", "v", "attended", "scores")]


class TokenTable(ctypes.Structure):
    """A layer's cached swiglu experts as decode_layer.c looks them up (its `colibri_token_table`):
    expert e's `TOKEN_EXPERT_ADDRESSES` at entries[6 e:6 e + 6], zeros where e is not cached; `flags`:
    `kernel_flags` of the experts' matrices; `q8`: the experts are stored as q8 (`token_experts`'s)."""

    _fields_ = [("entries", ctypes.c_void_p), ("expert_dim", ctypes.c_int64), ("group_gate_up", ctypes.c_int64),
                ("group_down", ctypes.c_int64), ("flags", ctypes.c_int64), ("q8", ctypes.c_int64)]

    def __init__(self, experts: int, expert_dim: int, group_gate_up: int, group_down: int, flags: int,
                 q8: bool = False):
        self.slots = (ctypes.c_void_p * (TOKEN_EXPERT_ADDRESSES * experts))()
        super().__init__(ctypes.addressof(self.slots), expert_dim, group_gate_up, group_down, int(flags), int(q8))

    def matches(self, expert_dim: int, group_gate_up: int, group_down: int, flags: int, q8: bool = False) -> bool:
        return (self.expert_dim, self.group_gate_up, self.group_down, self.flags, self.q8) == (
            expert_dim, group_gate_up, group_down, int(flags), int(q8))

    def set(self, expert: int, addresses: tuple[int, ...]) -> None:
        self.slots[TOKEN_EXPERT_ADDRESSES * expert : TOKEN_EXPERT_ADDRESSES * (expert + 1)] = addresses

    def clear(self) -> None:
        ctypes.memset(self.slots, 0, ctypes.sizeof(self.slots))


class LayerOutcome:
    """What `decode_layer_front` returns: the row's routing and, when the table held every chosen
    expert, their sum (`experts_out`) and its time."""

    __slots__ = ("ids", "gates", "experts_out", "expert_seconds")

    def __init__(self, ids: list[int], gates: list[float], experts_out: torch.Tensor | None, expert_seconds: float):
        self.ids, self.gates, self.experts_out, self.expert_seconds = ids, gates, experts_out, expert_seconds


def decode_layer_front(front: LayerFront, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor, column: int, h_out: torch.Tensor,
                       x_out: torch.Tensor, top_k: int, into: RowRoute, table: TokenTable | None = None,
                       experts_out: torch.Tensor | None = None) -> LayerOutcome | None:
    """One decode row h [D] (f32, contiguous) of one session through a layer up to its FFN in one
    call (decode_layer.c): `attention_in`, the new key and value written at `column` of the cache
    keys / values ([1, kv_heads, capacity, head_dim] f32, unit stride along head_dim), `attend_row`
    over columns 0..column, `attention_out` into h_out and x_out; then, when the front has a router
    and top_k > 0, the row's routing as `route_row_lists` gives it (else None), and given a `table`
    that holds every chosen expert, `token_experts` of x_out into experts_out [D] (f32)."""
    if (keys.dtype != torch.float32 or values.dtype != torch.float32 or keys.stride(3) != 1
            or values.stride(3) != 1 or not 0 <= column < keys.shape[2] or keys.shape[1] != front.kv_heads
            or keys.shape[3] != front.head_dim or values.shape != keys.shape):
        raise ValueError(f"decode_layer_front: a cache {keys.dtype} {tuple(keys.shape)} does not take column "
                         f"{column} of {front.kv_heads} heads of {front.head_dim}")
    routed = top_k > 0 and front.router_weight is not None
    if table is not None and (experts_out is None or experts_out.dtype != torch.float32
                              or not experts_out.is_contiguous() or experts_out.numel() != front.D):
        raise ValueError(f"decode_layer_front: experts_out must be {front.D} contiguous f32 values")
    status = _library().colibri_decode_layer_front(
        ctypes.byref(front), h.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
        keys.stride(1), keys.stride(2), values.stride(1), values.stride(2), column, h_out.data_ptr(),
        x_out.data_ptr(), top_k if routed else 0, into.addresses[1], into.addresses[2],
        None if table is None else ctypes.addressof(table), None if table is None else experts_out.data_ptr(),
        into.addresses[3], into.addresses[4], torch.get_num_threads(), cpu_level())
    if status != 0:
        raise ValueError(f"decode_layer_front refused a row of {front.D} (heads of {front.head_dim}, top-{top_k} of "
                         f"{front.experts})")
    if not routed:
        return None
    done = into.experts_done.value == 1
    return LayerOutcome(into.ids[:top_k], into.gates[:top_k], experts_out if done else None,
                        into.expert_seconds.value if done else 0.0)


class DecodeLayer(ctypes.Structure):
    """One layer of a decode token as `decode_layers` runs it (decode_layer.c's
    `colibri_decode_layer`): `front` and `table` (a `TokenTable` or None: the caller runs the
    experts) by address, where this token's key and value go, this position's rotation rows, the
    routing's top_k and buffers; `finish` set: the caller completes the layer even when the call
    ran its experts. The call fills `experts_done` and `expert_seconds`."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("front", "table", "keys", "values")] + [
        (name, ctypes.c_int64) for name in ("key_head_stride", "key_col_stride", "value_head_stride",
                                            "value_col_stride")] + [
        (name, ctypes.c_void_p) for name in ("cos", "sin")] + [
        (name, ctypes.c_int64) for name in ("top_k", "finish")] + [
        (name, ctypes.c_void_p) for name in ("ids", "gates", "experts_out")] + [
        ("expert_seconds", ctypes.c_double), ("experts_done", ctypes.c_int64)]


def decode_layers(layers, first: int, end: int, column: int, h: torch.Tensor, h_out: torch.Tensor,
                  x_out: torch.Tensor, stopped: ctypes.c_int64) -> int:
    """A decode token through layers[first:end] (an array of `DecodeLayer`, every address filled)
    at cache column `column`: each layer's `decode_layer_front`, and where that ran the layer's
    experts and the layer is not the caller's to `finish`, h = h_out + experts_out, the next
    layer's input. h, h_out, x_out: [D] f32, contiguous (h updated in place). Returns the layer
    the caller must finish (its front done, h still its input), or `end`."""
    if not 0 <= first <= end <= len(layers):
        raise ValueError(f"decode_layers: layers {first}..{end} of {len(layers)}")
    status = _library().colibri_decode_layers(layers, first, end, column, h.data_ptr(), h_out.data_ptr(),
                                              x_out.data_ptr(), ctypes.byref(stopped), torch.get_num_threads(),
                                              cpu_level())
    if status != 0:
        raise ValueError(f"decode_layers refused layer {stopped.value} of {len(layers)}")
    return stopped.value


def attention_in(h: torch.Tensor, norm, qkv, q_norm, k_norm, cos: torch.Tensor, sin: torch.Tensor,
                 q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """One decode row h [D] (f32, contiguous): q, k, v (preallocated [heads, head_dim] f32) =
    the projections (`qkv`: an array of three `Projection`s) of rmsnorm(h) by `norm`, q and k normed
    per head by `q_norm` / `k_norm` (RMSNorm modules or None) and rotated by (cos, sin)."""
    status = _library().colibri_attention_in(
        h.data_ptr(), h.shape[0], norm.weight.data_ptr(), norm.eps, qkv,
        None if q_norm is None else q_norm.weight.data_ptr(), 0.0 if q_norm is None else q_norm.eps,
        None if k_norm is None else k_norm.weight.data_ptr(), 0.0 if k_norm is None else k_norm.eps,
        cos.data_ptr(), sin.data_ptr(), q.shape[0], k.shape[0], q.shape[1], q.data_ptr(), k.data_ptr(), v.data_ptr(),
        torch.get_num_threads(), cpu_level())
    if status != 0:
        raise ValueError(f"attention_in refused a row of {h.shape[0]} (a multiple of 32) or heads of {q.shape[1]}")


def attention_out(attn: torch.Tensor, o: Projection, h: torch.Tensor, h_out: torch.Tensor, norm,
                  x_out: torch.Tensor) -> None:
    """h_out = h + o(attn), x_out = rmsnorm(h_out) by `norm`: every row [D] f32 and contiguous."""
    status = _library().colibri_attention_out(attn.data_ptr(), ctypes.byref(o), h.data_ptr(), h_out.data_ptr(),
                                              norm.weight.data_ptr(), norm.eps, x_out.data_ptr(),
                                              torch.get_num_threads(), cpu_level())
    if status != 0:
        raise ValueError(f"attention_out refused an attention row of {o.cols} columns (a multiple of 32)")
