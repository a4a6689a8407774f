"""The native q4 kernel: its int8 activations and dot products against a float64 definition, at
each CPU level this machine runs; the expert built on it against the dequantized reference; the
one-token decode path against the batched one; the engine end to end; and its absence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from colibri_int4 import QuantScheme
from colibri_stream import Engine
from colibri_stream.compute import native_kernel
from colibri_stream.compute.expert_compute import DequantExpert
from colibri_stream.compute.native_expert import NativeQ4Expert, native_nbytes, native_supported
from colibri_stream.compute.native_kernel import (
    AVX2,
    AVX512_VNNI,
    SCALAR,
    QuantizedActivations,
    bf16_matmul,
    q4_experts,
    q4_matmul,
    q8_matmul,
)
from colibri_stream.compute.streamed_experts import StreamedExperts
from colibri_stream.stats import StreamStats

from .test_expert_compute import make_blob

LEVELS = list(range(native_kernel._library().colibri_q4_cpu_level() + 1))  # each level this CPU runs


def test_every_x86_machine_we_run_on_has_the_avx2_path():
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        assert LEVELS[:2] == [SCALAR, AVX2]  # CI runs AVX2 to AVX-512 machines: the fast path must be tested


def test_the_vnni_level_gives_the_avx2_bits():
    """AVX-512 VNNI sums the same int32 lanes as AVX2's multiply-adds, so a level change on a
    capable machine changes no result (q4 in its one- and two-block paths, and q8)."""
    if AVX512_VNNI not in LEVELS:
        pytest.skip("this CPU has no AVX-512 VNNI (the AVX2 path is tested on its own)")
    rng = np.random.default_rng(3)
    # 1024 in groups of 64 or 128: the 512-bit paths' epilogue in vector lanes; 576 (SmolLM2's width,
    # 18 blocks): the 512-bit paths end on a step of two blocks
    for cols in (256, 576, 1024):
        x = QuantizedActivations(torch.from_numpy(rng.normal(0, 1, (6, cols)).astype(np.float32)))
        for group, zeros in ((32, False), (32, True), (64, True), (64, False), (128, False), (128, True)):
            if cols % group:
                continue
            packed, scales, zero, _ = _random_q4(40, cols, group, rng, zeros, False)
            avx2 = q4_matmul(x, packed, scales, zero, group, level=AVX2)
            assert torch.equal(avx2, q4_matmul(x, packed, scales, zero, group, level=AVX512_VNNI))
            for row in range(6):  # one row alone: the decode path
                alone = q4_matmul(x[torch.tensor([row])], packed, scales, zero, group, level=AVX512_VNNI)[0]
                assert torch.equal(alone, avx2[row])
    x = QuantizedActivations(torch.from_numpy(rng.normal(0, 1, (6, 256)).astype(np.float32)))
    weights = torch.from_numpy(rng.integers(-128, 128, (24, 256)).astype(np.int8))
    bits = torch.full((24, 4), 0.01).to(torch.bfloat16).view(torch.int16)
    assert torch.equal(q8_matmul(x, weights, bits, 64, level=AVX2), q8_matmul(x, weights, bits, 64, level=AVX512_VNNI))


def _q8_definition(x: np.ndarray):
    """Per 32 columns: scale = max|x| / 127, q = round-half-even(x / scale) in [-127, 127]."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = np.abs(blocks).max(-1) / 127
    q = np.clip(np.rint(blocks / np.where(scale > 0, scale, 1)[..., None]), -127, 127)
    return q, scale.astype(np.float32)


def test_activations_are_int8_blocks():
    x = torch.randn(3, 96)
    x[1, :32] = 0  # an all-zero block: scale 0, no division by zero
    got = QuantizedActivations(x)
    q, scale = _q8_definition(x.double().numpy())
    assert np.allclose(got.scales.numpy(), scale, rtol=1e-6)
    assert np.array_equal(got.q.numpy().reshape(3, -1, 32), q.astype(np.int8))
    assert np.array_equal(got.sums.numpy(), q.sum(-1).astype(np.int32))
    picked = got[torch.tensor([2, 0])]
    assert torch.equal(picked.q, got.q[[2, 0]]) and picked.rows == 2


@pytest.mark.parametrize("cols", [32, 96, 1024])
def test_every_level_quantizes_activations_to_the_same_bits(cols):
    """The AVX2 quantizer rounds as the scalar one does, so a row quantized at any level feeds every
    kernel the same bytes, scales and sums."""
    rng = np.random.default_rng(cols)
    x = torch.from_numpy(rng.normal(0, 1, (5, cols)).astype(np.float32))
    x[0, :32] = 0  # scale 0
    x[1, :32] = -0.0
    x[2, 5] = 1e4  # one block's scale set by one large value
    x[3, :32] = torch.arange(32) - 15.5  # halves, and with the block's max 127 its scale is exactly 1:
    x[3, 31] = 127.0  # the products are .5 ties, rounded to even on every level
    reference = QuantizedActivations(x, level=SCALAR)
    for level in LEVELS[1:]:
        got = QuantizedActivations(x, level=level)
        assert torch.equal(got.bytes_, reference.bytes_), level
        assert torch.equal(got.words.view(torch.int32), reference.words.view(torch.int32)), level


def _random_q4(rows: int, cols: int, group: int, rng, zeros: bool, fp16: bool):
    nibbles = rng.integers(0, 16, (rows, cols))
    packed = torch.from_numpy((nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8))
    dtype = torch.float16 if fp16 else torch.bfloat16
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, (rows, cols // group)).astype(np.float32)).to(dtype)
    zero = torch.from_numpy(rng.normal(0, 0.02, (rows, cols // group)).astype(np.float32)).to(dtype) if zeros else None
    weight = (nibbles - 8) * np.repeat(scales.double().numpy(), group, 1)
    if zeros:
        weight = weight + np.repeat(zero.double().numpy(), group, 1)
    def bits(t):
        return None if t is None else t.view(torch.int16)

    return packed, bits(scales), bits(zero), weight


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("group", "zeros", "fp16", "cols"), [
    (32, False, False, 512), (32, True, True, 512), (64, True, True, 512), (128, False, True, 512),
    (256, True, False, 512),
    (32, True, True, 576), (64, False, False, 576)])  # 576: 18 blocks, the 512-bit paths' last step of two
def test_matmul_is_the_q4_times_q8_definition(level, group, zeros, fp16, cols):
    rng = np.random.default_rng(group)
    rows = 48
    packed, scales, zero, weight = _random_q4(rows, cols, group, rng, zeros, fp16)
    x = torch.from_numpy(rng.normal(0, 1, (5, cols)).astype(np.float32))
    q, xscale = _q8_definition(x.double().numpy())
    exact_x = (q * xscale[..., None].astype(np.float64)).reshape(5, cols)  # the int8 activations, exactly
    # the zeros too multiply the int8 activations: the product of the two dequantized matrices
    expected = exact_x @ weight.T
    got = q4_matmul(QuantizedActivations(x), packed, scales, zero, group, fp16, level=level).double().numpy()
    assert np.abs(got - expected).max() < 1e-5 * max(1.0, np.abs(expected).max())
    # and close to the float product: the int8 rounding of activations is all that differs
    float_product = x.double().numpy() @ weight.T
    assert np.linalg.norm(got - float_product) < 0.02 * np.linalg.norm(float_product)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("group", "fp16", "tiny"), [(32, False, False), (128, True, False), (32, True, True)])
def test_q8_weights_are_the_q8_times_q8_definition(level, group, fp16, tiny):
    rng = np.random.default_rng(group + 1)
    rows, cols = 40, 256
    weights = rng.integers(-128, 128, (rows, cols)).astype(np.int8)  # -128 included: the sign trick's edge
    dtype = torch.float16 if fp16 else torch.bfloat16
    # tiny: fp16 scales from subnormal (under 6.1e-5) to normal, each converted exactly
    low, high = (1e-7, 2e-4) if tiny else (0.001, 0.01)
    scales = torch.from_numpy(rng.uniform(low, high, (rows, cols // group)).astype(np.float32)).to(dtype)
    weight = weights * np.repeat(scales.double().numpy(), group, 1)
    x = torch.from_numpy(rng.normal(0, 1, (3, cols)).astype(np.float32))
    q, xscale = _q8_definition(x.double().numpy())
    expected = (q * xscale[..., None].astype(np.float64)).reshape(3, cols) @ weight.T
    got = q8_matmul(QuantizedActivations(x), torch.from_numpy(weights), scales.view(torch.int16), group, fp16,
                    level=level).double().numpy()
    assert np.abs(got - expected).max() < 1e-5 * max(1.0, np.abs(expected).max())


def test_levels_agree_and_threads_do_not_change_a_bit():
    rng = np.random.default_rng(7)
    packed, scales, _, _ = _random_q4(64, 256, 64, rng, False, False)
    x = QuantizedActivations(torch.from_numpy(rng.normal(0, 1, (2, 256)).astype(np.float32)))
    results = [q4_matmul(x, packed, scales, None, 64, level=level) for level in LEVELS]
    for other in results[1:]:  # the same sums in another order
        assert (results[0] - other).abs().max() <= 1e-5 * results[0].abs().max()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(q4_matmul(x, packed, scales, None, 64), q4_matmul(x, packed, scales, None, 64))
        two = q4_matmul(x, packed, scales, None, 64)
        torch.set_num_threads(1)
        assert torch.equal(two, q4_matmul(x, packed, scales, None, 64))  # rows are independent
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("level", LEVELS)
# 1024: 8 or 16 groups, the epilogue in vector lanes; 576: 18 blocks, a last step of two
@pytest.mark.parametrize(("group", "zeros", "cols"), [
    (group, zeros, cols) for group, zeros in [(32, False), (32, True), (64, True), (128, False)]
    for cols in (256, 576, 1024) if cols % group == 0])
def test_rows_in_tiles_and_experts_together_are_bitwise_each_alone(level, group, zeros, cols):
    """Rows share weight loads 4 at a time (on AVX-512 cores 4 rows take 8 weight rows at a time in
    512-bit vectors), one row takes weight rows 4 at a time (8 in 512-bit vectors; 42: a short group
    at the end of each block of 16), and a token's experts share one call; none may change a bit of
    any row's result (7 rows: a full tile and a short one)."""
    rng = np.random.default_rng(group)
    matrices = [_random_q4(42, cols, group, rng, zeros, False)[:3] for _ in range(3)]
    x = QuantizedActivations(torch.from_numpy(rng.normal(0, 1, (7, cols)).astype(np.float32)))
    alone = [[q4_matmul(x[torch.tensor([i])], *m, group, level=level)[0] for i in range(7)] for m in matrices]
    together = q4_matmul(x, *matrices[0], group, level=level)
    assert all(torch.equal(together[i], alone[0][i]) for i in range(7))
    every = q4_experts(x, matrices, group, row_each=False, level=level).reshape(3, 7, -1)
    assert all(torch.equal(every[e, i], alone[e][i]) for e in range(3) for i in range(7))
    each = q4_experts(x[torch.arange(3)], matrices, group, row_each=True, level=level)
    assert all(torch.equal(each[e], alone[e][e]) for e in range(3))
    # 42 q8 rows: blocks of 16, 16 and 10 (one row's path takes 4 weight rows a call, then 2 alone)
    weights = torch.from_numpy(rng.integers(-128, 128, (42, cols)).astype(np.int8))
    scales = torch.from_numpy(rng.uniform(0.001, 0.01, (42, cols // group)).astype(np.float32)).to(torch.bfloat16)
    rows8 = q8_matmul(x, weights, scales.view(torch.int16), group, level=level)
    assert all(torch.equal(rows8[i], q8_matmul(x[torch.tensor([i])], weights, scales.view(torch.int16), group,
                                               level=level)[0]) for i in range(7))
    with pytest.raises(ValueError, match="3 matrices, one row each, but 7"):
        q4_experts(x, matrices, group, row_each=True)


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_bf16_weights_give_the_same_bits_at_every_level_and_each_row_what_it_gets_alone(rows):
    torch.manual_seed(rows)
    weights = (torch.randn(40, 96) * 0.1).bfloat16()  # 40: a partial block of 16 weight rows
    x = torch.randn(rows, 96)
    outs = [bf16_matmul(x, weights.view(torch.int16), level=level) for level in LEVELS]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])  # the portable code runs AVX2's order lane for lane
    alone = torch.cat([bf16_matmul(x[r:r + 1], weights.view(torch.int16)) for r in range(rows)])
    assert torch.equal(alone, outs[0])
    exact = x.double() @ weights.double().T  # each product is exact; only f32 sums round
    assert (outs[0].double() - exact).abs().max() < 1e-5 * max(1.0, float(exact.abs().max()))
    with pytest.raises(ValueError, match="multiple of 16"):
        bf16_matmul(torch.randn(1, 24), torch.zeros(4, 24, dtype=torch.int16))


def test_bad_shapes_are_refused_with_the_shapes():
    x = QuantizedActivations(torch.randn(1, 64))
    with pytest.raises(ValueError, match="do not fit 64 columns"):
        q4_matmul(x, torch.zeros(16, 16, dtype=torch.uint8), torch.zeros(16, 2, dtype=torch.int16), None, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedActivations(torch.randn(1, 48))


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", ["bf16", "fp16"])
def test_native_expert_matches_the_dequantized_reference(group, symmetric, scale_dtype):
    scheme = QuantScheme(group_size=group, symmetric=symmetric, scale_dtype=scale_dtype)
    blob, layout = make_blob(128, 256, scheme)
    assert native_supported(layout, 128, 256) is None
    x = torch.randn(7, 128)
    fast, slow = NativeQ4Expert(blob, DequantExpert(blob, torch.float32).glu), DequantExpert(blob, torch.float32)
    expected = slow.forward(x)
    got = fast.forward(x)
    assert got.dtype == torch.float32
    assert (got - expected).norm() < 0.02 * expected.norm()
    assert torch.equal(got, fast.forward(QuantizedActivations(x)))
    assert fast.nbytes == native_nbytes(layout, 128, 256)
    slot = torch.zeros(fast.nbytes, dtype=torch.uint8)
    fast.move_into(slot)
    assert torch.equal(fast.forward(x), got)  # the slab copy computes the same


class _OneSlotCache:
    """Hands StreamedExperts a prepared expert per id, with no I/O."""

    def __init__(self, experts):
        self.experts, self.prefetcher = experts, None

    def get(self, layer, expert, pinned=(), hold=()):
        return self.experts[expert]


class _AllCached(_OneSlotCache):
    """Every expert cached: what a prefill at full RAM sees (`get_layer`, membership)."""

    def __init__(self, experts):
        super().__init__(experts)
        self.layers_taken = 0

    def __contains__(self, key):
        return key[1] in self.experts

    def get_layer(self, layer, experts, pinned=()):
        self.layers_taken += 1
        return [self.experts[e] for e in experts]


@pytest.mark.parametrize(("group", "symmetric"), [(32, False), (64, True)])
def test_a_prefill_chunk_of_cached_experts_in_one_go_is_bitwise_each_expert_in_turn(group, symmetric):
    """A prefill chunk whose experts are all cached runs them in three kernel calls and one sum;
    each token's row is bitwise what each expert in turn gives (the path where some must be read)."""
    scheme = QuantScheme(group_size=group, symmetric=symmetric, scale_dtype="bf16")
    experts = {}
    for e in range(6):
        blob, _ = make_blob(64, 64, scheme, seed=e)
        experts[e] = NativeQ4Expert(blob, DequantExpert(blob, torch.float32).glu)
    cached = _AllCached(experts)
    together = StreamedExperts(1, 6, 64, cached, StreamStats(), quantize=QuantizedActivations)
    in_turn = StreamedExperts(1, 6, 64, _OneSlotCache(experts), StreamStats(), quantize=QuantizedActivations)
    x = torch.randn(40, 64)  # more rows than a few sessions' decode step: a prefill chunk
    generator = torch.Generator().manual_seed(group)
    ids = torch.stack([torch.randperm(5, generator=generator)[:2] for _ in range(40)])  # expert 5 unused
    ids[3] = torch.tensor([4, 0])  # a row whose experts come in descending order
    gates = torch.rand(40, 2, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        got = together.forward(x, ids, gates)
        torch.set_num_threads(2)  # the threads split the experts' tasks by rows: no bit may move
        assert torch.equal(together.forward(x, ids, gates), got)
    finally:
        torch.set_num_threads(threads)
    assert cached.layers_taken == 2
    assert torch.equal(got, in_turn.forward(x, ids, gates))
    assert torch.allclose(got, in_turn.reference_forward(x, ids, gates), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("group", "symmetric", "scale_dtype"), [(32, True, "bf16"), (64, True, "bf16"),
                                                                  (64, False, "fp16")])  # 64: the two-block path
def test_one_token_decode_path_is_bitwise_the_batched_path(group, symmetric, scale_dtype, monkeypatch):
    """One token's experts in two kernel calls (`forward_token`) against a few tokens' grouped
    calls, bit for bit, and both near the per-(token, slot) reference."""
    taken = []
    forward_token = NativeQ4Expert.forward_token
    monkeypatch.setattr(NativeQ4Expert, "forward_token",
                        staticmethod(lambda *a: taken.append(1) or forward_token(*a)))
    scheme = QuantScheme(group_size=group, symmetric=symmetric, scale_dtype=scale_dtype)
    experts = {}
    for e in range(4):
        blob, _ = make_blob(64, 64, scheme, seed=e)
        experts[e] = NativeQ4Expert(blob, DequantExpert(blob, torch.float32).glu)
    layer = StreamedExperts(1, 4, 64, _OneSlotCache(experts), StreamStats(), quantize=QuantizedActivations)
    x = torch.randn(3, 64)
    ids = torch.tensor([[2, 0], [1, 3], [3, 0]])
    gates = torch.rand(3, 2)
    batched = layer.forward(x, ids, gates)
    for row in range(3):
        one = layer.forward(x[row : row + 1], ids[row : row + 1], gates[row : row + 1])
        assert torch.equal(one[0], batched[row])
    assert len(taken) == 3  # each single token took the two-call path
    assert torch.allclose(batched, layer.reference_forward(x, ids, gates), rtol=1e-5, atol=1e-6)
    matrices = native_kernel.TokenExperts([experts[0].addresses[1]], 64, 64, group, scale_dtype == "fp16")
    with pytest.raises(ValueError, match=r"hidden \(2, 64\), out \(64,\) and 1 weights do not fit 1 matrices"):
        native_kernel.token_experts_out(torch.zeros(2, 64), matrices, [1.0], torch.zeros(64))
    with pytest.raises(ValueError, match=r"token_experts_in: a row torch.float32 \(32,\) does not fit 1 matrices"):
        native_kernel.token_experts_in(torch.zeros(32), matrices)


def test_swiglu_is_torchs_to_rounding_and_each_row_what_it_gets_alone():
    gate = torch.cat([torch.randn(9, 96) * 6, torch.tensor([[-200.0, 120.0, 0.0, -0.0] * 24])])
    gate_up = torch.cat([gate, torch.randn(10, 96)], 1)  # [10, 2F]: gate | up, with the extremes
    got = native_kernel.swiglu_rows(gate_up)
    gate, up = gate_up.split(96, dim=-1)
    expected = torch.nn.functional.silu(gate.double()) * up.double()
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), expected, rtol=4e-7, atol=1e-30)  # a few ulp: exp's polynomial
    for row in range(10):
        assert torch.equal(native_kernel.swiglu_rows(gate_up[row : row + 1]), got[row : row + 1])
    for level in range(native_kernel.cpu_level() + 1):  # the portable loop and the vector lanes alike
        at_level = torch.empty_like(got)
        native_kernel._library().colibri_swiglu_rows(gate_up.data_ptr(), 10, 96, at_level.data_ptr(), level)
        assert torch.equal(at_level, got), level
    with pytest.raises(ValueError, match=r"f32 rows of gate \| up \[M, 2F\], got torch.float32 \(3,\)"):
        native_kernel.swiglu_rows(torch.zeros(3))


@pytest.mark.parametrize(("group", "symmetric"), [(32, True), (64, False)])
def test_a_tokens_experts_in_one_call_are_bitwise_the_two_calls_around_the_activation(group, symmetric):
    scheme = QuantScheme(group_size=group, symmetric=symmetric, scale_dtype="bf16")
    experts = []
    for e in range(3):
        blob, _ = make_blob(128, 64, scheme, seed=10 + e)
        experts.append(NativeQ4Expert(blob, DequantExpert(blob, torch.float32).glu))
    x, weights = torch.randn(128), [0.5, 0.3, 0.2]
    whole = torch.randn(128)
    apart = whole.clone()
    assert NativeQ4Expert.forward_token(experts, x, weights, whole)
    gate_up = native_kernel.token_experts_in(x, native_kernel.TokenExperts(
        [e.addresses[0] for e in experts], 128, 128, group, False))
    native_kernel.token_experts_out(native_kernel.swiglu_rows(gate_up), native_kernel.TokenExperts(
        [e.addresses[1] for e in experts], 128, 64, group, False), weights, apart)
    assert torch.equal(whole, apart)
    addresses = [a for e in experts for a in e.token_addresses]
    with pytest.raises(ValueError, match=r"token_experts: a row \(128,\) into out \(64,\) does not fit 3 experts"):
        native_kernel.token_experts(x, addresses, 64, group, group, False, weights, torch.zeros(64))
    with pytest.raises(ValueError, match=r"\(12 addresses"):
        native_kernel.token_experts(x, addresses[:12], 64, group, group, False, weights, whole)


def assert_near_reference(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Typical logits within 3% of the logit scale, and the same best token almost everywhere: a
    near-tie of a router can flip an expert under any rounding (torch's bf16 kernel too), which
    moves that position's logits a lot, so the bound is on the median position."""
    scale = max(1.0, expected.abs().max().item())
    assert (got - expected).abs().max(-1).values.median().item() < 3e-2 * scale
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9


def test_engine_runs_native_and_stays_near_the_reference(tiny, reference):
    ids = torch.arange(3, 43)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    with Engine.open(tiny[0], ram_budget="200MB", compute="native", prefill_chunk=16) as eng:
        got = eng.logits(ids)
        assert eng.stats.compute_mode == "native"
        session = eng.session()
        streamed = torch.stack([session.append([int(t)]).reshape(-1) for t in ids])  # one token at a time
    assert_near_reference(got, expected)
    # one token at a time through the KV cache: attention sums in another order, and an int8
    # rounding of the activations can land the other way, so near, not equal
    assert_near_reference(streamed, got)


def test_without_a_compiler_native_is_refused_by_name_and_auto_falls_back(tiny, monkeypatch):
    monkeypatch.setattr(native_kernel, "_compiler", lambda: None)
    native_kernel._library.cache_clear()
    try:
        assert "no C compiler" in native_kernel.kernel_unavailable()
        with pytest.raises(ValueError, match="compute='native' is not possible: no C compiler"):
            Engine.open(tiny[0], ram_budget="200MB", compute="native")
        with Engine.open(tiny[0], ram_budget="200MB", compute="auto") as eng:
            assert eng.stats.compute_mode != "native"
    finally:
        native_kernel._library.cache_clear()


@pytest.mark.parametrize("resident_dtype", ["int8", "int4"])
def test_native_engine_holds_resident_projections_as_stored(tmp_path, resident_dtype):
    from colibri_model import load_checkpoint
    from colibri_stream.compute.native_linear import NativeLinear

    from .conftest import build_container

    container, checkpoint = build_container(tmp_path, QuantScheme(group_size=32, resident_dtype=resident_dtype),
                                            seed=2)
    reference = load_checkpoint(checkpoint).eval()
    ids = torch.arange(7, 37)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    with Engine.open(container, ram_budget="200MB", compute="native") as native, \
            Engine.open(container, ram_budget="200MB", compute="int4", kernel_dtype="f32") as exact:
        natives = [m for m in native.model.modules() if isinstance(m, NativeLinear)]
        head = native.model.lm_head
        projections = [m for m in natives if m is not head]
        assert len(projections) >= 4 * native.config.n_layers  # q, k, v, o of every layer at least
        assert {m.encoding for m in projections} == {"q4" if resident_dtype == "int4" else "q8"}
        assert head in natives and head.encoding == "bf16"  # embed_dtype's default: held as stored too
        assert head.data.nbytes == 2 * head.in_features * head.out_features
        # each projection holds its stored bytes where the exact engine holds 4 bytes a weight
        stored = sum(b.nbytes for m in projections for b in m.buffers())
        assert stored < 0.3 * sum(4 * m.in_features * m.out_features for m in projections)
        assert exact.stats.resident_bytes - native.stats.resident_bytes == \
            sum(4 * m.in_features * m.out_features for m in natives) - stored - head.data.nbytes
        # the plan counted exactly what the engine holds
        assert native.stats.resident_bytes == sum(native.opened_plan.footprint.resident_by_dtype.values())
        got = native.logits(ids)
    assert_near_reference(got, expected)


@pytest.mark.parametrize(("encoding", "zeros", "fp16"), [("q4", True, False), ("q4", False, True), ("q8", False, False)])
def test_many_rows_can_take_dequantized_blocks_and_a_dense_matmul(monkeypatch, encoding, zeros, fp16):
    rng = np.random.default_rng(11)
    rows, cols, group = 72, 256, 64
    if encoding == "q4":
        weights, scales, zero, weight = _random_q4(rows, cols, group, rng, zeros, fp16)
    else:
        data = rng.integers(-128, 128, (rows, cols)).astype(np.int8)
        dtype = torch.float16 if fp16 else torch.bfloat16
        half = torch.from_numpy(rng.uniform(0.001, 0.01, (rows, cols // group)).astype(np.float32)).to(dtype)
        weights, scales, zero = torch.from_numpy(data), half.view(torch.int16), None
        weight = data * np.repeat(half.double().numpy(), group, 1)
    monkeypatch.setattr(native_kernel, "DEQUANT_BLOCK_WEIGHTS", 20 * cols)  # several blocks, the last one short
    monkeypatch.setattr(native_kernel, "DENSE_FROM_ROWS", 16)
    x = torch.from_numpy(rng.normal(0, 1, (19, cols)).astype(np.float32))
    got = native_kernel.matmul(x, weights, scales, zero, group, encoding, fp16).double().numpy()
    expected = x.double().numpy() @ weight.T  # the stored weights exactly, f32 activations
    assert np.abs(got - expected).max() < 1e-4 * max(1.0, np.abs(expected).max())
    few = native_kernel.matmul(x[:2], weights, scales, zero, group, encoding, fp16)  # the int8 kernel
    assert torch.equal(few, native_kernel.matmul(QuantizedActivations(x[:2]), weights, scales, zero, group,
                                                 encoding, fp16))


def test_by_default_a_row_gets_what_it_gets_alone():
    rng = np.random.default_rng(5)
    packed, scales, _, _ = _random_q4(32, 128, 64, rng, False, False)
    x = torch.from_numpy(rng.normal(0, 1, (40, 128)).astype(np.float32))
    together = native_kernel.matmul(x, packed, scales, None, 64, "q4")
    assert all(torch.equal(together[i], native_kernel.matmul(x[i : i + 1], packed, scales, None, 64, "q4")[0])
               for i in (0, 17, 39))


def test_projections_of_one_input_share_its_quantization_and_a_change_quantizes_anew():
    from colibri_stream.compute.native_linear import SharedInput

    shared = SharedInput()
    x = torch.randn(2, 64)
    first = shared.quantized(x, 64)
    assert shared.quantized(x, 64) is first  # k and v after q: no second quantization
    assert shared.quantized(x.clone(), 64) is not first  # another tensor, same values
    x.mul_(2)  # an in-place change bumps the version counter
    again = shared.quantized(x, 64)
    assert again is not first and torch.equal(again.q, QuantizedActivations(x).q)
