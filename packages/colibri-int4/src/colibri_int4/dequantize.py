"""Container -> checkpoint directory (CHECKPOINT.md), for tests and quality measurements.

Streaming like the export: the safetensors layout is declared first, then each resident
tensor and each expert blob is dequantized and written into its slot (experts into their
`[e]` slice of the stacked tensors), so memory stays near one tensor. Every CRC is checked on
the way: a corrupted container never turns into a plausible-looking checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from .checkpoint import SafetensorsWriter
from .container import Container
from .model_shape import checkpoint_tensor_shapes, expert_tensor_names

CHECKPOINT_METADATA = {"format": "pt", "format_version": "1.0"}


def dequantize_container(
    path: str | os.PathLike, out_dir: str | os.PathLike, dtype: Literal["f32", "bf16"] = "f32", progress: bool = False
) -> Path:
    """Write config.json, model.safetensors (matrices in `dtype`, 1-D tensors fp32) and, if the
    container carries one, tokenizer.json into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with Container.open(path) as container:
        shapes = checkpoint_tensor_shapes(container.shape)
        matrix_dtype = "BF16" if dtype == "bf16" else "F32"
        declared = {name: (dims, "F32" if len(dims) == 1 else matrix_dtype) for name, dims in shapes.items()}
        writer = SafetensorsWriter(out_dir / "model.safetensors", declared, CHECKPOINT_METADATA)
        try:
            for name, array in container.read_resident(dequantize=True).items():
                writer.write(name, array)
            buffer = bytearray(container.blob_length)
            entries = container.header.experts.entries
            for entry in tqdm(entries, desc="dequantize", unit="expert", disable=not progress):
                names = expert_tensor_names(entry.layer, container.shape.expert_proj_bias)
                blob = container.read_expert_into(entry.layer, entry.expert, buffer)
                weights = blob.dequantize()
                weights.update({f"{part}_bias": bias for part, bias in (blob.biases or {}).items()})
                for part, array in weights.items():
                    writer.write(names[part], array, index=entry.expert)
        except BaseException:
            writer.abort()
            raise
        writer.close()
        (out_dir / "config.json").write_text(json.dumps(container.config, indent=2) + "\n", encoding="utf-8")
        tokenizer = container.read_tokenizer_json()
        if tokenizer is not None:
            (out_dir / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
    return out_dir
