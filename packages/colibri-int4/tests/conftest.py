"""Synthetic checkpoints for the tests, written with numpy + the safetensors library directly
(CHECKPOINT.md is the interface; colibri-model is never imported)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from colibri_int4.model_shape import ModelShape, checkpoint_tensor_shapes
from safetensors.numpy import save_file


def tiny_config(**overrides) -> dict:
    """A config.json dict of the CHECKPOINT.md kind, small enough for milliseconds."""
    config = {
        "schema_version": "1.0", "format_version": "1.0", "model_type": "colibri",
        "vocab_size": 256, "d_model": 64, "n_layers": 3, "n_dense_layers": 1,
        "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "qk_norm": True,
        "rope_theta": 10000.0, "max_seq_len": 128, "dense_ffn_dim": 128,
        "n_experts": 4, "expert_dim": 64, "top_k_train": 2, "top_k_infer": 1,
        "shared_expert_dim": 64, "router_score": "sigmoid", "route_norm": True, "route_scale": 1.0,
        "bias_update_gamma": 0.001, "aux_loss_alpha": 0.0, "tie_embeddings": False, "norm_eps": 1e-6,
    }
    config.update(overrides)
    return config


def random_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Gaussian weights (std 0.02) with a few outliers, norms near 1, biases small."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, dims in checkpoint_tensor_shapes(ModelShape.model_validate(config)).items():
        if len(dims) == 1:
            out[name] = (1.0 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
        else:
            w = (0.02 * rng.standard_normal(dims)).astype(np.float32)
            w.reshape(-1)[rng.integers(0, w.size, size=max(1, w.size // 500))] *= 8.0
            out[name] = w
    return out


def write_checkpoint(directory: Path, config: dict, tensors: dict[str, np.ndarray], tokenizer: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt", "format_version": "1.0"})
    if tokenizer is not None:
        (directory / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
    return directory


@pytest.fixture
def make_config():
    """`make_config(**overrides)`: a tiny config.json dict (test modules cannot import conftest)."""
    return tiny_config


@pytest.fixture
def make_checkpoint(tmp_path):
    """`make_checkpoint(name="ckpt", seed=0, tokenizer=None, **config_overrides)` -> (dir, config, tensors)."""

    def make(name: str = "ckpt", seed: int = 0, tokenizer: str | None = None, **overrides):
        config = tiny_config(**overrides)
        tensors = random_tensors(config, seed)
        return write_checkpoint(tmp_path / name, config, tensors, tokenizer), config, tensors

    return make


@pytest.fixture(scope="module")
def tiny_container(tmp_path_factory):
    """A small exported container: (path, config, tensors). Module-scoped: export it once."""
    from colibri_int4 import QuantScheme, export_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    config = tiny_config()
    tensors = random_tensors(config, seed=1)
    write_checkpoint(root / "ckpt", config, tensors, tokenizer='{"model": "tiny"}')
    path = root / "tiny.coli"
    export_checkpoint(root / "ckpt", path, QuantScheme(group_size=32, symmetric=False, resident_dtype="int4"))
    return path, config, tensors


def rewrite_header(data: bytes, mutate=None, major: int = 1, minor: int = 0, json_length: int | None = None) -> bytes:
    """Return the container bytes with its header JSON passed through `mutate(dict)` and the
    preamble rebuilt with *valid* CRCs: a hostile but well-checksummed header, so the tests
    reach the semantic checks and not just the CRC."""
    import struct
    import zlib

    (old_length,) = struct.unpack_from("<Q", data, 16)
    header = json.loads(data[32 : 32 + old_length])
    if mutate is not None:
        mutate(header)
    new_json = json.dumps(header, separators=(",", ":")).encode()
    length = len(new_json) if json_length is None else json_length
    head = struct.pack("<8sHHIQI", data[:8], major, minor, 0, length, zlib.crc32(new_json))
    preamble = head + struct.pack("<I", zlib.crc32(head))
    return preamble + new_json + data[32 + len(new_json) :]


@pytest.fixture
def hostile():
    return rewrite_header
