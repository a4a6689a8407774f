"""Bytes that autograd saves for backward, per layer and by kind, from the config alone.

Each term below is a tensor that one op of the eager forward saves (read off the model's code and
checked against `saved_tensors.py`'s measurement on CPU, tests/test_memory_plan.py). N = B x T
tokens, k = top_k_train; "act" is the autocast dtype (2 bytes in bf16, 4 in fp32). The residual
stream stays fp32 even under autocast (the embedding is fp32 and fp32 + bf16 is fp32), and
RMSNorm computes in fp32, so the norms save fp32 whatever the precision.

    kind           what is saved
    attention      attn_norm input, rsqrt, x_hat; the q/k/v projections' input (one fp32 tensor, or
                   three bf16 casts under autocast); q_norm/k_norm fp32 input, rsqrt, x_hat; the
                   four RoPE tables gathered at the positions; SDPA's q, k, v, out and fp32
                   logsumexp (the flash backends; GQA runs unexpanded on flash, CPU and CUDA)
    mlp_norm       ffn_norm input, rsqrt, x_hat
    dense_ffn      input (fp32, or two bf16 casts), gate out, silu out, up out, gate*up
    router         input (bf16 cast on the fp32-experts path, fp32 on bf16-experts), sigmoid scores, top-k
                   indices, the fp64 normalisation's numerator and sum
    shared_expert  like dense_ffn at the shared width (its fp32 input is the router's)
    experts        token index and sort order (int64), offsets, sorted gates; the gathered copy
                   x[token_index] (N k d), gate/silu/up/hidden (N k f each), down out and
                   gated out (N k d each, the latter kept by index_add_)
    head           final norm input, rsqrt, x_hat; the LM head input; whole-batch CE: fp32
                   log-softmax (N V); chunked CE: per-token logsumexp only
    embedding      the token ids

Full activation checkpointing keeps only each block's input (fp32 N d) and the positions; the
embedding and head are outside the checkpointed blocks and save as above.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ColibriConfig
from ..loss import DEFAULT_CHUNK_ROWS

FP32, BF16, INT64, FP64, INT32 = 4, 2, 8, 8, 4
BLOCK_KINDS = ("attention", "mlp_norm", "dense_ffn", "router", "shared_expert", "experts")
KINDS = (*BLOCK_KINDS, "head", "embedding")


@dataclass(frozen=True)
class ComputePath:
    """What the forward computes in which dtype, where the two compute paths differ.

    Attributes:
        name: short label printed with the plan.
        experts_bf16: routed-expert activations in bf16 under bf16 precision (the bf16-experts path: bf16
            matmuls on fp32 masters) rather than in the fp32 weights' dtype.
        router_fp32: the router's linear forced to fp32 (the bf16-experts path) rather than recast to bf16 by
            autocast.
        ce_chunk_tokens: cross-entropy over chunks of this many tokens, logits recomputed per
            chunk in backward (the bf16-experts path), or None for whole-batch logits, their fp32 copy and
            log-softmax (the fp32-experts path, which also returns the logits).
    """

    name: str
    experts_bf16: bool
    router_fp32: bool
    ce_chunk_tokens: int | None


CE_CHUNK_TOKENS = DEFAULT_CHUNK_ROWS  # loss.py's chunk: the rows whose logits exist at once
BF16_EXPERTS = ComputePath("bf16-experts", experts_bf16=True, router_fp32=True, ce_chunk_tokens=CE_CHUNK_TOKENS)
FP32_EXPERTS = ComputePath("fp32-experts", experts_bf16=False, router_fp32=False, ce_chunk_tokens=None)
COMPUTE_PATHS = {p.name: p for p in (BF16_EXPERTS, FP32_EXPERTS)}
# the names these paths had in the 0.1 series, still read from command lines
FORMER_PATH_NAMES = {"issue19": BF16_EXPERTS.name, "pre-issue19": FP32_EXPERTS.name}
# The path this package's model runs (bf16 experts on fp32 masters, fp32 router, chunked CE), which
# the calibration test (tests/test_memory_plan.py) checks the planner against; FP32_EXPERTS stays
# for comparison with the code before it.
MODEL_PATH = BF16_EXPERTS


@dataclass(frozen=True)
class Shape:
    micro_batch: int
    seq_len: int
    bf16: bool  # bf16 autocast (else fp32 throughout)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


def block_activations(config: ColibriConfig, shape: Shape, path: ComputePath, moe: bool) -> dict[str, int]:
    """Saved bytes of one block (dense if not `moe`), by kind, without checkpointing."""
    n, t, d = shape.tokens, shape.seq_len, config.d_model
    h, kv, hd = config.n_heads, config.n_kv_heads, config.head_dim
    act = BF16 if shape.bf16 else FP32
    # An fp32 norm output is saved once by all its consumers; under autocast each matmul saves
    # its own bf16 cast of it.
    def matmul_inputs(consumers: int) -> int:
        return consumers * n * d * BF16 if shape.bf16 else n * d * FP32

    norm = 2 * n * d * FP32 + n * FP32  # input, x_hat, rsqrt
    attention = norm + matmul_inputs(3)
    if config.qk_norm:
        attention += 2 * n * (h + kv) * hd * FP32 + n * (h + kv) * FP32
    attention += 4 * t * hd * FP32  # cos/sin gathered at the positions, for q and for k
    attention += 2 * n * (h + kv) * hd * act + n * h * FP32  # SDPA q, k, v, out; logsumexp
    out = dict.fromkeys(BLOCK_KINDS, 0)
    out["attention"] = attention
    out["mlp_norm"] = norm
    if not moe:
        out["dense_ffn"] = matmul_inputs(2) + 4 * n * config.dense_ffn_dim * act
        return out

    k, e = config.top_k_train, config.n_experts
    router_fp32 = path.router_fp32 or not shape.bf16
    out["router"] = (n * d * FP32 if router_fp32 else n * d * BF16) + n * e * (FP32 if router_fp32 else BF16)
    out["router"] += n * k * INT64  # top-k indices (gather)
    if config.route_norm:
        out["router"] += n * k * FP64 + n * FP64
    if config.shared_expert_dim:
        shared_inputs = 2 * n * d * BF16 if shape.bf16 else 0  # fp32: the router's input tensor
        out["shared_expert"] = shared_inputs + 4 * n * config.shared_expert_dim * act
    x = BF16 if shape.bf16 and path.experts_bf16 else FP32
    rows = n * k
    out["experts"] = 2 * rows * INT64 + e * INT32 + rows * FP32  # token index, order, offsets, gates
    out["experts"] += 3 * rows * d * x + 4 * rows * config.expert_dim * x
    if x == BF16:  # the fp32 gate multiply keeps an fp32 copy of the experts' output
        out["experts"] += rows * d * FP32
    return out


def head_activations(config: ColibriConfig, shape: Shape, path: ComputePath) -> int:
    """Saved bytes of the final norm, LM head and cross-entropy."""
    n, d, v = shape.tokens, config.d_model, config.vocab_size
    saved = 2 * n * d * FP32 + n * FP32  # final norm
    if path.ce_chunk_tokens is None:
        saved += n * d * (BF16 if shape.bf16 else FP32)  # LM head input
        saved += n * INT64  # targets
        saved += n * v * FP32  # log-softmax output
    else:
        # loss.py makes the gradients in its forward, chunk by chunk, and keeps only them: the
        # hidden states' [N, d] (in the norm output's dtype, fp32) and the LM head's fp32 [V, d].
        saved += n * d * FP32 + v * d * FP32
    return saved


def checkpointed_block_activations(config: ColibriConfig, shape: Shape) -> int:
    """What full activation checkpointing keeps of one block: its fp32 input."""
    return shape.tokens * config.d_model * FP32


def embedding_activations(shape: Shape) -> int:
    return shape.tokens * INT64
