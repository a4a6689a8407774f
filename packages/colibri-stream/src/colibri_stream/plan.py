"""The plan: container header + options -> how a RAM budget is split, and which budgets matter.

Pure: it reads the container's header (config, tensor shapes, blob layout), never the weights,
builds no model and runs no kernel, so `Engine.plan(path)` and `colibri-stream plan` answer in
well under a second. `compute="auto"` is resolved before the plan (compute/choice.py's
`resolve_compute`, which may time the kernels once per process): `make_plan` takes the resolved
routes, one per dtype it may size (`plan_dtypes`). `Engine.open` follows the very same plan.

The parts of a budget and how each is sized: footprint.py.

- `min_budget`: the fixed part plus one layer's working set (`top_k` slots: the experts one token
  needs in one layer; layers run one after another).
- `full_budget`: the fixed part plus a slot for every routed expert (nothing is read twice).
- `budget_for_hit_rate` (hit_rate_target.py): the smallest budget whose cache reaches a hit rate on a
  routing trace, by replaying the trace (cache/replay.py) with the serving policy.

Defaults that fit a stated budget: a knob the caller leaves unset (`dtype`, `prefill_chunk`,
`max_context`) starts at its preferred value and is degraded one step at a time, in this order, until the minimum fits: dtype f32 -> bf16;
prefill_chunk 128 -> 64 -> 32; max_context halved down to 256 tokens. A budget that fits the
preferred values gets exactly them (so results at every budget that worked before are
unchanged); a knob set explicitly is never changed. Last, with `map_weights="auto"` (native
kernels): where even the most stepped-down candidate does not fit, the fewest projections that
bring it within the budget are computed on the container's map instead of held
(`footprint.Sizing.mappable`: from the last layer down, the LM head last; read through the page
cache every token, so mapped only where nothing else fits). A budget below every candidate is
refused with `BudgetError` naming the minimums (`smallest_mapped_budget` too: every projection
mapped).

The preferred values: 128-token chunks; dtype f32, unless the resident weights alone (a mapped
embedding included) would take more than `F32_RESIDENT_LIMIT` (2 GiB) in f32, then bf16 (Qwen3-30B-A3B's 1.5B-parameter
backbone is 6.2 GB in f32, 3.1 GB in bf16, and bf16 is the checkpoint's own precision); and
max_context the config's max_seq_len capped at `DEFAULT_MAX_CONTEXT` (4096: Qwen3-30B-A3B's
40,960 positions would hold 4.0 GB of bf16 KV cache that a 16 GB laptop needs for experts).
Every Colibri preset is under both limits, so its plans are unchanged; an explicit `dtype` or
`max_context` overrides them. `Plan.defaults` says which limit applied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch
from colibri_int4 import Container
from colibri_model import ColibriConfig

from .compute.choice import ComputeRoutes
from .errors import BudgetError
from .footprint import Budget, Footprint, Sizing, SlidingKV, dtype_name
from .options import EngineOptions
from .resident import model_config
from .sizes import format_size

__all__ = ["PLAN_VERSION", "Budget", "ComputeRoutes", "Footprint", "Plan", "make_plan", "plan_dtypes"]

PLAN_VERSION = "1.3"  # of `plan --json` (PLAN.md): a new minor may add keys, a new major changes them

PREFERRED_PREFILL_CHUNK = 128
AUTO_PREFILL_CHUNKS = (128, 64, 32)
MIN_AUTO_CONTEXT = 256
DEFAULT_MAX_CONTEXT = 4096
F32_RESIDENT_LIMIT = 2 << 30

# Prefetch pays once reading an expert takes long enough to hide behind the compute of a layer,
# and only when a CPU is free for the workers (CRC and repack are CPU work). Measured
# (bench/RESULTS.md), prefetch on / off:
#   16 KB experts, 1 torch thread on 2 cores:               x0.75 (a handoff costs more than the read)
#   0.84 MB (NanoColibri), 1 torch thread on 2 cores:       x1.02-1.04
#   1.88 MB (Micro), 1 torch thread on 2 cores:             x1.14
#   0.84 MB, 2 torch threads on 2 cores (no CPU to spare):  x0.63
# So "auto" turns it on from this blob size, with at least one CPU beyond torch's threads.
PREFETCH_AUTO_MIN_BLOB = 512 * 1024


@dataclass(frozen=True)
class Plan:
    """What `Engine.plan` returns and `Engine.open` follows.

    Attributes:
        path: the container.
        footprint: the chosen configuration's sizes (the preferred one when no budget is given).
        smallest_budget: the least budget any candidate accepts (defaults degraded as far as they
            go); equals `min_budget` when every knob was set explicitly.
        prefetch: "off" | "predict" | "on", resolved for the budget ("auto" resolves to "off"
            without one).
        budget: the split at the stated budget, or None.
        degraded: the defaults that were stepped down to fit, e.g. ["dtype f32 -> bf16"].
        target: the hit-rate target's answer (hit_rate_target.py), when a trace was given.
        memory_cap: the cgroup / MemAvailable reading behind `ram_budget="auto"` (memory_cap.py).
    """

    path: str
    footprint: Footprint
    smallest_budget: int
    prefetch: str
    expert_bytes_on_disk: int
    budget: Budget | None = None
    degraded: list[str] = field(default_factory=list)
    target: object | None = None
    memory_cap: object | None = None
    smallest_choice: str = ""  # the configuration `smallest_budget` is for
    defaults: list[str] = field(default_factory=list)  # preferred values a size limit set (module doc)
    max_seq_len: int = 0  # the config's; `max_context` may be shorter
    sliding_kv: SlidingKV | None = None  # sliding-window layers, which keep only their window (footprint.SlidingKV)
    smallest_mapped_budget: int | None = None  # the least budget with every projection mapped (map_weights not "off")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache per position over all layers (a context shorter than the sliding windows)."""
        f = self.footprint
        if not f.max_context:
            return 0
        saved = self.sliding_kv.saving(f.max_context) if self.sliding_kv else 0
        return (f.kv_cache_bytes + saved) // f.max_context

    def kv_cache_at(self, context: int) -> int:
        """KV cache bytes (in the plan's dtype) for one session of `context` tokens, the sliding
        layers at what they keep (footprint.SlidingKV)."""
        saved = self.sliding_kv.saving(context) if self.sliding_kv else 0
        return self.kv_bytes_per_token * context - saved

    def full_kv_cache_at(self, context: int) -> int:
        """What the KV cache would take if every layer kept every position (the sliding ones too)."""
        return self.kv_bytes_per_token * context

    @property
    def min_budget(self) -> int:
        return self.footprint.min_budget

    @property
    def full_budget(self) -> int:
        return self.footprint.full_budget

    @property
    def slot_bytes(self) -> int:
        return self.footprint.slot_bytes

    @property
    def total_experts(self) -> int:
        return self.footprint.total_experts

    def to_dict(self) -> dict:
        """JSON-ready: what `colibri-stream plan --json` prints (PLAN.md; the CLI adds a few keys)."""
        f = self.footprint
        out = {
            "plan_version": PLAN_VERSION,
            "container": self.path,
            "dtype": dtype_name(f.dtype),
            "compute": f.compute,
            "expert_compute_dtype": dtype_name(f.expert_compute_dtype),
            "expert_dtype": dtype_name(f.expert_compute_dtype),  # its 1.0 name, written until plan format 2.0
            "max_context": f.max_context,
            "prefill_chunk": f.prefill_chunk,
            "top_k": f.top_k,
            "prefetch": self.prefetch,
            "degraded": list(self.degraded),
            "defaults": list(self.defaults),
            "max_seq_len": self.max_seq_len,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "resident_bytes": f.resident_bytes,
            "resident_by_dtype": dict(f.resident_by_dtype),
            "mapped_bytes": f.mapped_bytes,
            "kv_cache_bytes": f.kv_cache_bytes,
            "workspace_bytes": f.workspace_bytes,
            "staging_bytes": f.staging_bytes,
            "tokenizer_bytes": f.tokenizer_bytes,
            "heap_slack_bytes": f.heap_slack_bytes,
            "fixed_bytes": f.fixed_bytes,
            "slot_bytes": f.slot_bytes,
            "total_experts": f.total_experts,
            "expert_bytes_on_disk": self.expert_bytes_on_disk,
            "min_budget": self.min_budget,
            "full_budget": self.full_budget,
            "smallest_budget": self.smallest_budget,
            "smallest_choice": self.smallest_choice,
            "mapped_projections": len(f.mapped_projections),
            "smallest_mapped_budget": self.smallest_mapped_budget,
        }
        if self.budget is not None:
            b = self.budget
            out["ram_budget"], out["cache_slots"] = b.ram_budget, b.slots
            out["cache_capacity_bytes"] = b.cache_capacity_bytes
        if self.target is not None:
            out["hit_rate_target"] = self.target.to_dict()
        if self.memory_cap is not None:
            out["memory_cap"] = self.memory_cap.to_dict()
        return out

    def budget_for_slots(self, slots: int) -> int:
        """The budget whose cache holds `slots` experts (clamped to [working set, every expert])."""
        f = self.footprint
        return f.fixed_bytes + max(f.working_set_slots, min(slots, f.total_experts)) * f.slot_bytes


def plan_dtypes(opts: EngineOptions) -> tuple[torch.dtype, ...]:
    """The engine dtypes a plan with `opts` may size, so the compute routes to resolve first: the
    one asked for, else f32 and bf16 (`_candidate_knobs`)."""
    return (opts.dtype,) if opts.dtype is not None else (torch.float32, torch.bfloat16)


def make_plan(container: Container, opts: EngineOptions, ram_budget: int | None = None, *,
              compute: ComputeRoutes) -> Plan:
    """The plan of `container` with `opts`, split at `ram_budget` when given (see module doc).
    `compute`: `opts.compute` already resolved for `plan_dtypes(opts)` (compute/choice.py's
    `resolve_compute`); the plan never times a kernel."""
    config = model_config(container)
    top_k = opts.top_k or config.top_k_infer
    if config.n_moe_layers and not 1 <= top_k <= config.n_experts:  # a dense model has no top_k
        raise ValueError(f"top_k must be in [1, {config.n_experts}], got {top_k}")
    trained = max(config.top_k_train, config.top_k_infer)
    if config.n_moe_layers and top_k > trained and not opts.allow_extra_experts:
        # a sampling top-k of 40 typed where experts were meant would otherwise run 40 experts
        raise ValueError(
            f"{top_k} experts per token exceeds the {trained} this model routes to (top_k_train "
            f"{config.top_k_train}, top_k_infer {config.top_k_infer}); ask for it explicitly "
            "(allow_extra_experts=True, --allow-extra-experts) to run a model beyond its training"
        )
    layout = container.blob_layout
    prefetch = opts.prefetch
    counted_threads = opts.prefetch_threads if prefetch == "on" and layout else 0
    sizes = Sizing(container, config, opts, top_k, compute)
    # what the preferred dtype depends on, when none was asked for (the f32 route is resolved then):
    # the backbone's weights, the mapped embedding included, so that where the default lands for a
    # model does not move with how its embedding is held
    f32_resident = (sum(sizes.resident_by_dtype(torch.float32).values()) + sizes.mapped_bytes(torch.float32)
                    if opts.dtype is None else 0)
    knobs, defaults = _candidate_knobs(opts, config, f32_resident)

    def every_mappable(dtype: torch.dtype) -> tuple[str, ...]:
        return tuple(name for name, _ in sizes.mappable(dtype))

    candidates = [sizes.footprint(*k, counted_threads, every_mappable(k[0]) if opts.map_weights == "all" else ())
                  for k in knobs]
    chosen = candidates[0]
    least = min(candidates, key=lambda c: c.min_budget)
    smallest = least.min_budget
    floor = sizes.footprint(least.dtype, least.max_context, least.prefill_chunk, counted_threads,
                            every_mappable(least.dtype))
    smallest_mapped = floor.min_budget if opts.map_weights != "off" and floor.mapped_projections else None
    budget = None
    if ram_budget is not None:
        fitting = [c for c in candidates if c.min_budget <= ram_budget]
        if not fitting and opts.map_weights == "auto":
            mapped = _mapped_to_fit(sizes, least, ram_budget, counted_threads)
            fitting = [mapped] if mapped is not None else []
        if not fitting:
            message = chosen.too_small(ram_budget)
            if len(candidates) > 1:
                message += (f"; with the unset defaults stepped down as far as they go "
                            f"({candidates[-1].describe()}) it is {format_size(smallest)} ({smallest} bytes)")
            if smallest_mapped is not None:
                message += (f"; with every projection mapped from the container (map_weights) it is "
                            f"{format_size(smallest_mapped)} ({smallest_mapped} bytes)")
            elif opts.map_weights == "off" and floor.mapped_projections:
                message += (f"; map_weights='auto' would run it from {format_size(floor.min_budget)}, computing "
                            "projections on the container's map")
            raise BudgetError(message, smallest if smallest_mapped is None else smallest_mapped)
        chosen = fitting[0]
    if prefetch == "auto":
        prefetch = "off"
        if ram_budget is not None:
            with_workers = replace(chosen, prefetch_threads=opts.prefetch_threads,
                                   staging_bytes=sizes.staging(chosen, opts.prefetch_threads))
            if with_workers.min_budget > ram_budget and opts.map_weights == "auto":
                # a few mapped projections buy the workers' buffers: the reads they overlap are worth
                # far more than reading those projections again (at the 25% cap of a 24 x 64 model:
                # 5 more, 3.4 MB, for 2.9-3.2 tok/s instead of 2.4-2.6; bench/RESULTS.md)
                unmapped = sizes.footprint(chosen.dtype, chosen.max_context, chosen.prefill_chunk,
                                           opts.prefetch_threads)
                with_workers = _mapped_to_fit(sizes, unmapped, ram_budget, opts.prefetch_threads) or with_workers
            if _prefetch_pays(with_workers, chosen, ram_budget, layout, opts.device):
                prefetch, chosen = "on", with_workers
    if ram_budget is not None:
        budget = chosen.split(ram_budget)
    degraded = _degraded(candidates[0], chosen, sizes)
    return Plan(str(container.path), chosen, smallest, prefetch, container.expert_bytes, budget, degraded,
                smallest_choice=least.describe(), defaults=defaults, max_seq_len=config.max_seq_len,
                sliding_kv=SlidingKV.of(config, torch.empty((), dtype=chosen.dtype).element_size(),
                                        chosen.prefill_chunk),
                smallest_mapped_budget=smallest_mapped)


def _mapped_to_fit(sizes: Sizing, least: Footprint, ram_budget: int, threads: int) -> Footprint | None:
    """`least` (every unset default stepped down) with the fewest projections mapped from the
    container (`Sizing.mappable`'s order) that bring it within `ram_budget`; None when even all do not."""
    short, freed, names = least.min_budget - ram_budget, 0, []
    for name, held in sizes.mappable(least.dtype):
        if freed >= short:
            break
        names.append(name)
        freed += held
    if not names or freed < short:
        return None
    mapped = sizes.footprint(least.dtype, least.max_context, least.prefill_chunk, threads, tuple(names))
    return mapped if mapped.min_budget <= ram_budget else None


def _candidate_knobs(opts: EngineOptions, config: ColibriConfig,
                     f32_resident: int) -> tuple[list[tuple[torch.dtype, int, int]], list[str]]:
    """(dtype, max_context, prefill_chunk) to try, preferred first, one knob stepped at a time;
    and the notes on preferred values a size limit set (module doc)."""
    notes = []
    if opts.dtype is not None:
        dtypes = [opts.dtype]
    elif f32_resident > F32_RESIDENT_LIMIT:
        dtypes = [torch.bfloat16]
        notes.append(f"dtype bf16: the resident weights would take {format_size(f32_resident)} in f32 "
                     f"(over {format_size(F32_RESIDENT_LIMIT)}; dtype='f32' to insist)")
    else:
        dtypes = [torch.float32, torch.bfloat16]
    full = config.max_seq_len
    if opts.max_context is not None:
        contexts = [opts.max_context]
    else:
        if full > DEFAULT_MAX_CONTEXT:
            notes.append(f"max_context {DEFAULT_MAX_CONTEXT} of the config's {full} (max_context={full} to insist)")
        contexts = [min(full, DEFAULT_MAX_CONTEXT)]
        while contexts[-1] // 2 >= MIN_AUTO_CONTEXT:
            contexts.append(contexts[-1] // 2)
    chunks = [opts.prefill_chunk] if opts.prefill_chunk is not None else list(AUTO_PREFILL_CHUNKS)
    knobs = [(d, contexts[0], chunks[0]) for d in dtypes]
    knobs += [(dtypes[-1], contexts[0], c) for c in chunks[1:]]
    knobs += [(dtypes[-1], n, chunks[-1]) for n in contexts[1:]]
    return knobs, notes


def _prefetch_pays(with_workers: Footprint, without: Footprint, ram_budget: int, layout, device) -> bool:
    """"auto" prefetch: on only for large experts, with a CPU to spare for the workers, when the
    budget also holds the workers' buffers (with `map_weights="auto"`, after mapping the fewest
    projections that make room for them: `make_plan`), and when the cache cannot hold every
    expert without them (then there is nothing left to read ahead)."""
    if layout is None or layout.blob_length < PREFETCH_AUTO_MIN_BLOB or _spare_cpus(device) < 1:
        return False
    if ram_budget >= without.full_budget or ram_budget < with_workers.min_budget:
        return False
    return True


def _spare_cpus(device: torch.device) -> int:
    """CPUs this process may use beyond torch's intra-op threads (an accelerator computes
    elsewhere, so there the CPUs are all free for reads)."""
    try:
        available = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        available = os.cpu_count() or 1
    return available if device.type != "cpu" else available - torch.get_num_threads()


def _degraded(preferred: Footprint, chosen: Footprint, sizes: Sizing) -> list[str]:
    steps = []
    for label, get in (("dtype", lambda f: dtype_name(f.dtype)), ("prefill_chunk", lambda f: f.prefill_chunk),
                       ("max_context", lambda f: f.max_context)):
        if get(preferred) != get(chosen):
            steps.append(f"{label} {get(preferred)} -> {get(chosen)}")
    extra = set(chosen.mapped_projections) - set(preferred.mapped_projections)
    if extra:
        moved = sum(held for name, held in sizes.mappable(chosen.dtype) if name in extra)
        steps.append(f"{len(extra)} projections mapped from the container ({format_size(moved)}, read through the "
                     "page cache every token)")
    return steps
