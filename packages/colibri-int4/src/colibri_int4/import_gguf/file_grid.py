"""The int4 grid a GGUF file's own blocks lie on, so that re-quantizing them changes no weight.

A GGUF 4-bit block is a grid of 16 levels over 32 weights:

| block type | weight | the int4 group that holds it |
|---|---|---|
| Q4_0 | `d * (q - 8)` | symmetric, groups of 32 (the Q4_0 rule is the symmetric rule) |
| Q4_1 | `m + d * q` | asymmetric, groups of 32 |
| Q4_K | `m_j + d_j * q` per 32-weight sub-block (`d_j = d * sc_j`, `m_j = dmin * mn_j`) | asymmetric, groups of 32 |

Re-quantized into the default int4 groups (64 weights, symmetric) such a block lands on a second
grid, and every weight moves: 6-9% relative RMS error on the weights the file already rounded
(measured, bench/RESULTS.md), about what a fresh 4-bit quantization costs. On the group that holds
it, with fp16 scales (GGUF's own `d` is fp16), the error is under 0.1% (quantize.py takes the step a
group's values lie on). So when no grouping is asked for, the importer takes the grid of the block
type holding most of the bytes that become int4; other types (Q5_*, Q6_K, Q8_0, F16, ...) cannot
be held in 4 bits and keep the scheme's grouping.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..layout import resident_encoding
from ..scheme import QuantScheme

# block type -> (group_size, symmetric) of the int4 group that holds it exactly
EXACT_GRIDS = {"Q4_0": (32, True), "Q4_1": (32, False), "Q4_K": (32, False)}


@dataclass(frozen=True)
class FileGrid:
    """The grid chosen for a file: `scheme` is the one asked for on it."""

    block_type: str  # the GGUF type holding most of the bytes that become int4
    share: float  # its share of those bytes
    scheme: QuantScheme

    def describe(self) -> str:
        kind = "symmetric" if self.scheme.symmetric else "asymmetric"
        return (f"{self.block_type} blocks ({self.share:.0%} of the int4 bytes) kept on their own grid: {kind} "
                f"int4 in groups of {self.scheme.group_size}, {self.scheme.scale_dtype} scales")


def int4_bytes_by_type(source, scheme: QuantScheme) -> Counter:
    """Bytes of the file, by block type, of the tensors `scheme` stores as int4: the routed experts
    under `expert_dtype`, and each resident tensor the exporter's own rule (`resident_encoding`)
    makes q4. `source`: convert.py's `GGUFTensors` (the file, and the Colibri names of its tensors)."""
    chosen: set[str] = set()
    if scheme.expert_dtype == "int4":
        chosen |= {name for names in source.experts.values() for name in names if name.endswith(".weight")}
    chosen |= {gguf_name for name, gguf_name in source.resident.items()
               if resident_encoding(name, len(source.table[name]), scheme) == "q4"}
    found: Counter = Counter()
    for name in chosen:
        found[source.file.type_name(name)] += source.file.tensors[name].n_bytes
    return found


def file_grid(source, scheme: QuantScheme) -> FileGrid | None:
    """`scheme` on the grid of the file's main int4-bound block type (module doc), or None where
    that type has no exact int4 grid or nothing becomes int4."""
    found = int4_bytes_by_type(source, scheme)
    if not found:
        return None
    block_type, size = found.most_common(1)[0]
    if block_type not in EXACT_GRIDS:
        return None
    group, symmetric = EXACT_GRIDS[block_type]
    kept = scheme.model_copy(update={"group_size": group, "symmetric": symmetric, "scale_dtype": "fp16"})
    return FileGrid(block_type, size / sum(found.values()), kept)
