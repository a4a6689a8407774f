"""`StoredEmbedding`: the token embedding held as the container stores it (bf16, q8, q4 or f32),
each looked-up row dequantized when a pass needs it.

A pass reads one row per token, but a materialised embedding costs the whole table in the
engine dtype: a 32k x 1024 vocabulary is 131 MB in f32 against 65 MB as stored bf16 (33 MB q8),
a 152k x 2048 one (Qwen3-30B-A3B) 1.24 GB against 0.62 GB. That table was the largest part of
the smallest budget such models run in. A looked-up row is exactly the row the materialised
table would hold (the same dequantization of the same stored row; within-row groups), so
logits do not change by a bit.

The engine maps the table from the container (`Container.map_resident`): read-only pages of the
page cache, of which only the looked-up rows stay touched, and which the kernel takes back when
memory is short, so the table is not in the RAM budget at all (the plan's `mapped_bytes`).
`stored_embedding_name` is the one rule for which tensor is held this way; the footprint and the
model builder both read it. A tied LM head (the embedding doubles as the vocab projection) needs
the whole table in the engine dtype, so a tied model keeps the materialised one.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import nn

EMBEDDING = "embed.weight"
# numpy views torch can hold for any stored dtype of that width (uint16 bf16 bits, uint8 nibbles)
_SIGNED = {1: np.int8, 2: np.int16, 4: np.float32}


def stored_embedding_name(name: str, tied: bool) -> bool:
    """True when the resident tensor `name` is held as a `StoredEmbedding`."""
    return name == EMBEDDING and not tied


class StoredEmbedding(nn.Module):
    """nn.Embedding's forward over a table kept as stored: `ids` [...] -> [..., dim] in `dtype`."""

    def __init__(self, raw, dtype: torch.dtype, device: torch.device, mapped: bool = False):
        """`raw`: colibri-int4's RawTensor of `embed.weight`. `mapped`: its arrays are views of a
        file mapping (`Container.map_resident`), kept as they are: no copy, no torch buffers, so
        nothing counts them as resident."""
        super().__init__()
        self.num_embeddings, self.embedding_dim = raw.shape
        self.dtype, self.device, self.mapped = dtype, device, mapped
        if mapped:
            self.raw = raw
            return
        # Copied into torch buffers (not persistent: the container's bytes, not a state_dict entry),
        # so whatever counts a module's tensors (the engine's resident bytes) counts them, and the
        # read buffer is not kept; lookups read numpy views of the same memory.
        arrays = {}
        for name in ("data", "scales", "zeros"):
            array = getattr(raw, name)
            held = None if array is None else torch.tensor(array.view(_SIGNED[array.dtype.itemsize]))
            self.register_buffer(name, held, persistent=False)
            arrays[name] = None if held is None else held.numpy().view(array.dtype)
        self.raw = replace(raw, **arrays)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.from_numpy(self.raw.take(ids.detach().reshape(-1).cpu().numpy()).dequantize())
        return rows.to(device=self.device, dtype=self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        where = "mapped from the container" if self.mapped else "held"
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.raw.encoding} as stored, {where}"
