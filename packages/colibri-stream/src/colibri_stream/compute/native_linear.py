"""`NativeLinear`: a resident projection (attention, dense FFN, shared expert, LM head) computed by
the native kernel from the container's q4 or q8 bytes, as llama.cpp keeps its weights; an LM head
also from q6 (6.5 bits a weight at group 32, the size of llama.cpp's Q6_K head) or bf16 bytes.

With `compute="native"` the engine holds these matrices as stored (q4: nibbles + 16-bit scales,
about 0.53 bytes per weight at group 64; q8: about 1.03) instead of dequantized f32 (4 bytes):
the resident part shrinks 4-8x, which lowers the smallest budget a model runs in, and a decode
step, which reads every resident matrix once per token, reads that much less. A bf16 LM head held
as stored is half of f32 (152k x 2048: 0.62 GB instead of 1.24 GB), each product exact and the
sums in f32 (compute/native/q4_matvec.c, `colibri_bf16w_matmul`). Embeddings,
norms, routers and biases stay as they are (a lookup, or a few KB).

A projection may also be computed on the container's map itself (`arena=None`; the plan's
`mapped_projections`, where a budget cannot hold them all): no copy and no tiles, the page
cache's read-only bytes in the row-major layout they are stored in, which every kernel path takes
with the same results as the tiled copy.

`native_linear_name` is the one rule for which tensors go this way; the footprint and the model
builder both read it, so the plan counts exactly what the engine holds. A tied model's embedding
doubles as its head: `native_tied_head` says when the head is held the same way, from the
embedding's stored bytes (a decode token reads the head whole: SmolLM2-135M's 49k x 576 table is
113 MB in f32 against 29 MB as q8), the lookups then served from the file as for an untied one.

Projections that read the same input (q, k and v of one attention; gate and up of one FFN) share
its int8 quantization: one `SharedInput` per model remembers the last quantized input with the
tensor it came from (and its version counter, where it has one), so another tensor, or an
in-place change outside inference mode, quantizes anew. NOTE: inference tensors have no version counter; the model's
forward never changes a projection's input in place between two projections, and must not.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from ..io.huge_pages import HugePageArena
from ..stored_embedding import EMBEDDING
from . import native_kernel
from .native_kernel import BLOCK, QuantizedActivations, bf16_matmul, matmul, tile_rows, tileable

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def native_linear_name(name: str, encoding: str, shape, group_size: int) -> bool:
    """True when the resident tensor `name` is held as a `NativeLinear` under compute="native"."""
    module, _, leaf = name.rpartition(".")
    if leaf != "weight" or len(shape) != 2:
        return False
    if encoding == "bf16":  # the vocab projection: half of f32's bytes, read once per token
        return module == "lm_head" and shape[1] % 16 == 0
    if encoding == "q6":  # the head's 6-bit encoding (colibri-int4's embed_dtype int6)
        return module == "lm_head" and shape[1] % 64 == 0 and group_size % BLOCK == 0
    if encoding not in ("q4", "q8") or group_size % BLOCK or shape[1] % BLOCK:
        return False
    return module == "lm_head" or module.rpartition(".")[2] in PROJECTIONS


def native_tied_head(name: str, encoding: str, shape, group_size: int, tied: bool) -> bool:
    """True when the resident tensor `name` is a tied model's embedding that a native engine also
    holds as the LM head's `NativeLinear` (the head's own rule, on the embedding's bytes)."""
    return tied and name == EMBEDDING and native_linear_name("lm_head.weight", encoding, shape, group_size)


class NativeLinear(nn.Module):
    """y = x W^T (+ b) with W as stored (q4, q8, or q6 and bf16 for the LM head); in and out in the
    caller's dtype, f32 inside."""

    def __init__(self, raw, bias: bool, arena: HugePageArena | None, shared_input: SharedInput | None = None):
        """`raw`: colibri-int4's RawTensor of the weight (q4, q6, q8, bf16); `arena`: where its stored
        bytes go (`sizes.aligned` of the tensor's stored length), or None to compute on `raw`'s own
        bytes, a map of the container (`Container.map_resident`: `mapped`); `shared_input`: the
        model's memo of its last quantized input (one per model; a new one if None)."""
        super().__init__()
        self.shared_input = shared_input or SharedInput()
        self.out_features, self.in_features = raw.shape
        self.encoding, self.group, self.fp16_scales = raw.encoding, raw.group_size, raw.scale_dtype == "fp16"
        parts = [raw.data.view(np.int16) if raw.encoding == "bf16" else raw.data]
        parts += [p.view(np.int16) for p in (raw.scales, raw.zeros) if p is not None]
        self.mapped = arena is None
        if self.mapped:
            # the page cache's bytes, read in place by every product and never written (so kept
            # row-major, as stored) and not buffers: nothing counts them as the budget's
            held = [_read_only_tensor(p) for p in parts]
            self.data = held.pop(0)
            self.scales = held.pop(0) if raw.scales is not None else None
            self.zeros = held.pop(0) if raw.zeros is not None else None
            self.tiled = False
        else:
            # a copy in torch's memory (the read buffer is not kept), on huge pages: a decode token
            # streams it whole (io/huge_pages.py); not persistent: the container's bytes, not a state_dict entry
            held = list(arena.copy(*parts))
            self.register_buffer("data", held.pop(0), persistent=False)
            self.register_buffer("scales", held.pop(0) if raw.scales is not None else None, persistent=False)
            self.register_buffer("zeros", held.pop(0) if raw.zeros is not None else None, persistent=False)
            # q4, q8 and q6 in row tiles where the shape allows: a token's product streams each in one
            # sequential read (native_kernel.tile_rows)
            q6 = raw.encoding == "q6"
            self.tiled = raw.encoding in ("q4", "q8", "q6") and tileable(*self.data.shape, q6=q6)
            if self.tiled:
                tile_rows(self.data, q6=q6)
        self.bias = nn.Parameter(torch.empty(self.out_features, device="meta")) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.encoding == "bf16":  # f32 activations as they are: nothing to quantize or share
            out = bf16_matmul(x.reshape(-1, self.in_features), self.data)
        else:
            out = matmul(self.shared_input.quantized(x, self.in_features), self.data, self.scales, self.zeros,
                         self.group, self.encoding, self.fp16_scales, self.tiled)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        held = ", row tiles" if self.tiled else ", mapped from the container" if self.mapped else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.encoding} group {self.group}{held}"


def _read_only_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only array's memory (a map of the container), without torch's warning
    that it cannot enforce read-only: nothing here writes a projection's weights."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


class SharedInput:
    """The last input a model's native projections quantized: (tensor, its version, its
    quantization), one entry read and replaced whole, so sessions of one engine on other threads
    at worst quantize again; holding the tensor keeps its identity unique."""

    def __init__(self):
        self._last: tuple = (None, -1, None)

    def quantized(self, x: torch.Tensor, cols: int) -> torch.Tensor | QuantizedActivations:
        rows = x.reshape(-1, cols)
        limit = native_kernel.DENSE_FROM_ROWS
        if limit is not None and rows.shape[0] >= limit:
            return rows  # the dense path takes the tensor itself
        version = -1 if x.is_inference() else x._version
        tensor, last_version, quantized = self._last
        if tensor is x and last_version == version:
            return quantized
        quantized = QuantizedActivations(rows)
        self._last = (x, version, quantized)
        return quantized


def install(model: nn.Module, name: str, raw, arena: HugePageArena | None,
            shared_input: SharedInput | None = None) -> None:
    """Replace the nn.Linear whose weight is `name` with a NativeLinear of `raw` (pass one
    `arena` for all of a model's projections' bytes, or None for one computed on `raw`'s mapped
    bytes, and one `shared_input`, so those reading one tensor share its quantization)."""
    path = name.rpartition(".")[0]
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    linear = getattr(parent, attr)
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{path} is a {type(linear).__name__}, not the nn.Linear a native projection replaces")
    setattr(parent, attr, NativeLinear(raw, bias=linear.bias is not None, arena=arena, shared_input=shared_input))
