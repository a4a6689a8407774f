"""A Micro-shaped container with random weights: a real disk-bound regime for the benchmark.

Colibri-Micro (28 layers, 27 MoE layers x 64 experts of 1536x768, int4 everywhere) gives a
container of about 3.7 GB, far beyond any budget the benchmark sets, so misses must come from
disk. Quantizing 7B random fp32 weights would take most of an hour on 2 cores, so the routed
experts are built from a handful of genuinely quantized random experts (`encode_expert_blob`)
whose packed nibbles are then replaced by fresh random bytes per expert (any byte is a valid
pair of nibbles; the scales stay those of a real quantization). Resident tensors are random and
quantized by colibri-int4's own `encode_tensor`.

The file goes through colibri-int4's writer: its layout planner (`plan_with_header`), its
header builder and preamble, per-blob and per-tensor CRC-32, written as `OUT.tmp` and renamed.
`Container.open` validates the result like any export. `synthetic_container(...)` is a context
manager that deletes the file afterwards (it is big). Time: about a minute plus the disk's write
time; RAM: the largest resident tensor (the 75M-weight embedding) plus a few blobs.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from colibri_int4 import Container, QuantScheme, encode_expert_blob
from colibri_int4.export import ContainerFileWriter, plan_with_header
from colibri_int4.header import model_shape
from colibri_int4.tensor_codec import encode_tensor
from colibri_model import get_preset
from colibri_model.checkpoint import config_to_checkpoint_json

MICRO_SCHEME = QuantScheme(group_size=64, resident_dtype="int4", embed_dtype="int4")
BASE_EXPERTS = 4  # genuinely quantized experts whose scales are reused


def write_synthetic_container(
    out_path: str | os.PathLike,
    preset: str = "micro",
    seed: int = 0,
    scheme: QuantScheme = MICRO_SCHEME,
    **overrides,
) -> Path:
    """Write a container of the preset's shapes with random weights; returns its path."""
    out_path = Path(out_path)
    config = json.loads(config_to_checkpoint_json(get_preset(preset, **overrides)))
    shape = model_shape(config)
    plan, json_length = plan_with_header(config, shape, scheme, 0)
    rng = np.random.default_rng(seed)
    with ContainerFileWriter(out_path, config, scheme, plan, json_length) as writer:
        crcs = writer.crcs
        for placed in plan.tensors:
            values = _random_tensor(rng, placed.spec.name, placed.spec.shape, config)
            offset, crc = placed.offset, 0
            for section in encode_tensor(values, placed.spec.encoding, scheme):
                data = memoryview(np.ascontiguousarray(section)).cast("B")
                writer.write(data, offset)
                crc, offset = zlib.crc32(data, crc), offset + len(data)
            if offset - placed.offset != placed.length:
                raise RuntimeError(
                    f"{placed.spec.name}: encoded {offset - placed.offset} bytes, planned {placed.length}"
                )
            crcs[placed.spec.name] = f"{crc:08x}"
            del values
        if plan.blob is not None:
            std = float(config.get("init_std", 0.02))
            d, h = shape.d_model, shape.expert_dim
            bases = [
                encode_expert_blob(
                    *(rng.standard_normal(s, dtype=np.float32) * std for s in ((h, d), (h, d), (d, h))),
                    plan.blob,
                    scheme,
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


def _random_tensor(rng: np.random.Generator, name: str, shape, config: dict) -> np.ndarray:
    shape = tuple(int(s) for s in shape)
    if len(shape) == 1:  # norms at 1 (a random norm weight would blow up activations), biases at 0
        return np.zeros(shape, np.float32) if "bias" in name else np.ones(shape, np.float32)
    std = float(config.get("init_std", 0.02))
    return rng.standard_normal(shape, dtype=np.float32) * std


@contextlib.contextmanager
def synthetic_container(
    directory: str | os.PathLike, preset: str = "micro", seed: int = 0, **overrides
) -> Iterator[Path]:
    """Write a synthetic container into `directory` and delete it on exit."""
    path = Path(directory) / f"synthetic-{preset}.coli"
    try:
        yield write_synthetic_container(path, preset, seed, **overrides)
    finally:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)
