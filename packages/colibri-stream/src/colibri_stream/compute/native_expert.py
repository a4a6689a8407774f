"""`NativeQ4Expert`: a routed expert computed by the native kernel straight from the container's
q4 bytes (compute/native_kernel.py); `NativeQ8Expert` the same from q8 bytes (`--quant int8`).

Preparing a missed expert is a copy of what was read (gate and up stacked into one [2F, d]
matrix, as `Int4Expert` fuses them), into row tiles where the matrices' shapes allow
(native_kernel.tile_rows: the same bytes, four rows' 64-byte chunks interleaved), so a decode
token reads each in one sequential stream, in the pass that copies them anyway. Activations
enter as int8 blocks (`QuantizedActivations`): the decode path quantizes a layer's input once and every expert
of the token reads it, and `forward_each` runs all of a token's experts in one kernel call per
projection (`forward_grouped`: every expert of a decode step of several sessions on its tokens); `forward` also takes a plain tensor of many rows (a prefill chunk's tokens routed
here), which the kernel takes four rows at a time per weight load (native_kernel.matmul).

The weights are the container's exactly; the activations are rounded to int8 per 32 columns (one
f32 scale each), as llama.cpp's Q4_0 x Q8_0 products do: about 0.5% relative error of a matrix
product on random data, against 0.2% for torch's kernel with bf16 activations.

q8 experts (a byte a weight) have no grouped kernel: each runs as its own two products (the
resident projections' q8 kernel), in one call for a decode token's experts (`forward_token`, and
the decode call's table), the token's outputs summed as the q4 experts' are.
Without them a `--quant int8` container took the dequantized route: every expert and resident
matrix in f32 (4 bytes a weight), a 24 x 64 Qwen3-MoE decoding 6.9 tok/s.
"""

from __future__ import annotations

import numpy as np
import torch
from colibri_int4 import ExpertBlob, ExpertBlobLayout
from colibri_model import ExpertGlu

from ..cache.slab import aligned, place
from .native_kernel import (
    BLOCK,
    QuantizedActivations,
    TokenExperts,
    kernel_flags,
    kernel_unavailable,
    matmul,
    q4_grouped,
    swiglu_rows,
    tile_rows,
    tileable,
    token_experts,
    token_experts_in,
    token_experts_out,
)

_PARTS = ("gate_up", "gate_up_scales", "gate_up_zeros", "down", "down_scales", "down_zeros",
          "gate_up_bias", "down_bias")


def native_supported(layout: ExpertBlobLayout, d_model: int, expert_dim: int) -> str | None:
    """None if the native kernel runs these experts here, else why not."""
    if layout.encoding not in ("q4", "q8"):
        return f"the routed experts are stored as {layout.encoding}, not int4 or int8"
    if layout.groups["gate"] != layout.groups["up"]:
        return "gate and up projections have different group sizes"
    for part, cols in (("gate", d_model), ("up", d_model), ("down", expert_dim)):
        group = layout.groups[part]
        if group % BLOCK or cols % group:
            return f"{part}_proj group size {group} is not a multiple of {BLOCK} dividing {cols} columns"
    return kernel_unavailable()


def _bits(array: np.ndarray) -> torch.Tensor:
    # a copy: the blob's views point into the read buffer, which the next read reuses
    return torch.from_numpy(np.array(array).view(np.int16))


class NativeQ4Expert:
    """Gate|up stacked and down, as q4 nibbles + 16-bit scales (+ zeros, + f32 biases)."""

    __slots__ = _PARTS + ("group_gate_up", "group_down", "expert_dim", "fp16_scales", "tiled", "glu", "nbytes",
                          "addresses", "token_addresses")
    ENCODING = "q4"  # the kernel's name for the stored weights
    WEIGHTS = "packed"  # the blob's field holding them (q8 blobs: `data`, and no zeros)

    def __init__(self, blob: ExpertBlob, glu: ExpertGlu):
        weights = getattr(blob, self.WEIGHTS)
        self.expert_dim = weights["gate"].shape[0]
        self.group_gate_up, self.group_down = blob.groups["gate"], blob.groups["down"]
        self.fp16_scales = blob.scale_dtype == "fp16"
        self.glu = glu
        both = ("gate", "up")
        # row tiles where the shapes allow: each of gate, up and down tiled from the read buffer
        self.tiled = tileable(*weights["gate"].shape) and tileable(*weights["down"].shape)
        if self.tiled:
            gate, down = (torch.from_numpy(np.ascontiguousarray(weights[p])) for p in ("gate", "down"))
            self.gate_up = torch.empty(2 * gate.shape[0], gate.shape[1], dtype=gate.dtype)
            tile_rows(gate, self.gate_up[: gate.shape[0]])
            tile_rows(torch.from_numpy(np.ascontiguousarray(weights["up"])), self.gate_up[gate.shape[0] :])
            self.down = tile_rows(down, torch.empty_like(down))
        else:
            self.gate_up = torch.from_numpy(np.concatenate([weights[p] for p in both]))
            self.down = torch.from_numpy(np.array(weights["down"]))
        self.gate_up_scales = _bits(np.concatenate([blob.scales[p] for p in both]))
        self.down_scales = _bits(blob.scales["down"])
        zeros = blob.zeros
        self.gate_up_zeros = _bits(np.concatenate([zeros[p] for p in both])) if zeros else None
        self.down_zeros = _bits(zeros["down"]) if zeros else None
        biases = blob.biases
        self.gate_up_bias = torch.from_numpy(np.concatenate([biases["gate"], biases["up"]]).astype(np.float32)) \
            if biases else None
        self.down_bias = torch.from_numpy(np.array(biases["down"], dtype=np.float32)) if biases else None
        self.nbytes = sum(aligned(t.nbytes) for t in self._parts().values())
        self._point()

    def _point(self) -> None:
        """(gate|up, down) as the kernel's (packed, scales, zeros or 0) addresses, for `forward_token`."""
        self.addresses = tuple((p.data_ptr(), s.data_ptr(), 0 if z is None else z.data_ptr()) for p, s, z in (
            (self.gate_up, self.gate_up_scales, self.gate_up_zeros), (self.down, self.down_scales, self.down_zeros)))
        self.token_addresses = self.addresses[0] + self.addresses[1]  # as native_kernel.token_experts takes them

    @property
    def one_call(self) -> tuple[int, int, int, int] | None:
        """(expert_dim, group_gate_up, group_down, kernel_flags) where a token's experts like this one
        run in one kernel call from `token_addresses` (swiglu, no biases), else None."""
        if self.glu.kind != "swiglu" or self.gate_up_bias is not None or self.down_bias is not None:
            return None
        return self.expert_dim, self.group_gate_up, self.group_down, kernel_flags(self.fp16_scales, self.tiled)

    def _parts(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _PARTS if getattr(self, name) is not None}

    def move_into(self, slot: torch.Tensor) -> None:
        """Copy the tensors into `slot` (uint8, >= nbytes) and use them from there (cache/slab.py)."""
        for name, view in place(self._parts(), slot).items():
            setattr(self, name, view)
        self._point()

    def forward(self, x: torch.Tensor | QuantizedActivations) -> torch.Tensor:
        """down(act(gate x, up x)) in f32, for x [M, d] (a tensor, or already quantized)."""
        gate_up = matmul(x, self.gate_up, self.gate_up_scales, self.gate_up_zeros, self.group_gate_up, self.ENCODING,
                         self.fp16_scales, self.tiled)
        if self.gate_up_bias is not None:
            gate_up += self.gate_up_bias
        hidden = self.activate(gate_up)
        out = matmul(hidden, self.down, self.down_scales, self.down_zeros, self.group_down, self.ENCODING,
                     self.fp16_scales, self.tiled)
        return out if self.down_bias is None else out.add_(self.down_bias)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gated activation of gate|up rows [M, 2F] -> [M, F]: swiglu in one C call, each value
        alone (native_kernel.swiglu_rows), so every path of these experts (a prefill chunk, a decode
        step of several sessions, one token) gives a row the same bits; other kinds by torch."""
        if self.glu.kind == "swiglu" and gate_up.dtype == torch.float32:
            return swiglu_rows(gate_up)
        return self.glu(*gate_up.split(self.expert_dim, dim=-1))

    @staticmethod
    def forward_each(experts: list[NativeQ4Expert], x: QuantizedActivations) -> torch.Tensor:
        """Row e: experts[e].forward(x) for one row x (a decode token), bitwise, in three kernel
        calls for all the experts together instead of two matmuls and a quantization each."""
        return NativeQ4Expert.forward_grouped(experts, x, [[0]] * len(experts))

    @staticmethod
    def forward_token(experts: list[NativeQ4Expert], x: torch.Tensor, weights: list[float], out: torch.Tensor) -> bool:
        """out [d] += experts[e].forward(x) * weights[e] for e in order, for one f32 row x [d]: bitwise
        `forward_each` then `add_weighted_rows`, in one kernel call for swiglu experts (two around the
        activation for other kinds): a decode token's experts. False, with nothing done, for experts
        with biases (`forward_each` adds them)."""
        first = experts[0]
        if first.gate_up_bias is not None or first.down_bias is not None:
            return False
        d, fp16 = first.gate_up.shape[1] * 2, first.fp16_scales
        if first.glu.kind == "swiglu":  # the whole token in one call
            token_experts(x, [a for e in experts for a in e.token_addresses], first.expert_dim, first.group_gate_up,
                          first.group_down, fp16, weights, out, tiled=first.tiled)
            return True
        gate_up = token_experts_in(x, TokenExperts([e.addresses[0] for e in experts], 2 * first.expert_dim, d,
                                                   first.group_gate_up, fp16, first.tiled))
        hidden = first.activate(gate_up).contiguous()
        token_experts_out(hidden, TokenExperts([e.addresses[1] for e in experts], d, first.expert_dim,
                                               first.group_down, fp16, first.tiled), weights, out)
        return True

    @staticmethod
    def forward_grouped(experts: list[NativeQ4Expert], x: QuantizedActivations, rows: list[list[int]]) -> torch.Tensor:
        """experts[e].forward on the rows `rows[e]` of x, for all of them in three kernel calls ->
        [sum of len(rows[e]), d], expert e's rows first, in the order given; each row bitwise what
        `forward` gives it (a decode step of several sessions: each expert on the tokens routed to it)."""
        first = experts[0]
        gate_up = q4_grouped(x, [(e.gate_up, e.gate_up_scales, e.gate_up_zeros) for e in experts], rows,
                             first.group_gate_up, fp16_scales=first.fp16_scales, tiled=first.tiled)
        counts = [len(r) for r in rows]
        if first.gate_up_bias is not None:
            gate_up += _per_row([e.gate_up_bias for e in experts], counts)
        hidden = QuantizedActivations(first.activate(gate_up))
        starts = [sum(counts[:e]) for e in range(len(counts))]
        out = q4_grouped(hidden, [(e.down, e.down_scales, e.down_zeros) for e in experts],
                         [list(range(s, s + n)) for s, n in zip(starts, counts)], first.group_down,
                         fp16_scales=first.fp16_scales, tiled=first.tiled)
        return out if first.down_bias is None else out.add_(_per_row([e.down_bias for e in experts], counts))


class NativeQ8Expert(NativeQ4Expert):
    """Gate|up stacked and down as q8 bytes + 16-bit scales (+ f32 biases), each product one call of
    the q8 kernel; a token's experts one after another (module doc)."""

    __slots__ = ()
    ENCODING = "q8"
    WEIGHTS = "data"

    @property
    def one_call(self) -> tuple[int, int, int, int, bool] | None:
        """As `NativeQ4Expert.one_call`, the last element saying q8."""
        shape = super().one_call
        return None if shape is None else (*shape, True)

    @staticmethod
    def forward_token(experts: list[NativeQ8Expert], x: torch.Tensor, weights: list[float], out: torch.Tensor) -> bool:
        """out [d] += experts[e].forward(x) * weights[e] for e in order (bitwise `forward_each` then
        `add_weighted_rows`) in one kernel call for swiglu experts without biases; else False."""
        first = experts[0]
        if first.one_call is None:
            return False
        token_experts(x, [a for e in experts for a in e.token_addresses], first.expert_dim, first.group_gate_up,
                      first.group_down, first.fp16_scales, weights, out, q8=True, tiled=first.tiled)
        return True

    @staticmethod
    def forward_each(experts: list[NativeQ8Expert], x: QuantizedActivations) -> torch.Tensor:
        """Row e: experts[e].forward(x) for one row x (a decode token)."""
        return torch.cat([e.forward(x) for e in experts])

    @staticmethod
    def forward_grouped(experts: list[NativeQ8Expert], x: QuantizedActivations, rows: list[list[int]]) -> torch.Tensor:
        """experts[e].forward on the rows `rows[e]` of x -> [sum of len(rows[e]), d], expert e's
        rows first (each row what `forward` gives it alone: the kernel's rows are independent)."""
        return torch.cat([e.forward(x[torch.tensor(r)]) for e, r in zip(experts, rows)])


def native_expert_class(layout: ExpertBlobLayout) -> type[NativeQ4Expert]:
    """The native expert for a container's blobs (`native_supported` first)."""
    return NativeQ8Expert if layout.encoding == "q8" else NativeQ4Expert


def _per_row(biases: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """Expert e's bias repeated for each of its counts[e] rows: [sum(counts), n]."""
    return torch.stack(biases).repeat_interleave(torch.tensor(counts), dim=0)


def native_nbytes(layout: ExpertBlobLayout, d_model: int, expert_dim: int) -> int:
    """RAM one native expert holds (a cache slot), from shapes alone."""
    gate_up_groups = 2 * expert_dim * (d_model // layout.groups["gate"])
    down_groups = d_model * (expert_dim // layout.groups["down"])
    weights = d_model * expert_dim  # one matrix's weights: q4 packs two a byte
    per_byte = 1 if layout.encoding == "q8" else 2
    parts = [2 * weights // per_byte, 2 * gate_up_groups, weights // per_byte, 2 * down_groups]
    if not layout.symmetric:
        parts += [2 * gate_up_groups, 2 * down_groups]
    if layout.bias:
        parts += [4 * 2 * expert_dim, 4 * d_model]
    return sum(aligned(n) for n in parts)
