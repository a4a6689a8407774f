"""The named model presets (tiny, nano, micro, grande) and `get_preset`."""

from __future__ import annotations

from .config import ColibriConfig
from .errors import ConfigError

# All presets share the design: 1 leading dense layer, 4x GQA with head_dim 64 (32 for tiny),
# 64 routed experts (8 for tiny, 80 for grande), top-2 train / top-1 serve, one shared expert 4x the expert
# width, and a dense FFN width equal to the MoE layer's active width (shared + 2 experts).
PRESETS: dict[str, dict] = {
    # Trains in seconds on a CPU; same design, small. Tied embeddings keep it small.
    "tiny": dict(
        d_model=128, n_layers=4, n_dense_layers=1, n_heads=4, n_kv_heads=1, head_dim=32,
        dense_ffn_dim=384, n_experts=8, expert_dim=64, shared_expert_dim=256,
        max_seq_len=512, tie_embeddings=True,
    ),
    # NanoColibri: 2.63B total / 0.341B active (top-2), 0.31B active (top-1).
    "nano": dict(
        d_model=1024, n_layers=24, n_dense_layers=1, n_heads=16, n_kv_heads=4, head_dim=64,
        dense_ffn_dim=3072, n_experts=64, expert_dim=512, shared_expert_dim=2048,
        max_seq_len=2048,
    ),
    # Colibri-Micro: about 7.0B total / 0.97B active (top-2). Its shared expert is wider
    # (4096 = 5.3x the expert width) to reach 1B active at 28 layers.
    "micro": dict(
        d_model=1536, n_layers=28, n_dense_layers=1, n_heads=24, n_kv_heads=6, head_dim=64,
        dense_ffn_dim=5632, n_experts=64, expert_dim=768, shared_expert_dim=4096,
        max_seq_len=4096,
    ),
    # Colibri-Grande: about 27B total / 2.6B active (top-2), 2.3B (top-1). 80 experts: at 64
    # the routed share of the total is too small for the 24-28B / 2.4B-active target.
    "grande": dict(
        d_model=2304, n_layers=40, n_dense_layers=1, n_heads=36, n_kv_heads=9, head_dim=64,
        dense_ffn_dim=9216, n_experts=80, expert_dim=1152, shared_expert_dim=4608,
        max_seq_len=4096,
    ),
}


def get_preset(name: str, **overrides) -> ColibriConfig:
    """The named preset as a config, with optional field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return ColibriConfig(name=name, **{**PRESETS[name], **overrides})


