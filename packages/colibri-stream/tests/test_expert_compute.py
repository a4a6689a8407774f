"""torch's CPU int4 kernels against the plain dequantized reference, for every scheme variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from colibri_int4 import ExpertBlob, ExpertBlobLayout, ModelShape, QuantScheme, encode_expert_blob
from colibri_stream.compute.expert_compute import DequantExpert, Int4Expert, int4_supported, prepared_nbytes


def make_blob(
    d_model: int, expert_dim: int, scheme: QuantScheme, seed: int = 0
) -> tuple[ExpertBlob, ExpertBlobLayout]:
    shape = ModelShape(
        vocab_size=32,
        d_model=d_model,
        n_layers=2,
        n_dense_layers=1,
        n_heads=1,
        n_kv_heads=1,
        head_dim=32,
        qk_norm=True,
        dense_ffn_dim=64,
        n_experts=4,
        expert_dim=expert_dim,
        shared_expert_dim=0,
        tie_embeddings=True,
    )
    layout = ExpertBlobLayout.build(shape, scheme)
    rng = np.random.default_rng(seed)
    gate, up = (rng.normal(0, 0.05, (expert_dim, d_model)).astype(np.float32) for _ in range(2))
    down = rng.normal(0, 0.05, (d_model, expert_dim)).astype(np.float32)
    blob = encode_expert_blob(gate, up, down, layout, scheme)
    return ExpertBlob.parse(blob, layout), layout


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", ["bf16", "fp16"])
def test_int4_kernel_matches_dequantized_reference(group, symmetric, scale_dtype):
    scheme = QuantScheme(group_size=group, symmetric=symmetric, scale_dtype=scale_dtype)
    blob, layout = make_blob(128, 256, scheme)
    x = torch.randn(7, 128)
    fast, slow = Int4Expert(blob, torch.float32), DequantExpert(blob, torch.float32)
    expected = slow.forward(x)
    assert (fast.forward(x) - expected).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item())
    assert fast.nbytes == prepared_nbytes(layout, 128, 256, "int4", torch.float32)
    assert slow.nbytes == prepared_nbytes(layout, 128, 256, "dequant", torch.float32)
    assert fast.nbytes < slow.nbytes / 3  # the point of the int4 layout
    fast_bf16 = Int4Expert(blob, torch.bfloat16)  # the fast path: bf16 activations
    assert (fast_bf16.forward(x).float() - expected).abs().max().item() < 0.02 * expected.abs().max().item()


def test_bf16_activations():
    blob, layout = make_blob(128, 64, QuantScheme(group_size=64))
    x = torch.randn(3, 128)
    got = Int4Expert(blob, torch.bfloat16).forward(x.bfloat16())
    expected = DequantExpert(blob, torch.float32).forward(x)
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max().item() < 0.02 * expected.abs().max().item() + 1e-3
    assert Int4Expert(blob, torch.bfloat16).nbytes == prepared_nbytes(layout, 128, 64, "int4", torch.bfloat16)


def test_prepared_expert_does_not_alias_the_read_buffer():
    blob, _ = make_blob(64, 64, QuantScheme(group_size=32))
    x = torch.randn(2, 64)
    fast, slow = Int4Expert(blob, torch.float32), DequantExpert(blob, torch.float32)
    before = fast.forward(x), slow.forward(x)
    for part in ("gate", "up", "down"):  # scribble over the source buffer, as the next miss would
        blob.packed[part][...] = 0
        blob.scales[part][...] = 0
    assert torch.equal(fast.forward(x), before[0]) and torch.equal(slow.forward(x), before[1])


def test_int4_supported_explains_unsupported_shapes():
    _, layout = make_blob(64, 64, QuantScheme(group_size=32))
    assert int4_supported(layout, 64, 64) is None
    assert "multiple of 16" in int4_supported(layout, 64, 40)


def test_biased_clamped_experts_compute_colibri_models_formula_on_both_paths():
    """GPT-OSS experts (format 1.2 blobs with biases, the clamped SwiGLU): the int4 kernel path,
    the dequantized path and colibri-model's GroupedExperts reference agree, slab-sized alike."""
    from colibri_model import ExpertGlu, GroupedExperts

    scheme = QuantScheme(group_size=32)
    shape = ModelShape(vocab_size=32, d_model=64, n_layers=1, n_dense_layers=0, n_heads=1, n_kv_heads=1, head_dim=32,
                       qk_norm=False, dense_ffn_dim=64, n_experts=1, expert_dim=32, shared_expert_dim=0,
                       tie_embeddings=True, expert_proj_bias=True)
    layout = ExpertBlobLayout.build(shape, scheme)
    rng = np.random.default_rng(4)
    gate, up = (rng.normal(0, 0.3, (32, 64)).astype(np.float32) for _ in range(2))
    down = rng.normal(0, 0.3, (64, 32)).astype(np.float32)
    biases = tuple(rng.normal(0, 0.5, n).astype(np.float32) for n in (32, 32, 64))
    blob = ExpertBlob.parse(encode_expert_blob(gate, up, down, layout, scheme, biases), layout)
    glu = ExpertGlu("clamped_swiglu", 1.702, 0.5)
    reference = GroupedExperts(1, 64, 32, glu, bias=True)
    weights = blob.dequantize()
    with torch.no_grad():
        for name, array in (("gate_proj", weights["gate"]), ("up_proj", weights["up"]), ("down_proj", weights["down"]),
                            ("gate_bias", biases[0]), ("up_bias", biases[1]), ("down_bias", biases[2])):
            getattr(reference, name).copy_(torch.from_numpy(array)[None])
    x = torch.randn(5, 64)
    expected = reference.reference_forward(x, torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1))
    fast, slow = Int4Expert(blob, torch.float32, glu), DequantExpert(blob, torch.float32, glu=glu)
    torch.testing.assert_close(slow.forward(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.forward(x), expected, atol=1e-4, rtol=1e-4)
    assert float((x @ torch.from_numpy(gate).T + torch.from_numpy(biases[0])).max()) > 0.5  # the clamp acts
    assert fast.nbytes == prepared_nbytes(layout, 64, 32, "int4", torch.float32)
    assert slow.nbytes == prepared_nbytes(layout, 64, 32, "dequant", torch.float32)
    without = Int4Expert(blob, torch.float32)  # the plain SwiGLU gives something else: the glu is used
    assert float((without.forward(x) - expected).abs().max()) > 1e-2
