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
model builder both read it. A tied LM head (the embedding doubles as the vocab projection) reads
the whole table every token: a native engine holds that head as stored in its own buffer
(compute/native_linear.py's `native_tied_head`) and maps the embedding as an untied one; any other
engine keeps the materialised table for both.
"""

from __future__ import annotations

import torch
from torch import nn

EMBEDDING = "embed.weight"


def stored_embedding_name(name: str, tied: bool, head_apart: bool = False) -> bool:
    """True when the resident tensor `name` is held as a `StoredEmbedding`: an untied embedding,
    or a tied one whose LM head the engine holds apart (`head_apart`: a native engine's head)."""
    return name == EMBEDDING and (not tied or head_apart)


class StoredEmbedding(nn.Module):
    """nn.Embedding's forward over a table kept as stored: `ids` [...] -> [..., dim] in `dtype`."""

    def __init__(self, raw, dtype: torch.dtype, device: torch.device):
        """`raw`: colibri-int4's RawTensor of `embed.weight`, kept as given: views of the container's
        map (`Container.map_resident`), no copy and no torch buffers, so nothing counts them as
        resident."""
        super().__init__()
        self.num_embeddings, self.embedding_dim = raw.shape
        self.dtype, self.device, self.raw = dtype, device, raw

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.from_numpy(self.raw.take(ids.detach().reshape(-1).cpu().numpy()).dequantize())
        return rows.to(device=self.device, dtype=self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.raw.encoding} as stored"
