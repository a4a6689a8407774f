"""A valid container with random weights, of any model shape, without a checkpoint.

Benchmarks need a real disk-bound regime: Colibri-Micro's shapes (27 MoE layers x 64 experts of
1536x768, int4 everywhere) give a container of about 3.7 GB, far beyond any RAM budget a
benchmark sets. Quantizing 7B random fp32 weights would take most of an hour on 2 cores, so the
routed experts are built from a handful of genuinely quantized random experts
(`encode_expert_blob`) whose packed nibbles are then replaced by fresh random bytes per expert
(any byte is a valid pair of nibbles; the scales stay those of a real quantization). Resident
tensors are random (norm weights 1, `expert_bias` 0, so activations stay finite) and quantized by
`encode_tensor` like an export's.

The file goes through the exporter's writer: its layout planner (`plan_with_header`), header and
preamble, per-blob and per-tensor CRC-32, written as `OUT.tmp` and renamed; `Container.open`
validates the result like any export. `config` is a checkpoint's config.json object (carried
verbatim, as an export carries it; only the shape fields and `init_std` are read here), e.g.
`colibri_model.checkpoint_config_dict(get_preset("micro"))`.

Time: about a minute for Micro plus the disk's write time; RAM: the largest resident tensor (the
75M-weight embedding) plus a few blobs.

    >>> write_synthetic_container("micro.coli", config)            # doctest: +SKIP
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

from .container import Container
from .expert_blob import encode_expert_blob
from .export import ContainerFileWriter, plan_with_header
from .header import model_shape
from .scheme import QuantScheme
from .tensor_codec import encode_tensor

# int4 everywhere keeps a big model's resident region small, so the experts dominate the file.
SYNTHETIC_SCHEME = QuantScheme(group_size=64, resident_dtype="int4", embed_dtype="int4")
BASE_EXPERTS = 4  # genuinely quantized experts whose scales are reused


def write_synthetic_container(
    out_path: str | os.PathLike, config: dict, scheme: QuantScheme = SYNTHETIC_SCHEME, seed: int = 0
) -> Path:
    """Write a container of `config`'s shapes with random weights (same `seed`, same bytes);
    returns its path. A config whose shape fields are invalid raises `ContainerError`."""
    out_path = Path(out_path)
    shape = model_shape(config)
    plan, json_length = plan_with_header(config, shape, scheme, 0)
    rng = np.random.default_rng(seed)
    std = float(config.get("init_std", 0.02))
    with ContainerFileWriter(out_path, config, scheme, plan, json_length) as writer:
        crcs = writer.crcs
        for placed in plan.tensors:
            values = _random_tensor(rng, placed.spec.name, placed.spec.shape, std)
            offset, crc = placed.offset, 0
            for section in encode_tensor(values, placed.spec.encoding, scheme):
                data = memoryview(np.ascontiguousarray(section)).cast("B")
                writer.write(data, offset)
                crc, offset = zlib.crc32(data, crc), offset + len(data)
            if offset - placed.offset != placed.length:
                raise RuntimeError(f"{placed.spec.name}: encoded {offset - placed.offset} bytes, planned {placed.length}")
            crcs[placed.spec.name] = f"{crc:08x}"
            del values
        if plan.blob is not None:
            d, h = shape.d_model, shape.expert_dim
            bases = [
                encode_expert_blob(
                    *(rng.standard_normal(s, dtype=np.float32) * std for s in ((h, d), (h, d), (d, h))),
                    plan.blob,
                    scheme,
                    # format 1.2 expert biases (GPT-OSS shapes): zero, like the router's expert_bias
                    tuple(np.zeros(n, np.float32) for n in (h, h, d)) if plan.blob.bias else None,
                )
                for _ in range(BASE_EXPERTS)
            ]
            packed = [s for s in plan.blob.sections if s.kind == "packed"]
            for i, (layer, expert, offset) in enumerate(plan.experts):
                blob = bytearray(bases[i % BASE_EXPERTS])
                for section in packed:
                    blob[section.offset : section.offset + section.length] = rng.bytes(section.length)
                writer.write(blob, offset)
                crcs[(layer, expert)] = f"{zlib.crc32(blob):08x}"
    Container.open(out_path).close()  # the reader's full header validation
    return out_path


def _random_tensor(rng: np.random.Generator, name: str, shape, std: float) -> np.ndarray:
    shape = tuple(int(s) for s in shape)
    if len(shape) == 1:  # norms at 1 (a random norm weight would blow up activations), the bias at 0
        return np.zeros(shape, np.float32) if name.endswith("expert_bias") else np.ones(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * std
