"""Shared fixtures: a tiny random Colibri model, its int4 container, and the reference model
built from the container's dequantized weights (colibri-int4's `dequantize_container`), so the
engine and the reference compute with bit-identical weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from colibri_int4 import Container, QuantScheme, dequantize_container, export_checkpoint
from colibri_model import ColibriConfig, ColibriForCausalLM, load_checkpoint

# NOTE: the test machine's 2 cores are shared by several jobs; torch's intra-op thread pool
# then spins on contended cores and tiny ops (index_add_ on 64 floats) take tens of ms.
# One thread made the 64-token generation test 16x faster (20 s -> 1.3 s).
torch.set_num_threads(1)

# 3 MoE layers x 16 experts = 48 experts; d_model 64 keeps every int4 constraint (N % 16, groups).
TINY = dict(
    name="stream-test",
    d_model=64,
    n_layers=4,
    n_dense_layers=1,
    n_heads=2,
    n_kv_heads=1,
    head_dim=32,
    dense_ffn_dim=128,
    n_experts=16,
    expert_dim=64,
    shared_expert_dim=64,
    max_seq_len=256,
    top_k_train=2,
    top_k_infer=1,
    init_std=0.05,
)


def build_container(directory: Path, scheme: QuantScheme, seed: int = 0, **overrides) -> tuple[Path, Path]:
    """(container path, dequantized checkpoint dir) of a random tiny model."""
    torch.manual_seed(seed)
    model = ColibriForCausalLM(ColibriConfig(**{**TINY, **overrides}))
    with torch.no_grad():  # make routing decisive: spread the router bias a little
        for layer in model.moe_layers():
            layer.router.expert_bias.copy_(torch.randn(layer.router.expert_bias.shape) * 0.01)
    model.save_pretrained(directory / "ckpt")
    container = directory / "tiny.coli"
    export_checkpoint(directory / "ckpt", container, scheme)
    dequantize_container(container, directory / "dequantized")
    return container, directory / "dequantized"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """Symmetric g32 experts, int8 resident: the default-like scheme."""
    return build_container(tmp_path_factory.mktemp("tiny"), QuantScheme(group_size=32, resident_dtype="int8"))


@pytest.fixture(scope="session")
def tiny_asym(tmp_path_factory) -> tuple[Path, Path]:
    """Asymmetric g64 experts with fp16 scales, bf16 resident: the other branch of every choice."""
    scheme = QuantScheme(group_size=64, symmetric=False, scale_dtype="fp16", resident_dtype="bf16")
    return build_container(tmp_path_factory.mktemp("tiny_asym"), scheme, seed=1)


@pytest.fixture(scope="session")
def reference(tiny):
    return load_checkpoint(tiny[1]).eval()


CORRUPT_PROMPT = "Hello there, little bird"


@pytest.fixture()
def corrupted(tiny, tmp_path) -> tuple[Path, tuple[int, int], str]:
    """A copy of the tiny container with one byte flipped inside the blob of an expert of layer 2
    that `CORRUPT_PROMPT`'s prefill routes to. Returns (path, (layer, expert), prompt)."""
    from colibri_stream import Engine

    with Engine.open(tiny[0], ram_budget="200MB", record_trace=True) as eng:
        eng.logits(eng.encode(CORRUPT_PROMPT))
        layer, expert = next((e.layer, e.experts[-1]) for e in eng.stats.trace if e.layer == 2)
    path = tmp_path / "corrupt.coli"
    shutil.copy(tiny[0], path)
    with Container.open(path) as c:
        entry = c.expert_entry(layer, expert)
    with open(path, "r+b") as f:
        f.seek(entry.offset + 100)
        byte = f.read(1)
        f.seek(entry.offset + 100)
        f.write(bytes([byte[0] ^ 0x5A]))
    return path, (layer, expert), CORRUPT_PROMPT


def _minimum_budget(container: Path, **kwargs) -> int:
    from colibri_stream import Engine

    return Engine.plan(container, **kwargs).min_budget


@pytest.fixture(scope="session")
def minimum_budget():
    """`minimum_budget(container, **open_kwargs)`: the plan's minimum budget for those options
    (the unset defaults at their preferred values: f32, max_seq_len, 128-token chunks)."""
    return _minimum_budget
