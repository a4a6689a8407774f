"""q4, q8 and q6 matrices in row tiles (native_kernel.tile_rows): the layout's bytes as its
definition says, and every kernel path that reads such a matrix gives a tiled one's results bit
for bit as the row-major one's, at each CPU level, for one row and many, alone and grouped, on one
thread and two; the engine holds its resident projections and experts tiled and decodes the same
tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from colibri_int4 import QuantScheme
from colibri_stream.compute import native_expert, native_kernel, native_linear
from colibri_stream.compute.expert_compute import DequantExpert
from colibri_stream.compute.native_expert import NativeQ4Expert, NativeQ8Expert
from colibri_stream.compute.native_kernel import (
    QuantizedActivations,
    q4_grouped,
    q4_matmul,
    q6_matmul,
    q8_matmul,
    tile_rows,
    tileable,
)

from .test_expert_compute import make_blob
from .test_native_kernel import LEVELS, _random_q4
from .test_native_q6 import random_q6


def _tiled_by_definition(packed: np.ndarray) -> np.ndarray:
    """Chunk c (64 bytes) of row 4t + r at 4t * row_bytes + c * 256 + r * 64."""
    rows, row_bytes = packed.shape
    out = np.empty(rows * row_bytes, dtype=np.uint8)
    for n in range(rows):
        t, r = divmod(n, 4)
        for c in range(row_bytes // 64):
            start = 4 * t * row_bytes + c * 256 + r * 64
            out[start : start + 64] = packed[n, 64 * c : 64 * (c + 1)]
    return out.reshape(rows, row_bytes)


def test_tiles_are_the_definitions_bytes_in_place_or_into_another_tensor_and_untile_back():
    rng = np.random.default_rng(0)
    packed = torch.from_numpy(rng.integers(0, 256, (12, 192), dtype=np.uint8))  # 384 columns: 3 chunks a row
    expected = _tiled_by_definition(packed.numpy())
    into = tile_rows(packed, torch.empty_like(packed))
    assert np.array_equal(into.numpy(), expected)
    in_place = packed.clone()
    assert tile_rows(in_place) is in_place and torch.equal(in_place, into)
    assert torch.equal(tile_rows(into, torch.empty_like(into), untile=True), packed)
    assert torch.equal(tile_rows(in_place, untile=True), packed)


def test_shapes_without_whole_tiles_are_refused_by_name():
    assert tileable(8, 256) and not tileable(6, 256) and not tileable(8, 288)  # q4 of 576 columns: 4.5 chunks
    for bad in (torch.zeros(6, 128, dtype=torch.uint8), torch.zeros(8, 288, dtype=torch.uint8),
                torch.zeros(8, 128, dtype=torch.int16), torch.zeros(8, 128, dtype=torch.uint8)[:, :64]):
        with pytest.raises(ValueError, match=r"tile_rows needs a contiguous uint8 or int8 \[N, row bytes\]"):
            tile_rows(bad)
    x = QuantizedActivations(torch.randn(1, 576))
    packed, scales, _, _ = _random_q4(8, 576, 64, np.random.default_rng(1), False, False)
    with pytest.raises(ValueError, match=r"or 8 x 576 in row tiles"):
        q4_matmul(x, packed, scales, None, 64, tiled=True)
    with pytest.raises(ValueError, match=r"or 8 x 544 in row tiles"):  # q8 rows of 544 bytes: 8.5 chunks
        q8_matmul(QuantizedActivations(torch.randn(1, 544)), torch.zeros(8, 544, dtype=torch.int8),
                  torch.zeros(8, 17, dtype=torch.int16), 32, tiled=True)
    with pytest.raises(ValueError, match=r"in row tiles is not the kernel's"):
        native_kernel.Projection.of("q8", torch.zeros(6, 256, dtype=torch.int8), scales, None, 64, False, 256,
                                    tiled=True)


def _same_bits_on_one_and_two_threads(product) -> None:
    """product(tiled) on the row-major matrix (False) and the tiled one (True): equal bits, on one
    thread and on two (the threads split the weight rows: no bit may move)."""
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(product(True), product(False))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("group", "zeros", "fp16"), [(32, False, False), (32, True, True), (64, False, False),
                                                      (64, True, False), (128, False, True)])
@pytest.mark.parametrize("rows", [1, 3, 5, 40])  # one decode row; a tile of rows; more than a tile; a chunk
def test_a_tiled_matrix_gives_the_row_major_bits_on_every_path(level, group, zeros, fp16, rows):
    rng = np.random.default_rng(group + rows)
    cols, out_rows = 512, 52  # 52 rows: three blocks of 16 and a last one of 4
    packed, scales, zero, _ = _random_q4(out_rows, cols, group, rng, zeros, fp16)
    tiled = tile_rows(packed, torch.empty_like(packed))
    x = QuantizedActivations(torch.from_numpy(rng.normal(0, 1, (rows, cols)).astype(np.float32)))
    _same_bits_on_one_and_two_threads(
        lambda tiles: q4_matmul(x, tiled if tiles else packed, scales, zero, group, fp16, level, tiled=tiles))
    # several matrices at once, each on its own rows (a decode step's experts; a prefill chunk's)
    other, other_scales, other_zero, _ = _random_q4(out_rows, cols, group, rng, zeros, fp16)
    picked = [list(range(rows)), [r for r in range(rows) if r % 2 == 0]]
    expected = q4_grouped(x, [(packed, scales, zero), (other, other_scales, other_zero)], picked, group, fp16, level)
    got = q4_grouped(x, [(tiled, scales, zero), (tile_rows(other.clone()), other_scales, other_zero)], picked,
                     group, fp16, level, tiled=True)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("group", "fp16"), [(32, False), (64, True), (128, False)])
@pytest.mark.parametrize("rows", [1, 3, 5, 40])
def test_a_tiled_q8_matrix_gives_the_row_major_bits(level, group, fp16, rows):
    rng = np.random.default_rng(group + rows)
    cols, out_rows = 384, 52  # 6 chunks a row; rows in pairs, fours and a last block of 4
    weights = torch.from_numpy(rng.integers(-128, 128, (out_rows, cols)).astype(np.int8))
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, (out_rows, cols // group)).astype(np.float32)).to(
        torch.float16 if fp16 else torch.bfloat16).view(torch.int16)
    tiled = tile_rows(weights, torch.empty_like(weights))
    assert np.array_equal(tiled.view(torch.uint8).numpy(), _tiled_by_definition(weights.view(torch.uint8).numpy()))
    x = QuantizedActivations(torch.from_numpy(rng.normal(0, 1, (rows, cols)).astype(np.float32)))
    _same_bits_on_one_and_two_threads(
        lambda tiles: q8_matmul(x, tiled if tiles else weights, scales, group, fp16, level, tiled=tiles))
    dense = torch.randn(3, cols)
    assert torch.equal(native_kernel.dense_matmul(dense, tiled, scales, None, group, "q8", fp16, tiled=True),
                       native_kernel.dense_matmul(dense, weights, scales, None, group, "q8", fp16))


def _q6_tiled_by_definition(data: np.ndarray) -> np.ndarray:
    """Chunk c of row 4t + r (its 64 low bytes, then its 32 top-bit bytes) at
    4t * row_bytes + c * 384 + r * 96."""
    rows, row_bytes = data.shape
    lows = row_bytes // 3 * 2  # K / 2
    out = np.empty(rows * row_bytes, dtype=np.uint8)
    for n in range(rows):
        t, r = divmod(n, 4)
        for c in range(row_bytes // 96):
            start = 4 * t * row_bytes + c * 384 + r * 96
            out[start : start + 64] = data[n, 64 * c : 64 * (c + 1)]
            out[start + 64 : start + 96] = data[n, lows + 32 * c : lows + 32 * (c + 1)]
    return out.reshape(rows, row_bytes)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("group", "fp16"), [(32, False), (64, True)])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_a_tiled_q6_matrix_gives_the_row_major_bits(level, group, fp16, rows):
    rng = np.random.default_rng(group + rows)
    cols, out_rows = 384, 52
    data, scales, _ = random_q6(out_rows, cols, group, rng, fp16)
    tiled = tile_rows(data, torch.empty_like(data), q6=True)
    assert np.array_equal(tiled.numpy(), _q6_tiled_by_definition(data.numpy()))
    assert torch.equal(tile_rows(tiled.clone(), untile=True, q6=True), data)
    x = QuantizedActivations(torch.from_numpy(rng.normal(0, 1, (rows, cols)).astype(np.float32)))
    _same_bits_on_one_and_two_threads(
        lambda tiles: q6_matmul(x, tiled if tiles else data, scales, group, fp16, level, tiled=tiles))
    dense = torch.randn(3, cols)
    assert torch.equal(native_kernel.dense_matmul(dense, tiled, scales, None, group, "q6", fp16, tiled=True),
                       native_kernel.dense_matmul(dense, data, scales, None, group, "q6", fp16))
    with pytest.raises(ValueError, match=r"or 52 x 320 in row tiles"):  # 320 columns: 2.5 chunks
        q6_matmul(QuantizedActivations(torch.randn(1, 320)), torch.zeros(52, 240, dtype=torch.uint8),
                  torch.zeros(52, 10, dtype=torch.int16), 32, tiled=True)


@pytest.mark.parametrize("encoding_zeros", [False, True])
def test_dequantized_rows_of_a_tiled_matrix_are_the_row_major_ones(monkeypatch, encoding_zeros):
    rng = np.random.default_rng(7)
    packed, scales, zero, weight = _random_q4(20, 256, 64, rng, encoding_zeros, False)
    monkeypatch.setattr(native_kernel, "DEQUANT_BLOCK_WEIGHTS", 256 * 6)  # blocks of 6 rows -> whole tiles of 4
    x = torch.randn(3, 256)
    expected = native_kernel.dense_matmul(x, packed, scales, zero, 64, "q4")
    got = native_kernel.dense_matmul(x, tile_rows(packed.clone()), scales, zero, 64, "q4", tiled=True)
    assert torch.equal(got, expected)
    assert torch.allclose(expected.double(), x.double() @ torch.from_numpy(weight).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("group", "symmetric", "kind"), [(32, False, NativeQ4Expert), (64, True, NativeQ4Expert),
                                                          (64, True, NativeQ8Expert)])
def test_experts_are_held_tiled_and_a_tokens_experts_give_the_row_major_bits(group, symmetric, kind, monkeypatch):
    """An expert whose matrices have whole tiles is copied into them; a token's experts in one
    call, the two calls around the activation, and a prefill chunk's rows give what the same
    experts held row-major give, bit for bit."""
    q8 = kind is NativeQ8Expert
    scheme = QuantScheme(group_size=group, symmetric=symmetric, scale_dtype="bf16",
                         expert_dtype="int8" if q8 else "int4")
    blobs = [make_blob(256, 256, scheme, seed=20 + e)[0] for e in range(3)]  # 256: 2 (q4) or 4 (q8) chunks a row

    def experts():
        return [kind(blob, DequantExpert(blob, torch.float32).glu) for blob in blobs]

    tiled = experts()
    monkeypatch.setattr(native_expert, "tileable", lambda *shape, **kind: False)
    row_major = experts()
    assert all(e.tiled for e in tiled) and not any(e.tiled for e in row_major)
    assert not torch.equal(tiled[0].gate_up, row_major[0].gate_up)
    assert torch.equal(tile_rows(tiled[0].down.clone(), untile=True), row_major[0].down)
    x, weights = torch.randn(256), [0.5, 0.3, 0.2]
    outs = []
    for held in (tiled, row_major):
        out = torch.zeros(256)
        assert kind.forward_token(held, x, weights, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    chunk = torch.randn(9, 256)  # a prefill chunk's rows through one expert
    assert torch.equal(tiled[1].forward(chunk), row_major[1].forward(chunk))
    each = QuantizedActivations(chunk[:1])
    assert torch.equal(kind.forward_each(tiled, each), kind.forward_each(row_major, each))


@pytest.mark.parametrize(("resident_dtype", "embed_dtype"), [("int4", "bf16"), ("int8", "int8"), ("int4", "int6")])
def test_the_engine_holds_projections_and_experts_in_tiles_and_decodes_the_same_tokens(tmp_path, monkeypatch,
                                                                                     resident_dtype, embed_dtype):
    """A model whose resident q4 projections and experts have whole tiles (the shared expert's
    down projection, 64 columns, has not): the engine holds what it can tiled, and its logits,
    prefill and one token at a time, are the bits of the same engine holding everything row-major."""
    from colibri_stream import Engine

    from .conftest import build_container

    container, _ = build_container(tmp_path, QuantScheme(group_size=64, resident_dtype=resident_dtype,
                                                         embed_dtype=embed_dtype), seed=3,
                                   d_model=256, n_heads=8, expert_dim=256)
    ids = torch.arange(5, 29)

    def run():
        with Engine.open(container, ram_budget="200MB", compute="native", prefill_chunk=8) as eng:
            linears = [m for m in eng.model.modules() if isinstance(m, native_linear.NativeLinear)]
            tiles = {m.tiled for m in linears if m.encoding in ("q4", "q8", "q6")}
            head = eng.model.lm_head
            assert head.encoding == {"bf16": "bf16", "int8": "q8", "int6": "q6"}[embed_dtype]
            tiles.add(("head", getattr(head, "tiled", False)))
            logits = eng.logits(ids)
            session = eng.session()
            steps = torch.stack([session.append([int(t)]).reshape(-1) for t in ids[:8]])
        return tiles, logits, steps

    tiles, logits, steps = run()
    head = {("head", embed_dtype != "bf16")}
    assert tiles == ({True, False} if resident_dtype == "int4" else {True}) | head  # q8 rows of 64 bytes: whole chunks
    monkeypatch.setattr(native_linear, "tileable", lambda *shape, **kind: False)
    monkeypatch.setattr(native_expert, "tileable", lambda *shape, **kind: False)
    row_major, expected_logits, expected_steps = run()
    assert row_major == {False, ("head", False)}
    assert torch.equal(logits, expected_logits)
    assert torch.equal(steps, expected_steps)
