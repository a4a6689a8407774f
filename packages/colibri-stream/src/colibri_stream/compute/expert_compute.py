"""One routed expert ready to compute: torch's CPU int4 kernels, and a dequantized reference.

`Int4Expert` repacks a verified blob (colibri-int4's `ExpertBlob`: packed nibbles + 16-bit
scales, optional zeros) into the layout of `torch.ops.aten._weight_int4pack_mm_for_cpu`:

    weight  [N, K] int32 nibbles (0..15)  --_convert_weight_to_int4pack_for_cpu-->  uint8 [N, K/2]
    scales_and_zeros [K/G, N, 2]:  w[n, k] = (q[n, k] - 8) * sz[k//G, n, 0] + sz[k//G, n, 1]

That is exactly the container's convention (FORMAT.md: `(q - 8) * s (+ z)`), so symmetric
groups get zero = 0 and asymmetric ones their stored float zero; no re-quantization, so the
int4 path computes with bit-identical weights to the dequantized reference. The gate and up
projections share K and G, so they are concatenated into one [2*expert_dim, d] matrix: one
kernel call instead of two per token.

The kernel's constraints (torch 2.13): N a multiple of 16, G in {32, 64, 128, 256} dividing K,
activations fp32/bf16 with scales_and_zeros of the same dtype. `int4_supported` checks them;
the engine falls back to the dequantized path otherwise.

NOTE: only the bf16 activation path of `_weight_int4pack_mm_for_cpu` is fast. Measured here
(Xeon with AMX/AVX512-BF16, 1 thread, a NanoColibri expert 1024x512, one token): int4 with bf16
activations 118 us, the same kernel with fp32 activations 2758 us, a dequantized fp32 SwiGLU
355 us. So `kernel_dtype` defaults to bf16 (about 3x faster than fp32 dense, 6x less RAM); the
fp32 kernel is kept for exactness tests: it computes the same weights to fp32 rounding.

`DequantExpert` holds fp32/bf16 matrices (4-8x the bytes) and runs plain matmuls: the
readable reference the fast path is tested against, and the path used on CUDA.

Both expose `forward(x) -> down(act(gate x, up x))` (without the gate weight) and `nbytes`,
the RAM they hold, which the cache counts against the budget. `act` is colibri-model's
`ExpertGlu` of the model config (SwiGLU, or GPT-OSS's clamped SwiGLU), so the streamed experts
compute the activation the model defines; when the blob carries biases (format 1.2) they are
added after each projection (held in the compute dtype, a few KB per expert).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from colibri_int4 import ExpertBlob, ExpertBlobLayout
from colibri_model import ExpertGlu

from ..cache.slab import aligned, place
from ..compute.int4_repack import pack_for_cpu_kernel

INT4_GROUPS = (32, 64, 128, 256)


def int4_supported(layout: ExpertBlobLayout, d_model: int, expert_dim: int) -> str | None:
    """None if the int4 kernels can run these shapes, else the reason they cannot."""
    if layout.encoding != "q4":
        return f"the routed experts are stored as {layout.encoding}, not int4"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "this torch build has no _weight_int4pack_mm_for_cpu"
    for part, n_out in (("gate", expert_dim), ("up", expert_dim), ("down", d_model)):
        if n_out % 16:
            return f"{part}_proj has {n_out} output rows; the int4 kernel needs a multiple of 16"
        if layout.groups[part] not in INT4_GROUPS:
            return f"{part}_proj group size {layout.groups[part]} is not one of {INT4_GROUPS}"
    return None


def _half_to_tensor(bits: np.ndarray, scale_dtype: str) -> torch.Tensor:
    """uint16 bit patterns of bf16/fp16 -> fp32 tensor (exact)."""
    t = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16))
    return t.view(torch.bfloat16 if scale_dtype == "bf16" else torch.float16).float()


def _biases(blob: ExpertBlob, dtype: torch.dtype, device="cpu") -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gate|up bias [2 * expert_dim], down bias [d_model]) in `dtype`, or (None, None)."""
    if blob.biases is None:
        return None, None
    gate_up = np.concatenate([blob.biases["gate"], blob.biases["up"]])
    return (torch.from_numpy(gate_up).to(device=device, dtype=dtype),
            torch.from_numpy(np.array(blob.biases["down"])).to(device=device, dtype=dtype))


def _bias_nbytes(layout: ExpertBlobLayout, d_model: int, expert_dim: int, elem: int) -> tuple[int, int]:
    return (2 * expert_dim * elem, d_model * elem) if layout.bias else (0, 0)


_INT4_PARTS = ("gate_up", "gate_up_sz", "down", "down_sz")
SWIGLU = ExpertGlu()


class Int4Expert:
    """Gate|up fused and down, in torch's CPU int4-pack layout (and their biases, if any)."""

    __slots__ = (
        "gate_up",
        "gate_up_sz",
        "down",
        "down_sz",
        "gate_up_bias",
        "down_bias",
        "group_gate_up",
        "group_down",
        "expert_dim",
        "glu",
        "nbytes",
    )

    def __init__(self, blob: ExpertBlob, dtype: torch.dtype = torch.bfloat16, glu: ExpertGlu = SWIGLU):
        """`dtype`: the kernel's activation (and scales_and_zeros) dtype, bf16 or fp32."""
        self.expert_dim = blob.packed["gate"].shape[0]
        if blob.groups["gate"] != blob.groups["up"]:
            raise ValueError("gate and up projections must share a group size to be fused")
        self.glu = glu
        self.group_gate_up, self.group_down = blob.groups["gate"], blob.groups["down"]
        self.gate_up, self.gate_up_sz = self._pack(blob, ("gate", "up"), dtype)
        self.down, self.down_sz = self._pack(blob, ("down",), dtype)
        self.gate_up_bias, self.down_bias = _biases(blob, dtype)
        # what a slab slot holds: each part starts on a cache line (cache/slab.py, place)
        self.nbytes = sum(aligned(t.nbytes) for t in self._parts().values())

    def _parts(self) -> dict[str, torch.Tensor]:
        parts = {name: getattr(self, name) for name in _INT4_PARTS}
        if self.gate_up_bias is not None:
            parts.update(gate_up_bias=self.gate_up_bias, down_bias=self.down_bias)
        return parts

    def move_into(self, slot: torch.Tensor) -> None:
        """Copy the prepared tensors into `slot` (uint8, >= nbytes) and use them from there; the
        heap copies are freed (cache/slab.py says why)."""
        parts = place(self._parts(), slot)
        for name, view in parts.items():
            setattr(self, name, view)

    @staticmethod
    def _pack(
        blob: ExpertBlob, parts: tuple[str, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        packed = np.concatenate([blob.packed[p] for p in parts], axis=0)
        weight = pack_for_cpu_kernel(packed)  # == the converter's output, 2-5x faster (int4_repack.py)
        scales = torch.cat([_half_to_tensor(blob.scales[p], blob.scale_dtype) for p in parts], 0)  # [N, K/G]
        if blob.zeros is not None:
            zeros = torch.cat([_half_to_tensor(blob.zeros[p], blob.scale_dtype) for p in parts], 0)
        else:
            zeros = torch.zeros_like(scales)
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return weight, scales_and_zeros  # [N, K/2] uint8, [K/G, N, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.gate_up_sz.dtype
        xs = x.to(dtype)
        gate_up = torch.ops.aten._weight_int4pack_mm_for_cpu(
            xs, self.gate_up, self.group_gate_up, self.gate_up_sz
        )
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias
        gate, up = gate_up.split(self.expert_dim, dim=-1)
        hidden = self.glu(gate, up).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(hidden, self.down, self.group_down, self.down_sz)
        return out if self.down_bias is None else out + self.down_bias


class DequantExpert:
    """Plain dequantized matrices: the reference path (and the CUDA path), and the only path
    for int8 and bf16 experts (format 1.1)."""

    __slots__ = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias", "glu", "nbytes")

    def __init__(self, blob: ExpertBlob, dtype: torch.dtype, device: torch.device | str = "cpu",
                 glu: ExpertGlu = SWIGLU):
        weights = blob.dequantize()  # fp32 numpy, exactly (q - 8) * s (+ z)
        self.gate, self.up, self.down = (
            torch.from_numpy(weights[p]).to(device=device, dtype=dtype) for p in ("gate", "up", "down")
        )
        self.gate_bias = self.up_bias = self.down_bias = None
        if blob.biases is not None:
            self.gate_bias, self.up_bias, self.down_bias = (
                torch.from_numpy(np.array(blob.biases[p])).to(device=device, dtype=dtype) for p in ("gate", "up", "down")
            )
        self.glu = glu
        self.nbytes = sum(t.nbytes for t in (self.gate, self.up, self.down, self.gate_bias, self.up_bias, self.down_bias)
                          if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.to(self.gate.dtype)
        hidden = self.glu(F.linear(xs, self.gate, self.gate_bias), F.linear(xs, self.up, self.up_bias))
        return F.linear(hidden, self.down, self.down_bias)


def prepared_nbytes(
    layout: ExpertBlobLayout, d_model: int, expert_dim: int, compute: str, dtype: torch.dtype
) -> int:
    """RAM one prepared expert holds (what a cache slot costs), from shapes alone."""
    elem = torch.empty((), dtype=dtype).element_size()
    weights = 3 * d_model * expert_dim
    biases = _bias_nbytes(layout, d_model, expert_dim, elem)
    if compute == "dequant":
        return weights * elem + sum(biases)
    groups_gate_up = 2 * expert_dim * (d_model // layout.groups["gate"])
    groups_down = d_model * (expert_dim // layout.groups["down"])
    parts = (d_model * expert_dim, 2 * elem * groups_gate_up, d_model * expert_dim // 2, 2 * elem * groups_down)
    # gate|up and down nibbles, their scales and zeros, and the biases when there are any
    return sum(aligned(n) for n in parts) + sum(aligned(n) for n in biases if n)
