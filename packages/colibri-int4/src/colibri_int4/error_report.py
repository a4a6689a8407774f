"""Quantization error per tensor type: relative RMSE of container weights vs the checkpoint.

`relative RMSE = ||W_q - W|| / ||W||` (Frobenius), pooled over all tensors of one type
(`attn.q_proj.weight` across layers, `moe.experts.gate_proj` across layers and experts). It is
a cheap, model-free proxy for quality: int4 at group 64 lands near 0.1, int8 near 0.005, bf16
near 0.002; perplexity (bench/int4_quality.py) is the real judge.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoint import SafetensorsFile
from .container import Container
from .model_shape import expert_tensor_names

_LAYER = re.compile(r"^layers\.\d+\.")


def tensor_type(name: str) -> str:
    """`layers.3.attn.q_proj.weight` -> `attn.q_proj.weight`."""
    return _LAYER.sub("", name)


@dataclass
class _Accumulator:
    err_sq: float = 0.0
    ref_sq: float = 0.0
    count: int = 0
    encoding: str = ""

    def add(self, reference: np.ndarray, approx: np.ndarray) -> None:
        diff = approx.astype(np.float64) - reference
        self.err_sq += float(np.sum(diff * diff))
        self.ref_sq += float(np.sum(np.square(reference, dtype=np.float64)))
        self.count += 1


def tensor_error_summary(
    checkpoint_dir: str | os.PathLike, container_path: str | os.PathLike, max_experts_per_layer: int | None = None
) -> dict[str, dict]:
    """`{tensor type: {"encoding", "tensors", "relative_rmse"}}` over resident tensors and
    routed experts (optionally only the first `max_experts_per_layer` of each layer)."""
    stats: dict[str, _Accumulator] = {}
    with Container.open(container_path) as container, SafetensorsFile(Path(checkpoint_dir) / "model.safetensors") as st:
        for name, approx in container.read_resident(dequantize=True).items():
            acc = stats.setdefault(tensor_type(name), _Accumulator())
            acc.encoding = next(t.encoding for t in container.header.tensors if t.name == name)
            acc.add(st.read(name), approx)
        buffer = bytearray(container.blob_length)
        for entry in container.header.experts.entries:
            if max_experts_per_layer is not None and entry.expert >= max_experts_per_layer:
                continue
            names = expert_tensor_names(entry.layer)
            weights = container.read_expert_into(entry.layer, entry.expert, buffer).dequantize()
            for part, approx in weights.items():
                acc = stats.setdefault(tensor_type(names[part]), _Accumulator(encoding="q4"))
                acc.add(st.read(names[part], index=entry.expert), approx)
    return {
        kind: {
            "encoding": acc.encoding,
            "tensors": acc.count,
            "relative_rmse": (acc.err_sq / acc.ref_sq) ** 0.5 if acc.ref_sq > 0 else 0.0,
        }
        for kind, acc in stats.items()
    }
