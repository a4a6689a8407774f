"""The quantization math: nibble layout, the Q4_0 rule, error levels, bf16 rounding, and the
torch int4 kernel convention that colibri-stream relies on."""

import numpy as np
import pytest
from colibri_int4.quantize import (
    bf16_bits_to_f32,
    dequantize_q4,
    dequantize_q8,
    f32_to_bf16_bits,
    quantize_q4,
    quantize_q8,
    unpack_nibbles,
)


def relative_rmse(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_nibble_layout_is_low_nibble_even_column():
    # one group of 32: values chosen so the symmetric scale is exactly 1 (max |w| = -8)
    row = np.array([-8, 1, 2, 3] + [0] * 28, dtype=np.float32)[None, :]
    q = quantize_q4(row, 32, True, "bf16")
    assert q.data.shape == (1, 16) and q.data.dtype == np.uint8
    # w = (q - 8) * s with s = -8 / -8 = 1: nibbles are w + 8
    assert q.data[0, 0] == (0 | (9 << 4)) and q.data[0, 1] == (10 | (11 << 4))
    assert unpack_nibbles(q.data)[0, :4].tolist() == [0, 9, 10, 11]
    assert bf16_bits_to_f32(q.scales)[0, 0] == 1.0


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_q4_error_is_bounded_and_the_extreme_is_exact(group, symmetric):
    rng = np.random.default_rng(group)
    w = rng.standard_normal((48, 256)).astype(np.float32)
    q = quantize_q4(w, group, symmetric, "fp16")
    back = dequantize_q4(q.data, q.scales, q.zeros, group, "fp16")
    err = relative_rmse(back, w)
    assert 0.02 < err < (0.13 if symmetric else 0.11)
    groups, back_groups = w.reshape(48, -1, group), back.reshape(48, -1, group)
    # max error per element is about half a step (plus clamp on the short side for Q4_0)
    step = np.abs(np.float32(q.scales.view(np.float16).astype(np.float32)))[..., None]
    assert np.all(np.abs(groups - back_groups) <= step * (1.0 if symmetric else 0.51) + 1e-6)
    if symmetric:  # Q4_0: the largest-magnitude weight of each group comes back exactly (fp16 scale)
        pick = np.argmax(np.abs(groups), axis=-1)[..., None]
        np.testing.assert_allclose(np.take_along_axis(back_groups, pick, -1), np.take_along_axis(groups, pick, -1), rtol=2e-3)


def grid_blocks(rng, rows, cols, group, spans):
    """Weights as a 4-bit file with a per-block minimum holds them (GGUF's Q4_1 / Q4_K): each
    group is `minimum + step * q`, with q in 0..span (Q4_K's search often leaves span < 15)."""
    n = cols // group
    step = rng.uniform(0.01, 0.05, (rows, n, 1)).astype(np.float32)
    minimum = rng.uniform(-0.4, -0.05, (rows, n, 1)).astype(np.float32)
    span = rng.choice(spans, (rows, n, 1))
    q = rng.integers(0, 16, (rows, n, group)) % (span + 1)
    q[..., 0], q[..., 1] = 0, span[..., 0]  # both ends used
    return (minimum + step * q.astype(np.float32)).reshape(rows, cols)


@pytest.mark.parametrize("spans", [(15,), (12, 13, 14)])
def test_asymmetric_groups_keep_the_grid_their_values_lie_on(spans):
    rng = np.random.default_rng(len(spans))
    w = grid_blocks(rng, 64, 256, 32, spans)
    q = quantize_q4(w, 32, False, "fp16")
    # exact up to the fp16 scale and zero (a step of 0.01-0.05 and a zero near 0.2 in fp16)
    assert relative_rmse(dequantize_q4(q.data, q.scales, q.zeros, 32, "fp16"), w) < 2e-3
    if spans != (15,):  # the min/max rule alone, (high - low) / 15, moves every weight of these groups
        low = w.reshape(64, -1, 32).min(-1, keepdims=True)
        wide = (w.reshape(64, -1, 32).max(-1, keepdims=True) - low) / 15
        moved = low + np.rint((w.reshape(64, -1, 32) - low) / wide) * wide
        assert relative_rmse(moved.reshape(w.shape), w) > 0.01


@pytest.mark.parametrize("low, high", [(-8, 7), (-7, 8), (-7, 7), (-6, 5), (-3, 6), (0, 5)])
def test_symmetric_groups_keep_the_grid_their_values_lie_on(low, high):
    """Q4_0 blocks from an importance-weighted (imatrix) search: `d * k` with the extreme anywhere,
    not at -8 steps where the max-magnitude rule would look for it."""
    rng = np.random.default_rng(high - low)
    rows, group = 64, 32
    step = rng.uniform(0.005, 0.05, (rows, 8, 1)).astype(np.float16).astype(np.float32)
    k = rng.integers(low, high + 1, (rows, 8, group))
    k[..., 0], k[..., 1] = low, high  # both ends used
    w = (step * k).reshape(rows, 8 * group)
    q = quantize_q4(w, group, True, "fp16")
    np.testing.assert_array_equal(dequantize_q4(q.data, q.scales, q.zeros, group, "fp16"), w)
    if low != -8 and high != 8:  # the extreme at neither -8 nor +8 steps: the rule moves the weights
        groups = w.reshape(rows, 8, group)
        pick = np.argmax(np.abs(groups), axis=-1)[..., None]
        rule = np.take_along_axis(groups, pick, axis=-1) / -8.0
        moved = (np.clip(np.rint(groups / rule), -8, 7) * rule).reshape(w.shape)
        assert relative_rmse(moved, w) > 0.01


def test_symmetric_groups_on_no_grid_keep_the_max_magnitude_rule():
    w = np.random.default_rng(4).standard_normal((16, 128)).astype(np.float32)
    w[0, :32] = (w[0, :32] * 4).round() / 4  # few levels, but more than 8 steps either side of zero
    q = quantize_q4(w, 32, True, "fp16")
    groups = w.reshape(16, -1, 32)
    pick = np.argmax(np.abs(groups), axis=-1)[..., None]
    expected = (np.take_along_axis(groups, pick, axis=-1)[..., 0] / -8.0).astype(np.float16)
    np.testing.assert_array_equal(q.scales.view(np.float16), expected)


def test_values_on_no_grid_keep_the_min_max_rule():
    w = np.random.default_rng(3).standard_normal((16, 128)).astype(np.float32)
    w[0, :32] = (w[0, :32] * 4).round() / 4  # few levels, but 33 apart in steps: no 16-level grid
    q = quantize_q4(w, 32, False, "fp16")
    groups = w.reshape(16, -1, 32)
    expected = ((groups.max(-1) - groups.min(-1)) / 15).astype(np.float16)
    np.testing.assert_array_equal(q.scales.view(np.float16), expected)


def test_smaller_groups_are_more_accurate():
    w = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32)
    errs = []
    for group in (32, 64, 128):
        q = quantize_q4(w, group, True, "bf16")
        errs.append(relative_rmse(dequantize_q4(q.data, q.scales, q.zeros, group, "bf16"), w))
    assert errs[0] < errs[1] < errs[2]


def test_constant_and_zero_groups_survive():
    w = np.zeros((2, 64), dtype=np.float32)
    w[1] = 0.5
    for symmetric in (True, False):
        q = quantize_q4(w, 32, symmetric, "bf16")
        np.testing.assert_allclose(dequantize_q4(q.data, q.scales, q.zeros, 32, "bf16"), w, atol=1e-3)


def test_q8_is_close_and_non_divisible_columns_are_refused():
    w = np.random.default_rng(1).standard_normal((16, 128)).astype(np.float32)
    q = quantize_q8(w, 64, "bf16")
    assert relative_rmse(dequantize_q8(q.data, q.scales, 64, "bf16"), w) < 0.01
    with pytest.raises(ValueError, match="not a multiple of the group size 64"):
        quantize_q8(np.zeros((2, 96), np.float32), 64, "bf16")


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(2).standard_normal(10_000).astype(np.float32) * 10.0 ** np.random.default_rng(3).integers(-8, 8, 10_000)
    x = x.astype(np.float32)
    ours = f32_to_bf16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(bf16_bits_to_f32(ours), torch.from_numpy(x).to(torch.bfloat16).float().numpy())


def test_plain_layout_repacks_into_torch_int4_kernels():
    """The file's convention w = (q - 8) * s + z is exactly torch's CPU int4 kernel's, after
    the runtime unpacks nibbles to int32 [N, K] and transposes scales/zeros to [K/G, N, 2]."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "_convert_weight_to_int4pack_for_cpu"):
        pytest.skip("this torch has no CPU int4 kernels")
    w = np.random.default_rng(4).standard_normal((64, 128)).astype(np.float32)
    q = quantize_q4(w, 32, False, "bf16")
    reference = dequantize_q4(q.data, q.scales, q.zeros, 32, "bf16")
    packed = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(unpack_nibbles(q.data).astype(np.int32)), 2)
    scales = torch.from_numpy(bf16_bits_to_f32(q.scales)).t()
    zeros = torch.from_numpy(bf16_bits_to_f32(q.zeros)).t()
    scales_and_zeros = torch.stack([scales, zeros], -1).to(torch.bfloat16).contiguous()
    x = torch.randn(5, 128).to(torch.bfloat16)
    out = torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros).float()
    expected = x.float() @ torch.from_numpy(reference).t()
    assert float((out - expected).abs().max()) < 0.05 * float(expected.abs().max())
