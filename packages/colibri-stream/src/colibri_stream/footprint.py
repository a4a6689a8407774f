"""The sizes of one configuration (`Footprint`) and the split of a budget (`Budget`).

    budget = resident weights        (every non-routed tensor, materialised in the engine dtype,
                                      but an untied embedding and `mapped_projections`: mapped
                                      from the container file)
           + KV cache                (batch 1, `max_context` positions, all layers)
           + workspace               (activations of one prefill chunk, logits included; estimate)
           + staging buffers         (page-aligned blob buffers that misses are read into)
           + tokenizer               (estimate: 900 bytes per vocabulary entry, calibrated)
           + heap slack              (freed memory the C heap may hold until trimmed, io/heap.py)
           + cache slots x slot size (prepared routed experts: int4-pack layout or dequantized)

Weights, caches and buffers are counted exactly from tensor sizes, read from the container's
header; the workspace is an upper estimate of the live activations of one forward pass over
`prefill_chunk` tokens. Not counted: the interpreter and torch's own memory (io/memory_cap.py
counts those when fitting under a cgroup). plan.py chooses which configuration to size. The
compute route of each dtype comes in resolved (`ComputeRoutes`, compute/choice.py): nothing here
times a kernel.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, replace

import torch
from colibri_int4 import Container
from colibri_model import ColibriConfig, held_dtype
from colibri_spec import most_decompressed_keys

from .compute.choice import ComputeRoutes
from .compute.expert_compute import prepared_nbytes
from .compute.native_expert import native_nbytes
from .compute.native_linear import native_linear_name, native_tied_head
from .errors import BudgetError
from .io.heap import slack_bytes as heap_slack_bytes
from .options import EngineOptions
from .session_kv import sliding_windows, windowed_positions
from .sizes import aligned, format_size
from .stored_embedding import stored_embedding_name

# NOTE: a loaded byte-level BPE tokenizer holds its vocabulary and merges in Rust structures that
# torch never sees. Measured for SmolLM2's 49152 tokens (AMD EPYC, tokenizers 0.22): 40-44 MB of
# anonymous RSS right after a process's first load, about 880 bytes per token, of which all but
# 13.4 MB (270 bytes per token) is freed heap from parsing tokenizer.json: the engine gives it back
# (malloc_trim) right after the load, before it builds its weights or cache, so only what stays is
# counted (the load's own peak comes while nothing else of the budget is held). The plan counts the
# model's vocabulary (config.vocab_size, which the tokenizer must fit in), so it needs no tokenizer
# loaded.
TOKENIZER_BYTES_PER_TOKEN = 300


@dataclass(frozen=True)
class Budget:
    """One budget split (what `Engine.budget` is)."""

    ram_budget: int
    resident_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    staging_bytes: int
    slot_bytes: int
    slots: int
    total_experts: int
    other_bytes: int = 0  # the tokenizer (an estimate, TOKENIZER_BYTES_PER_TOKEN)
    heap_slack_bytes: int = 0  # freed heap held until trimmed (io/heap.py)

    @property
    def cache_capacity_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def fixed_bytes(self) -> int:
        return (self.resident_bytes + self.kv_cache_bytes + self.workspace_bytes + self.staging_bytes
                + self.other_bytes + self.heap_slack_bytes)

    @property
    def accounted_bytes(self) -> int:
        return self.fixed_bytes + self.cache_capacity_bytes

    def describe(self) -> str:
        return (
            f"budget {format_size(self.ram_budget)}: resident {format_size(self.resident_bytes)}, "
            f"KV cache {format_size(self.kv_cache_bytes)}, workspace {format_size(self.workspace_bytes)}, "
            f"staging {format_size(self.staging_bytes)}, tokenizer {format_size(self.other_bytes)}, "
            f"heap slack {format_size(self.heap_slack_bytes)}, expert cache {self.slots} x "
            f"{format_size(self.slot_bytes)} = {format_size(self.cache_capacity_bytes)} "
            f"({self.slots}/{self.total_experts} experts)"
        )


@dataclass(frozen=True)
class Footprint:
    """The sizes of one resolved configuration, none of which depends on the budget."""

    dtype: torch.dtype  # resident weights, activations, KV cache
    compute: str  # "native" | "int4" | "dequant"
    expert_compute_dtype: torch.dtype  # activations inside the expert kernels (or the dequantized weights)
    max_context: int
    prefill_chunk: int
    top_k: int
    prefetch_threads: int  # workers whose buffers are counted in staging (0: prefetch reads nothing)
    resident_by_dtype: dict[str, int]
    kv_cache_bytes: int
    workspace_bytes: int
    staging_bytes: int
    tokenizer_bytes: int
    heap_slack_bytes: int
    slot_bytes: int
    n_experts: int
    total_experts: int
    mapped_bytes: int = 0  # mapped from the container (page cache, not in the budget): the embedding, `mapped_projections`
    mapped_projections: tuple[str, ...] = ()  # native projections computed on the map rather than held (Sizing.mappable)

    @property
    def expert_dtype(self) -> torch.dtype:
        """Deprecated old name of `expert_compute_dtype` (read for the 0.x series, with a
        DeprecationWarning): the dtype the expert kernels compute in, not a storage format like
        colibri-int4's `expert_dtype`."""
        warnings.warn("Footprint.expert_dtype is deprecated: use expert_compute_dtype (the dtype the expert "
                      "kernels compute in)", DeprecationWarning, stacklevel=2)
        return self.expert_compute_dtype

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident_by_dtype.values())

    @property
    def fixed_bytes(self) -> int:
        return (self.resident_bytes + self.kv_cache_bytes + self.workspace_bytes + self.staging_bytes
                + self.tokenizer_bytes + self.heap_slack_bytes)

    @property
    def working_set_slots(self) -> int:
        return min(self.top_k, self.n_experts) if self.total_experts else 0

    @property
    def min_budget(self) -> int:
        return self.fixed_bytes + self.working_set_slots * self.slot_bytes

    @property
    def full_budget(self) -> int:
        return self.fixed_bytes + self.total_experts * self.slot_bytes

    def describe(self) -> str:
        return (f"dtype {dtype_name(self.dtype)}, compute {self.compute}, max_context {self.max_context}, "
                f"prefill_chunk {self.prefill_chunk}")

    def split(self, ram_budget: int) -> Budget:
        """The budget split at `ram_budget`; `BudgetError` (naming the minimum) below it."""
        if ram_budget < self.min_budget:
            raise BudgetError(self.too_small(ram_budget), self.min_budget)
        slots = min(self.total_experts, (ram_budget - self.fixed_bytes) // self.slot_bytes) if self.slot_bytes else 0
        return Budget(ram_budget, self.resident_bytes, self.kv_cache_bytes, self.workspace_bytes,
                      self.staging_bytes, self.slot_bytes, int(slots), self.total_experts,
                      self.tokenizer_bytes, self.heap_slack_bytes)

    def too_small(self, ram_budget: int) -> str:
        m = self.min_budget
        return (
            f"ram budget {format_size(ram_budget)} ({ram_budget} bytes) is too small: the minimum is "
            f"{format_size(m)} ({m} bytes) = resident {format_size(self.resident_bytes)} + KV cache "
            f"{format_size(self.kv_cache_bytes)} + workspace {format_size(self.workspace_bytes)} + staging "
            f"{format_size(self.staging_bytes)} + tokenizer {format_size(self.tokenizer_bytes)} + heap slack "
            f"{format_size(self.heap_slack_bytes)} + one layer's working set ({self.top_k} x "
            f"{format_size(self.slot_bytes)}) with {self.describe()}"
        )


def _accepting_the_old_name(init):
    """`Footprint(..., expert_dtype=...)` and `dataclasses.replace(f, expert_dtype=...)`: the old
    name of `expert_compute_dtype`, accepted for the 0.x series with a DeprecationWarning (it
    wins over the current name, which `replace` passes too)."""

    @functools.wraps(init)
    def __init__(self, *args, expert_dtype: torch.dtype | None = None, **kwargs):
        if expert_dtype is not None:
            warnings.warn("Footprint(expert_dtype=...) is deprecated: use expert_compute_dtype (the dtype the "
                          "expert kernels compute in)", DeprecationWarning, stacklevel=2)
            kwargs["expert_compute_dtype"] = expert_dtype
        init(self, *args, **kwargs)

    return __init__


Footprint.__init__ = _accepting_the_old_name(Footprint.__init__)


def kv_cache_bytes(config: ColibriConfig, max_context: int, elem: int, prefill_chunk: int) -> int:
    """One session at `max_context` positions: every layer's keys and values (their widths differ
    under MLA), a sliding-window layer's only up to what it keeps (`SlidingKV`)."""
    sliding = SlidingKV.of(config, elem, prefill_chunk)
    return config.kv_bytes_per_position(elem) * max_context - (sliding.saving(max_context) if sliding else 0)


@dataclass(frozen=True)
class SlidingKV:
    """Sliding-window layers (GPT-OSS's `sliding_layers`) in a session's KV cache: each holds at
    most `positions` = `window - 1 + 2 x prefill_chunk` columns whatever the context (the window
    before a pass, a chunk of slack for truncates, the pass itself: session_kv.py), so `saving`
    is what they take less than layers keeping every position."""

    layers: int
    total_layers: int
    window: int
    layer_bytes_per_position: int
    prefill_chunk: int

    @classmethod
    def of(cls, config: ColibriConfig, elem: int, prefill_chunk: int) -> SlidingKV | None:
        windows = [w for w in sliding_windows(config) if w is not None]
        if not windows:
            return None
        per_layer = config.kv_bytes_per_position(elem) // config.n_layers  # every GPT-OSS layer alike
        return cls(len(windows), config.n_layers, windows[0], per_layer, prefill_chunk)

    @property
    def positions(self) -> int:
        return windowed_positions(self.window, self.prefill_chunk)

    def saving(self, context: int) -> int:
        return self.layers * self.layer_bytes_per_position * (context - min(context, self.positions))


def workspace_bytes(config: ColibriConfig, prefill_chunk: int, max_context: int, elem: int) -> int:
    """Upper estimate of one forward pass's live activations over `prefill_chunk` tokens."""
    t = prefill_chunk
    widest_ffn = max(config.dense_ffn_dim, config.shared_expert_dim, 2 * config.expert_dim)
    hidden = 6 * t * config.d_model * max(elem, 4)  # residual, normed, attn out, fp32 norm temporaries
    # SDPA's scores (the explicit softmax of sink layers, GPT-OSS, holds the scores, the scores with
    # the sink column and the probabilities at once), and q, k and v of the chunk (MLA: its absorbed
    # query and attention output, r + rope wide per head, or the decompressed keys and values)
    scores = 3 * config.n_heads * t * (max_context + 1) * 4 if config.attn_sinks else config.n_heads * t * max_context * 4
    heads_width = config.n_heads * (2 * config.key_head_dim + config.value_head_dim)
    attention = scores + t * heads_width * elem + mla_decompressed_bytes(config, t, max_context, elem)
    if config.attention_kind == "mla":  # the absorbed form's boolean mask, repeated per head
        attention += config.n_heads * t * max_context
    ffn = 3 * t * widest_ffn * max(elem, 4)
    logits = 2 * t * config.vocab_size * 4  # logits, and their fp32 copy for sampling/softmax
    return hidden + attention + ffn + logits


def mla_decompressed_bytes(config: ColibriConfig, prefill_chunk: int, max_context: int, elem: int) -> int:
    """MLA's decompressed form (mla_cost.py chooses it for a pass whose past is short against its
    chunk) holds per-head keys and values of every position it attends: kv_b_proj's output
    (n + v per head), the keys with the rope part (n + rope) and a contiguous copy of the values
    (v). The most over the batch widths a pass may take (B rows of prefill_chunk // B columns)."""
    if config.attention_kind != "mla":
        return 0
    n, v = config.qk_nope_head_dim, config.v_head_dim
    per_key = config.n_heads * (2 * n + config.qk_rope_head_dim + 2 * v) * elem
    most = max(rows * most_decompressed_keys(prefill_chunk // rows, max_context, config.kv_lora_rank, n, v)
               for rows in range(1, prefill_chunk + 1))
    return most * per_key


class Sizing:
    """Computes a `Footprint` for given knobs, with the compute route resolved for each dtype."""

    def __init__(self, container: Container, config: ColibriConfig, opts: EngineOptions, top_k: int,
                 compute: ComputeRoutes):
        self.container, self.config, self.opts, self.top_k = container, config, opts, top_k
        self.layout = container.blob_layout
        self.routes = compute

    def compute(self, dtype: torch.dtype) -> str:
        return self.routes.route(dtype)

    def footprint(self, dtype: torch.dtype, max_context: int, chunk: int, threads: int,
                  mapped: tuple[str, ...] = ()) -> Footprint:
        """The sizes with these knobs; `mapped`: names from `mappable(dtype)` computed on the
        container's map instead of held in the budget."""
        config, opts, layout = self.config, self.opts, self.layout
        compute = self.compute(dtype)
        expert_compute_dtype = {"int4": opts.kernel_dtype, "native": torch.float32}.get(compute, dtype)
        elem = torch.empty((), dtype=dtype).element_size()
        if layout is None:
            slot = 0
        elif compute == "native":
            slot = native_nbytes(layout, config.d_model, config.expert_dim)
        else:
            slot = prepared_nbytes(layout, config.d_model, config.expert_dim, compute, expert_compute_dtype)
        by_dtype = self.resident_by_dtype(dtype, frozenset(mapped))
        blob = layout.blob_length if layout else 0
        f = Footprint(
            dtype, compute, expert_compute_dtype, max_context, min(chunk, max_context), self.top_k, threads, by_dtype,
            kv_cache_bytes(config, max_context, elem, min(chunk, max_context)),
            workspace_bytes(config, min(chunk, max_context), max_context, elem),
            0, TOKENIZER_BYTES_PER_TOKEN * config.vocab_size, heap_slack_bytes(blob, compute),
            slot, config.n_experts, config.n_moe_layers * config.n_experts, self.mapped_bytes(dtype, frozenset(mapped)),
            tuple(mapped),
        )
        return replace(f, staging_bytes=self.staging(f, threads))

    def resident_by_dtype(self, dtype: torch.dtype, mapped: frozenset[str] = frozenset()) -> dict[str, int]:
        """Bytes of the materialised resident model by held dtype, with `dtype` as engine dtype
        ("q4"/"q8", and "q6" for a 6-bit head, for the projections a native engine keeps as stored,
        compute/native_linear.py), but the projections `mapped`."""
        by_dtype: dict[str, int] = {}
        native = self.compute(dtype) == "native"
        for t in self.container.header.tensors:
            if t.name in mapped:
                continue
            in_arena = native and self._native_projection(t)
            if in_arena:  # weights + scales (+ zeros) as stored, in the model's huge-page arena
                by_dtype[t.encoding] = by_dtype.get(t.encoding, 0) + aligned(t.length)
            if in_arena or self._mapped(t, native):
                continue  # (mapped: `mapped_bytes`, page cache rather than the budget; a tied head's embedding is both)
            target = held_dtype(t.shape, dtype, t.name)  # colibri-model's rule, as resident.py materialises
            n = target.itemsize * _numel(t.shape)
            by_dtype[dtype_name(target)] = by_dtype.get(dtype_name(target), 0) + n
        # the routers' token counters (fp32 buffers the model keeps even when not counting)
        by_dtype["f32"] = by_dtype.get("f32", 0) + 4 * self.config.n_moe_layers * self.config.n_experts
        return by_dtype

    def mapped_bytes(self, dtype: torch.dtype, mapped: frozenset[str] = frozenset()) -> int:
        """Stored bytes of the resident tensors the engine maps from the container: the embedding
        (stored_embedding.py) and the projections `mapped` (a tied head's are the embedding's, once)."""
        native = self.compute(dtype) == "native"
        return sum(t.length for t in self.container.header.tensors if self._mapped(t, native) or t.name in mapped)

    def mappable(self, dtype: torch.dtype) -> list[tuple[str, int]]:
        """(name, bytes the budget holds) of the projections a native engine can compute on the
        container's map instead of holding (compute/native_linear.py), in the order a budget too
        small for them maps them: the layers' from the last layer down, then the LM head. Each is
        read whole by every token, so mapping one moves its bytes from the budget to the page
        cache; where that is short too, they are read from the file again every token."""
        if self.compute(dtype) != "native":
            return []
        found = [t for t in self.container.header.tensors if self._native_projection(t)]
        layers = [t for t in found if t.name.startswith("layers.")]
        rest = [t for t in found if not t.name.startswith("layers.")]
        return [(t.name, aligned(t.length)) for t in layers[::-1] + rest]

    def _native_projection(self, t) -> bool:
        """Whether a native engine holds `t` as stored, in its arena: a projection, or a tied head."""
        group = self.container.scheme.group_size
        return native_linear_name(t.name, t.encoding, t.shape, group) or self._tied_head(t, True)

    def _tied_head(self, t, native: bool) -> bool:
        """Whether `t` is a tied embedding whose head a native engine holds as stored (native_linear.py)."""
        return native and native_tied_head(t.name, t.encoding, t.shape, self.container.scheme.group_size,
                                           self.config.tie_embeddings)

    def _mapped(self, t, native: bool) -> bool:
        return stored_embedding_name(t.name, self.config.tie_embeddings, head_apart=self._tied_head(t, native))

    def staging(self, f: Footprint, threads: int) -> int:
        # Prefetch workers each hold a staging buffer and, until it is stored, one prepared expert.
        blob = self.layout.blob_length if self.layout else 0
        return blob + threads * (blob + f.slot_bytes) if blob else 0


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
