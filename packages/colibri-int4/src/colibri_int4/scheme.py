"""The quantization scheme of a container (part of the header, see FORMAT.md).

A pydantic model, so that the CLI, the exporter, the estimator and the reader agree on one
validated definition. Group size trades accuracy against bits per weight: each group of G
weights carries one 16-bit scale (and one 16-bit zero when asymmetric), i.e. 4 + 16/G (or
4 + 32/G) bits per weight at int4, 6 + 16/G at int6, 8 + 16/G at int8.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

ScaleDtype = Literal["bf16", "fp16"]
ResidentDtype = Literal["int4", "int8", "bf16"]
# int6 (format 1.3) is for the embedding and LM head only: a decode token reads the head whole, so
# its bytes count every step, while the other matrices are fine at int4 or int8
EmbedDtype = Literal["int4", "int6", "int8", "bf16"]
GROUP_SIZES = (32, 64, 128)


class QuantScheme(BaseModel):
    """How weights are quantized. `resident_dtype` applies to attention, dense FFN and shared
    experts; `embed_dtype` to `embed.weight` and `lm_head.weight`; `expert_dtype` (format 1.1)
    to the routed experts: group-wise int4 (the default, and all that 1.0 knew), group-wise
    symmetric int8, or bf16 (lossless for a bf16 checkpoint: the reference an int4 container
    is compared with). `embed_dtype` alone may also be int6 (format 1.3): group-wise symmetric
    6-bit, llama.cpp's Q6_K size for the head, and needs in_features a multiple of 64."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: Literal[4] = 4
    group_size: Literal[32, 64, 128] = 64
    symmetric: bool = True
    scale_dtype: ScaleDtype = "bf16"
    resident_dtype: ResidentDtype = "int8"
    embed_dtype: EmbedDtype = "bf16"
    expert_dtype: ResidentDtype = "int4"

    def expert_bits_per_weight(self) -> float:
        """Bits per routed-expert weight before blob padding: nibble + scale (+ zero) per group."""
        if self.expert_dtype == "bf16":
            return 16.0
        if self.expert_dtype == "int8":
            return 8 + 16 / self.group_size
        per_group = 16 * (1 if self.symmetric else 2)
        return self.bits + per_group / self.group_size

