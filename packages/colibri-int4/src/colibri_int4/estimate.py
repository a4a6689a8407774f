"""Byte-size estimator: what a container of a given config and scheme will weigh.

Exact, not approximate: it runs the exporter's own layout planner (layout.py) with the real
header size, so `estimate(config, scheme, tokenizer_length).file_size` equals the size `export`
writes (the tests check this). The container also carries the checkpoint's tokenizer.json
(SmolLM2's is 1.56 MB) when there is one: pass its length in bytes, or the estimate is short by
exactly that (the CLI takes the tokenizer.json beside config.json, as `export` does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .header import PREAMBLE_SIZE, model_shape
from .model_shape import checkpoint_tensor_shapes
from .scheme import QuantScheme


@dataclass
class SizeEstimate:
    file_size: int
    header_bytes: int
    tokenizer_bytes: int
    resident_bytes: int
    expert_bytes: int
    blob_length: int
    n_experts_total: int
    total_params: int
    expert_params: int
    resident_params: int
    bits_per_weight: float  # routed experts, blob padding included
    bits_per_weight_resident: float
    bits_per_weight_total: float

    def as_dict(self) -> dict:
        return asdict(self)


def estimate_container_size(config: dict, scheme: QuantScheme | None = None, tokenizer_length: int = 0) -> SizeEstimate:
    """Size of the container `export` would write for `config` (a config.json dict) and a
    tokenizer.json of `tokenizer_length` bytes (0: none)."""
    from .export import plan_with_header  # export imports tqdm; keep this module light

    scheme = scheme or QuantScheme()
    shape = model_shape(config)  # one-line ContainerError naming the field
    plan, json_length = plan_with_header(config, shape, scheme, tokenizer_length)
    shapes = checkpoint_tensor_shapes(shape)
    total = expert = 0
    for name, dims in shapes.items():
        numel = 1
        for size in dims:
            numel *= size
        total += numel
        if ".moe.experts." in name:
            expert += numel
    resident = total - expert
    return SizeEstimate(
        file_size=plan.file_size,
        header_bytes=PREAMBLE_SIZE + json_length,
        tokenizer_bytes=plan.tokenizer_length,
        resident_bytes=plan.resident_length,
        expert_bytes=plan.expert_bytes,
        blob_length=plan.blob.blob_length if plan.blob else 0,
        n_experts_total=len(plan.experts),
        total_params=total,
        expert_params=expert,
        resident_params=resident,
        bits_per_weight=8 * plan.expert_bytes / expert if expert else 0.0,
        bits_per_weight_resident=8 * plan.resident_length / resident if resident else 0.0,
        bits_per_weight_total=8 * plan.file_size / total,
    )
