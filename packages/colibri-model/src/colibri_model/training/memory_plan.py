"""The memory planner: per-GPU bytes of a training configuration, from the config alone.

`plan_memory(config, micro_batch=8, seq_len=2048)` adds up, per GPU:

- fp32 master parameters, fp32 gradients and AdamW's two fp32 moments (sharded 1/N under FSDP2);
- bf16 compute copies: without FSDP, autocast's cast of every matmul weight (cached for the
  micro-batch, saved for backward) plus, on the issue-19 path, the expert backend's bf16 cast of
  the stacked experts; under FSDP2 with a bf16 MixedPrecisionPolicy, the all-gathered bf16
  parameters of two blocks (one computing, one prefetched) and one block's unsharded fp32
  gradients before the reduce-scatter;
- saved activations per layer and by kind (activations.py; measured against the eager model on
  CPU to the byte, tests/test_memory_plan.py), or only the block inputs under full activation
  checkpointing;
- transients: the cross-entropy's working set (whole-batch: two fp32 N x V gradients; chunked:
  about 12 bytes per chunk token and vocab entry), one layer's backward working set (a quarter
  of what the layer saved, BACKWARD_WORKING_FRACTION) and, under checkpointing, the recomputed
  layer with its bf16 weight casts;
- a margin for the caching allocator's fragmentation and the memory no allocator counts (CUDA
  context, cuBLAS/cuDNN workspaces, NCCL buffers).

The peak is the largest of the points of a backward sweep (`_backward_peak`): its start (every
activation alive, the CE's working set) and each block (earlier blocks' activations, later
blocks' gradients, this block's working set). With gradient accumulation every gradient is
alive throughout. On CPU this bounds the allocator's measured peak from above by 1.0-1.2x
(tests/test_memory_plan.py). Conservative where unsure: the eager model (torch.compile's
partitioner saves less), the expert copies kept from forward to backward. Not modelled: DDP's
gradient buckets (about one more fp32 copy of the gradients), optimizers other than AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ColibriConfig
from ..errors import MemoryPlanError
from ..param_count import count_params, mla_params
from .activations import (
    BF16,
    BF16_EXPERTS,
    FP32,
    KINDS,
    ComputePath,
    Shape,
    block_activations,
    checkpointed_block_activations,
    embedding_activations,
    head_activations,
)
from .gpus import GpuSpec

GIB = 1 << 30
FRAGMENTATION = 0.10  # of the allocator's peak: caching-allocator blocks that cannot be reused
UNCOUNTED_BYTES = int(1.5 * GIB)  # CUDA context + cuBLAS/cuDNN workspaces (+ NCCL), outside the allocator
# Gradients of one layer's activations alive at once during its backward, as a share of what it
# saved: 0.09-0.19 measured on CPU (tiny and 3-layer nano shapes, fp32 and bf16); rounded up.
BACKWARD_WORKING_FRACTION = 0.25
AC_MODES = ("none", "full")  # what TrainConfig.activation_checkpointing offers (all blocks or none)


@dataclass(frozen=True)
class WeightCounts:
    """Matmul weights by module (elements), the ones autocast or FSDP2 casts to bf16."""

    attention: int  # per layer
    dense_ffn: int  # per dense layer
    shared: int  # per MoE layer
    router: int  # per MoE layer
    experts: int  # per MoE layer
    head: int  # the LM head (the embedding when tied)
    moe_block: int  # all parameters of one MoE block
    dense_block: int  # all parameters of one dense block
    block_max: int  # all parameters of the largest block (FSDP2 unit)
    root: int  # embedding + untied head + final norm (FSDP2's root unit)

    @classmethod
    def of(cls, config: ColibriConfig) -> WeightCounts:
        d, hd = config.d_model, config.head_dim
        attention = d * (config.n_heads + config.n_kv_heads) * hd * 2
        if config.attention_kind == "mla":  # its latent norms counted here too
            attention = mla_params(config)
        norms = 2 * d + (2 * hd if config.qk_norm else 0)
        dense = 3 * d * config.dense_ffn_dim
        shared = 3 * d * config.shared_expert_dim
        router = config.n_experts * d
        experts = config.n_experts * 3 * d * config.expert_dim
        moe_block = attention + norms + router + shared + experts
        dense_block = attention + norms + dense
        head = config.vocab_size * d
        return cls(attention, dense, shared, router, experts, head, moe_block=moe_block, dense_block=dense_block,
                   block_max=max(moe_block if config.n_moe_layers else 0, dense_block if config.n_dense_layers else 0),
                   root=head * (1 if config.tie_embeddings else 2) + d)


@dataclass
class MemoryPlan:
    """Bytes per GPU of one training configuration (see the module docstring)."""

    preset: str
    micro_batch: int
    seq_len: int
    precision: str
    ac: str
    fsdp: int
    grad_accum: int
    compute_path: str
    ce_chunk_tokens: int | None
    total_params: int
    params: int
    grads: int
    optimizer: int
    buffers: int
    compute_copies: int
    activations_by_kind: dict[str, int]
    activations_per_layer: dict[str, dict[str, int]]
    logits_returned: int  # whole-batch path: the logits the forward returns stay alive through backward
    transients: dict[str, int]
    grads_at_peak: int
    peak_allocated: int  # what torch.cuda.max_memory_allocated should report
    margin: int
    peak_device: int  # peak_allocated + margin: what the GPU must hold
    notes: list[str] = field(default_factory=list)

    @property
    def activations(self) -> int:
        return sum(self.activations_by_kind.values())

    def fit(self, gpu: GpuSpec, memory_bytes: int | None = None) -> dict:
        memory = memory_bytes or gpu.memory_bytes
        return {"gpu": gpu.key, "label": gpu.label, "memory": memory, "fits": self.peak_device <= memory,
                "headroom": memory - self.peak_device}

    def to_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["activations"] = self.activations
        return out


def plan_memory(config: ColibriConfig, *, micro_batch: int, seq_len: int, precision: str = "bf16",
                ac: str = "none", fsdp: int = 1, grad_accum: int = 1,
                path: ComputePath = BF16_EXPERTS) -> MemoryPlan:
    """The per-GPU memory plan of training `config` with these options (see the module docstring)."""
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("fsdp", fsdp),
                        ("grad_accum", grad_accum)):
        if value < 1:
            raise MemoryPlanError(f"{name}: must be at least 1, got {value}")
    if seq_len > config.max_seq_len:
        raise MemoryPlanError(f"seq_len: {seq_len} exceeds the model's max_seq_len {config.max_seq_len}")
    if precision not in ("bf16", "fp32"):
        raise MemoryPlanError(f"precision: {precision!r} is not bf16 or fp32")
    if ac not in AC_MODES:
        raise MemoryPlanError(
            f"ac: {ac!r} is not planned; the trainer checkpoints all blocks or none "
            f"(--activation-checkpointing), so choose one of {', '.join(AC_MODES)}")
    if path.ce_chunk_tokens is not None and path.ce_chunk_tokens < 1:
        raise MemoryPlanError(f"ce_chunk_tokens: must be at least 1, got {path.ce_chunk_tokens}")
    shape = Shape(micro_batch, seq_len, precision == "bf16")
    weights = WeightCounts.of(config)
    total = count_params(config)["total_params"]
    notes: list[str] = []

    params = _ceil_div(total, fsdp) * FP32
    grads = _ceil_div(total, fsdp) * FP32
    optimizer = 2 * _ceil_div(total, fsdp) * FP32
    buffers = config.n_moe_layers * 2 * config.n_experts * FP32  # expert bias + token counts
    buffers += config.n_layers * 2 * max(config.max_seq_len, 256) * config.head_dim * FP32  # RoPE tables

    # the chunked CE casts the LM head inside its own forward and keeps only gradients (loss.py)
    head_copy = weights.head * BF16 if path.ce_chunk_tokens is None else 0
    if fsdp > 1:
        compute_copies = 2 * max(weights.block_max, weights.root) * BF16 + max(weights.block_max, weights.root) * FP32
        notes.append("FSDP2 assumed with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) and "
                     "one FSDP unit per block plus the root")
    elif shape.bf16 and ac == "full":  # the blocks' casts are redone in their recompute (a transient)
        compute_copies = head_copy
    elif shape.bf16:
        compute_copies = head_copy + sum(
            _layer_copies(weights, path, config.is_moe_layer(i)) for i in range(config.n_layers))
    else:
        compute_copies = 0

    dense = block_activations(config, shape, path, moe=False)
    moe = block_activations(config, shape, path, moe=True)
    by_kind = dict.fromkeys((*KINDS, "checkpointed_blocks"), 0)
    per_layer: dict[str, dict[str, int]] = {}
    if config.n_dense_layers:
        per_layer["dense_layer"] = {k: v for k, v in dense.items() if v}
    if config.n_moe_layers:
        per_layer["moe_layer"] = {k: v for k, v in moe.items() if v}
    if ac == "full":
        by_kind["checkpointed_blocks"] = config.n_layers * checkpointed_block_activations(config, shape)
        by_kind["checkpointed_blocks"] += seq_len * 8  # the positions, shared by all blocks
    else:
        for kind in dense:
            by_kind[kind] = config.n_dense_layers * dense[kind] + config.n_moe_layers * moe[kind]
    by_kind["head"] = head_activations(config, shape, path)
    by_kind["embedding"] = embedding_activations(shape)

    n, v = shape.tokens, config.vocab_size
    logits_returned = 0
    transients = {}
    if path.ce_chunk_tokens is None:
        logits_returned = n * v * (BF16 if shape.bf16 else FP32)
        transients["cross_entropy"] = 2 * n * v * FP32  # nll's and log-softmax's input gradients
    else:
        chunk = min(path.ce_chunk_tokens, n)
        # bf16 logits, their fp32 copy, the fp32 gradient and its bf16 cast, for one chunk
        transients["cross_entropy"] = chunk * v * (BF16 + FP32 + FP32 + BF16)
    layers = [_LayerBytes(saved=sum((moe if config.is_moe_layer(i) else dense).values()),
                          params=weights.moe_block if config.is_moe_layer(i) else weights.dense_block,
                          copies=_layer_copies(weights, path, config.is_moe_layer(i)) if shape.bf16 else 0)
              for i in range(config.n_layers)]
    transients["layer_backward"] = int(BACKWARD_WORKING_FRACTION * max(layer.saved for layer in layers))
    if ac == "full":
        transients["layer_recompute"] = max(layer.saved for layer in layers)
    peak_step, grads_at_peak = _backward_peak(
        layers, by_kind, logits_returned, transients["cross_entropy"], ac=ac, fsdp=fsdp,
        head_params=weights.root, all_grads=grads if grad_accum > 1 else None,
        copies=compute_copies, per_layer_copies=fsdp == 1 and shape.bf16)
    peak_allocated = params + optimizer + buffers + peak_step
    margin = int(FRAGMENTATION * peak_allocated) + UNCOUNTED_BYTES
    if ac == "none" and precision == "bf16" and path.ce_chunk_tokens is None:
        notes.append("whole-batch logits: their bf16 copy is returned by the forward and alive through backward")
    return MemoryPlan(
        preset=config.name, micro_batch=micro_batch, seq_len=seq_len, precision=precision, ac=ac, fsdp=fsdp,
        grad_accum=grad_accum, compute_path=path.name, ce_chunk_tokens=path.ce_chunk_tokens, total_params=total,
        params=params, grads=grads, optimizer=optimizer, buffers=buffers, compute_copies=compute_copies,
        activations_by_kind=by_kind, activations_per_layer=per_layer, logits_returned=logits_returned,
        transients=transients, grads_at_peak=grads_at_peak, peak_allocated=peak_allocated, margin=margin,
        peak_device=peak_allocated + margin, notes=notes)


@dataclass(frozen=True)
class _LayerBytes:
    saved: int  # activations saved without checkpointing
    params: int  # elements
    copies: int  # bytes of its bf16 weight copies (autocast / expert backend, no FSDP)


def _layer_copies(weights: WeightCounts, path: ComputePath, moe: bool) -> int:
    if not moe:
        return (weights.attention + weights.dense_ffn) * BF16
    # routed experts: none saved; the grouped op casts its fp32 masters inside (grouped_mm.py), and
    # on the fp32-experts path they run in fp32
    cast = weights.attention + weights.shared
    return (cast + (0 if path.router_fp32 else weights.router)) * BF16


def _backward_peak(layers: list[_LayerBytes], by_kind: dict[str, int], logits_returned: int, ce_transient: int,
                   *, ac: str, fsdp: int, head_params: int, all_grads: int | None, copies: int,
                   per_layer_copies: bool) -> tuple[int, int]:
    """Peak of forward + backward over the params/optimizer floor, and the gradients alive then.

    Walks backward from the head to the first block: at block i its own and earlier blocks'
    activations (or checkpointed inputs) and bf16 copies are alive, later blocks' gradients
    exist, and block i's backward (plus its recompute under checkpointing) works. The head point
    is the start of backward: everything saved and the CE's working set. `all_grads` (gradient
    accumulation) keeps every gradient alive throughout.
    """
    block_saved = [layer.saved if ac == "none" else 0 for layer in layers]
    checkpointed = by_kind["checkpointed_blocks"]
    head_grads = head_params * FP32 // fsdp
    grads = (lambda done: all_grads) if all_grads is not None else (lambda done: done)
    # the head's weight gradient appears only after the CE's working set is freed
    head_point = sum(by_kind.values()) + logits_returned + copies + ce_transient + grads(0)
    best, best_grads = head_point, grads(0)
    done = head_grads
    for i in reversed(range(len(layers))):
        layer = layers[i]
        done += layer.params * FP32 // fsdp  # its gradients, complete at the end of its backward
        alive = by_kind["embedding"] + logits_returned + sum(block_saved[:i + 1])
        alive += checkpointed * (i + 1) // len(layers)
        if not per_layer_copies:
            alive += copies
        elif ac == "none":
            alive += sum(x.copies for x in layers[:i + 1])
        else:  # the recomputed block casts its weights again; the head's cast is gone by now
            alive += layer.copies
        work = int(BACKWARD_WORKING_FRACTION * layer.saved) + (layer.saved if ac == "full" else 0)
        point = alive + work + grads(done)
        if point > best:
            best, best_grads = point, grads(done)
    return best, best_grads


def largest_fitting_micro_batch(config: ColibriConfig, memory_bytes: int, *, seq_len: int,
                                candidates=(64, 32, 16, 8, 4, 2, 1), **options) -> tuple[int, MemoryPlan] | None:
    """The largest candidate micro-batch whose plan fits `memory_bytes`, with its plan."""
    for micro_batch in sorted(candidates, reverse=True):
        plan = plan_memory(config, micro_batch=micro_batch, seq_len=seq_len, **options)
        if plan.peak_device <= memory_bytes:
            return micro_batch, plan
    return None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
