"""Putting an engine together from its plan: budget resolution, reader, cache, model, prefetch.

`compute_routes` resolves the `compute` option (compute/choice.py: "auto" times the kernels
here, once) before any plan is built; `plan_for` then turns a caller's `ram_budget` (bytes, a
size string or "auto") into a `Plan` on those routes (plan.py, which times nothing; "auto" asks
io/memory_cap.py what fits under this process's memory cap).
`assemble` then builds, in this order, what the plan sized: the blob reader, the expert cache
(its slots in one slab for int4 experts, cache/slab.py), a `StreamedExperts` backend per MoE
layer, colibri-model's model over the resident region (resident.py), and the routing predictor
and prefetch workers when the plan turned prefetch on. Whatever was opened is closed again if a
later step fails.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from colibri_int4 import Container
from colibri_model import ExpertGlu, load_tokenizer
from tokenizers import Tokenizer

from .cache.expert_cache import ExpertCache
from .cache.policies import make_policy
from .cache.prefetch import Prefetcher, RoutingPredictor
from .cache.slab import ExpertSlab
from .compute.choice import ComputeRoutes, resolve_compute
from .compute.expert_compute import DequantExpert, Int4Expert
from .compute.native_expert import native_expert_class
from .compute.native_kernel import QuantizedActivations
from .compute.streamed_experts import StreamedExperts
from .errors import BudgetError, MemoryCapWarning, SmallCacheWarning
from .io.direct_io import BlobReader
from .io.heap import release_free_heap
from .io.memory_cap import read_memory_cap
from .options import EngineOptions
from .plan import Plan, make_plan, plan_dtypes
from .resident import build_model, model_config, module_bytes
from .sizes import format_size
from .stats import StreamStats


def compute_routes(container: Container, opts: EngineOptions) -> ComputeRoutes:
    """`opts.compute` resolved for every dtype a plan of `container` may size ("auto": timed here)."""
    return resolve_compute(opts, container.blob_layout, model_config(container), plan_dtypes(opts))


def plan_for(container: Container, opts: EngineOptions, ram_budget: int | str | None, *,
             compute: ComputeRoutes) -> Plan:
    """The plan at `ram_budget` (None: no budget, only the minimum and full budgets) on the
    resolved `compute` routes (`compute_routes`)."""
    if ram_budget != "auto":
        plan = make_plan(container, opts, ram_budget, compute=compute)
        if ram_budget is not None:
            _warn_over_cap(ram_budget)
        return plan
    cap = read_memory_cap()
    try:
        plan = make_plan(container, opts, cap.budget_bytes, compute=compute)
    except BudgetError as exc:
        raise BudgetError(f"ram budget auto: {cap.describe()}; {exc}", exc.minimum_bytes) from None
    return replace(plan, memory_cap=cap)


def _warn_over_cap(ram_budget: int) -> None:
    """Warn when a stated budget is more than the memory cgroup leaves (what `auto` would pick):
    the budget covers the engine's data, the cap the whole process, interpreter and torch too."""
    cap = read_memory_cap()
    if cap.limit_bytes is not None and ram_budget > cap.budget_bytes:
        warnings.warn(
            f"ram budget {format_size(ram_budget)} is more than this process's memory cgroup leaves for it "
            f"({cap.describe()}): the kernel may end the process when the cache fills; "
            "--ram-budget auto sizes the budget from the cap",
            MemoryCapWarning, stacklevel=4)


@dataclass
class Assembled:
    config: object
    model: torch.nn.Module
    cache: ExpertCache
    reader: BlobReader
    tokenizer: Tokenizer
    stats: StreamStats


def assemble(container: Container, plan: Plan, opts: EngineOptions) -> Assembled:
    config = model_config(container)
    f, budget = plan.footprint, plan.budget
    layout = container.blob_layout
    tokenizer = load_engine_tokenizer(container, opts.tokenizer)
    release_free_heap()  # parsing tokenizer.json leaves twice what the tokenizer keeps (footprint.py)
    stats = StreamStats(record_trace=opts.record_trace)
    policy = make_policy(opts.cache_policy)
    reader = BlobReader(container.path, direct=opts.direct_io)
    cache = None
    try:
        entries = {(e.layer, e.expert): e for e in container.header.experts.entries}
        glu = ExpertGlu.from_config(config)  # the model's activation, computed by the streamed experts too
        if f.compute == "native" and layout is not None:
            native_expert = native_expert_class(layout)

            def prepare(blob):
                return native_expert(blob, glu)
        elif f.compute == "int4":

            def prepare(blob):
                return Int4Expert(blob, f.expert_compute_dtype, glu)
        else:

            def prepare(blob):
                return DequantExpert(blob, f.expert_compute_dtype, opts.device, glu)

        capacity = max(budget.slots, 1)
        # CPU int4 experts live in one slab allocated now (cache/slab.py); the dequantized
        # reference path (and CUDA) keeps per-expert tensors
        slab = (ExpertSlab(capacity, f.slot_bytes)
                if f.compute in ("native", "int4") and opts.slab and layout is not None else None)
        cache = ExpertCache(reader, entries, layout, prepare, capacity, policy, stats, slab=slab)
        backends = {
            i: StreamedExperts(i, config.n_experts, config.d_model, cache, stats,
                               quantize=QuantizedActivations if f.compute == "native" else None)
            for i in range(config.n_dense_layers, config.n_layers)
        }
        model = build_model(container, config, backends, f.dtype, opts.device, native_linears=f.compute == "native",
                            mapped_projections=frozenset(f.mapped_projections))
        model.limit_positions(f.max_context)  # rotary tables for the KV cache's positions, not max_seq_len's
        if f.top_k != config.top_k_infer:
            model.set_top_k(f.top_k)
        if plan.prefetch != "off":
            prefetcher = Prefetcher(cache, opts.prefetch_threads) if plan.prefetch == "on" and layout else None
            predictor = RoutingPredictor({i: model.layers[i] for i in backends}, f.top_k, stats, prefetcher)
            for backend in backends.values():
                backend.predictor = predictor
        actual_resident = module_bytes(model)
        if actual_resident > budget.resident_bytes:  # the plan must never under-count
            raise AssertionError(f"resident weights take {actual_resident} bytes, planned {budget.resident_bytes}")
    except BaseException:
        if cache is not None:
            cache.close()
        reader.close()
        raise
    stats.ram_budget_bytes, stats.resident_bytes = budget.ram_budget, actual_resident
    stats.kv_cache_bytes, stats.staging_bytes = budget.kv_cache_bytes, budget.staging_bytes
    stats.workspace_bytes, stats.cache_capacity_bytes = budget.workspace_bytes, budget.cache_capacity_bytes
    stats.cache_slots, stats.io_mode, stats.filesystem = budget.slots, reader.mode, reader.filesystem
    bf16 = f.expert_compute_dtype == torch.bfloat16
    stats.compute_mode = f"int4-{'bf16' if bf16 else 'f32'}" if f.compute == "int4" else f.compute
    stats.policy, stats.prefetch = policy.name, plan.prefetch
    warn_if_smaller_than_a_token(budget.slots, len(backends), f.top_k, policy.name)
    return Assembled(config, model, cache, reader, tokenizer, stats)


def warn_if_smaller_than_a_token(slots: int, moe_layers: int, top_k: int, policy: str) -> None:
    """One decode token uses `moe_layers x top_k` experts in a loop over the layers; a global LRU
    with fewer slots evicts each expert before its next use and hits nothing at all."""
    working_set = moe_layers * top_k
    if 0 < slots < working_set:
        consequence = "so a global LRU hits nothing" if policy == "lru" else f"so {policy} hits only what it keeps"
        warnings.warn(
            f"the expert cache holds {slots} experts, fewer than one decode token uses ({moe_layers} MoE layers x "
            f"top-{top_k} = {working_set}), {consequence}; raise the budget for a better hit rate",
            SmallCacheWarning,
            stacklevel=3,
        )


def load_engine_tokenizer(container: Container, source) -> Tokenizer:
    """The tokenizer given, else the one the container carries, else colibri-model's bundled one
    (its RAM is in the plan: plan.TOKENIZER_BYTES_PER_TOKEN)."""
    if isinstance(source, Tokenizer):
        return source
    if source is None:
        carried = container.read_tokenizer_json()
        return Tokenizer.from_str(carried) if carried else load_tokenizer(None)
    return load_tokenizer(source)
