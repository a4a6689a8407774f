"""RAM budget accounting: how the bytes of `ram_budget` are split, and the smallest budget.

    budget = resident weights        (every non-routed tensor, materialised in the engine dtype)
           + KV cache                (batch 1, `max_context` positions, all layers)
           + workspace               (activations of one prefill chunk, logits included; estimate)
           + staging buffers         (page-aligned blob buffers that misses are read into)
           + cache slots x slot size (prepared routed experts: int4-pack layout or dequantized)

           + tokenizer               (estimate: 900 bytes per vocabulary entry, calibrated in engine.py)
           + heap slack              (freed memory the C heap may hold until the engine trims it, heap.py)

Weights, caches and buffers are counted exactly from tensor sizes; the workspace is an upper
estimate of the live activations of one forward pass over `prefill_chunk` tokens (hidden states,
attention scores, the widest FFN, logits in fp32). Not counted: the interpreter and torch's own
allocations. Measured with bench/ram_budget.py (NanoColibri shapes, bf16, 32 tokens): the peak
anonymous RSS growth from before `Engine.open` stays within 1% of the budget (RESULTS.md).

The minimum budget holds one layer's working set: `top_k` slots, the experts one token needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_model import ColibriConfig

from .errors import BudgetError
from .sizes import format_size


@dataclass(frozen=True)
class Budget:
    ram_budget: int
    resident_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    staging_bytes: int
    slot_bytes: int
    slots: int
    total_experts: int
    other_bytes: int = 0  # the tokenizer (an estimate, see engine.TOKENIZER_BYTES_PER_TOKEN)
    heap_slack_bytes: int = 0  # freed heap held until trimmed (heap.slack_bytes)

    @property
    def cache_capacity_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def fixed_bytes(self) -> int:
        return (
            self.resident_bytes
            + self.kv_cache_bytes
            + self.workspace_bytes
            + self.staging_bytes
            + self.other_bytes
            + self.heap_slack_bytes
        )

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


def kv_cache_bytes(config: ColibriConfig, max_context: int, elem: int) -> int:
    return 2 * config.n_layers * config.n_kv_heads * max_context * config.head_dim * elem


def workspace_bytes(config: ColibriConfig, prefill_chunk: int, max_context: int, elem: int) -> int:
    """Upper estimate of one forward pass's live activations over `prefill_chunk` tokens."""
    t = prefill_chunk
    widest_ffn = max(config.dense_ffn_dim, config.shared_expert_dim, 2 * config.expert_dim)
    hidden = 6 * t * config.d_model * max(elem, 4)  # residual, normed, attn out, fp32 norm temporaries
    attention = config.n_heads * t * max_context * 4 + 3 * t * config.n_heads * config.head_dim * elem
    ffn = 3 * t * widest_ffn * max(elem, 4)
    logits = 2 * t * config.vocab_size * 4  # logits, and their fp32 copy for sampling/softmax
    return hidden + attention + ffn + logits


def plan_budget(
    ram_budget: int,
    config: ColibriConfig,
    resident_bytes: int,
    kv_bytes: int,
    workspace: int,
    staging_bytes: int,
    slot_bytes: int,
    top_k: int,
    other_bytes: int = 0,
    heap_slack_bytes: int = 0,
) -> Budget:
    """Split `ram_budget`; raise `BudgetError` naming the minimum if one layer's working set
    (top_k experts) does not fit beside the fixed parts."""
    total_experts = config.n_moe_layers * config.n_experts
    fixed = resident_bytes + kv_bytes + workspace + staging_bytes + other_bytes + heap_slack_bytes
    working_set = min(top_k, config.n_experts) * slot_bytes if total_experts else 0
    minimum = fixed + working_set
    if ram_budget < minimum:
        raise BudgetError(
            f"ram budget {format_size(ram_budget)} ({ram_budget} bytes) is too small: the minimum is "
            f"{format_size(minimum)} ({minimum} bytes) = resident {format_size(resident_bytes)} + KV cache "
            f"{format_size(kv_bytes)} + workspace {format_size(workspace)} + staging {format_size(staging_bytes)} "
            f"+ tokenizer {format_size(other_bytes)} + heap slack {format_size(heap_slack_bytes)} "
            f"+ one layer's working set ({top_k} x {format_size(slot_bytes)})",
            minimum,
        )
    slots = min(total_experts, (ram_budget - fixed) // slot_bytes) if slot_bytes else 0
    return Budget(
        ram_budget,
        resident_bytes,
        kv_bytes,
        workspace,
        staging_bytes,
        slot_bytes,
        int(slots),
        total_experts,
        other_bytes,
        heap_slack_bytes,
    )
