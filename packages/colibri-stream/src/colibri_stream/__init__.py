"""colibri-stream: serve a Colibri int4 container bigger than RAM.

The resident backbone stays in memory; routed experts stream from disk (O_DIRECT) through a
RAM-budgeted cache with a pluggable eviction policy and run on torch's CPU int4 kernels.
`Engine.open(path, ram_budget="600MB")` is the entry point (`Engine.plan(path)` says which
budgets work, without building anything); `colibri-stream` the CLI.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _metadata_version
from typing import TYPE_CHECKING

try:  # the installed metadata is the one source of the version (pyproject.toml sets it)
    __version__ = _metadata_version("colibri-stream")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

# Public names are imported on first use (PEP 562 module __getattr__), not here: `colibri-stream --help`
# and the light modules (sizes, errors, the trace reader) then cost no torch import (about 2 s).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "cache.expert_cache": ("ExpertCache",),
    "cache.policies": (
        "POLICIES",
        "CachePolicy",
        "LayerLRUPolicy",
        "LayerPartitionedPolicy",
        "LFUPolicy",
        "LRUPolicy",
        "PinnedLRUPolicy",
        "PolicySpec",
        "make_policy",
        "serving_policy_names",
    ),
    "cache.replay": ("ReplayResult", "access_sequence", "belady", "replay"),
    "chat": ("ChatSession", "ChatTemplate", "ChatTemplateError", "ContextOverflowError"),
    "compute.expert_compute": ("DequantExpert", "Int4Expert"),
    "compute.streamed_experts": ("StreamedExperts",),
    "engine": ("Engine",),
    "errors": ("BudgetError", "ContainerConfigError", "ExpertCorruptError", "MemoryCapWarning", "SizeFormatError",
               "SmallCacheWarning", "StreamError"),
    "footprint": ("Budget", "Footprint"),
    "generation": ("GenerationResult", "StreamedToken", "TextCodec", "TokenStream"),
    "hit_rate_target": ("HitRateTarget",),
    "io.accounting": ("IOWindow", "read_proc_io"),
    "io.direct_io": ("AlignedBuffer", "BlobReader", "IOFallbackWarning"),
    "io.memory_cap": ("MemoryCap", "read_memory_cap"),
    "plan": ("Plan",),
    "runner": ("ForwardRunner",),
    "report": ("GenerateReport", "ReportVersionError", "StatsReport", "read_generate_report"),
    "sampling": ("SamplingConfig", "TokenSampler"),
    "session": ("Session",),
    "sizes": ("format_size", "parse_budget", "parse_size"),
    "stats": ("LayerCounters", "StreamStats"),
    "traces.events": ("TraceEvent",),
    "traces.routing_dumps": ("DumpFormatError", "ImportedDump", "import_dump"),
    "traces.routing_trace": ("RoutingTrace", "TraceFormatError", "TraceHeader", "read_trace", "write_trace"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # the same names, for type checkers and IDEs (tests hold the two lists equal)
    from .cache.expert_cache import ExpertCache
    from .cache.policies import (
        POLICIES,
        CachePolicy,
        LayerLRUPolicy,
        LayerPartitionedPolicy,
        LFUPolicy,
        LRUPolicy,
        PinnedLRUPolicy,
        PolicySpec,
        make_policy,
        serving_policy_names,
    )
    from .cache.replay import ReplayResult, access_sequence, belady, replay
    from .chat import ChatSession, ChatTemplate, ChatTemplateError, ContextOverflowError
    from .compute.expert_compute import DequantExpert, Int4Expert
    from .compute.streamed_experts import StreamedExperts
    from .engine import Engine
    from .errors import (
        BudgetError,
        ContainerConfigError,
        ExpertCorruptError,
        MemoryCapWarning,
        SizeFormatError,
        SmallCacheWarning,
        StreamError,
    )
    from .footprint import Budget, Footprint
    from .generation import GenerationResult, StreamedToken, TextCodec, TokenStream
    from .hit_rate_target import HitRateTarget
    from .io.accounting import IOWindow, read_proc_io
    from .io.direct_io import AlignedBuffer, BlobReader, IOFallbackWarning
    from .io.memory_cap import MemoryCap, read_memory_cap
    from .plan import Plan
    from .report import GenerateReport, ReportVersionError, StatsReport, read_generate_report
    from .runner import ForwardRunner
    from .sampling import SamplingConfig, TokenSampler
    from .session import Session
    from .sizes import format_size, parse_budget, parse_size
    from .stats import LayerCounters, StreamStats
    from .traces.events import TraceEvent
    from .traces.routing_dumps import DumpFormatError, ImportedDump, import_dump
    from .traces.routing_trace import RoutingTrace, TraceFormatError, TraceHeader, read_trace, write_trace

__all__ = [
    "POLICIES",
    "AlignedBuffer",
    "BlobReader",
    "Budget",
    "Footprint",
    "HitRateTarget",
    "MemoryCap",
    "Plan",
    "read_memory_cap",
    "read_proc_io",
    "BudgetError",
    "CachePolicy",
    "ChatSession",
    "ChatTemplate",
    "ChatTemplateError",
    "ContextOverflowError",
    "Session",
    "StreamedToken",
    "TextCodec",
    "TokenStream",
    "ForwardRunner",
    "TokenSampler",
    "ContainerConfigError",
    "DequantExpert",
    "Engine",
    "ExpertCache",
    "ExpertCorruptError",
    "GenerateReport",
    "GenerationResult",
    "IOFallbackWarning",
    "IOWindow",
    "Int4Expert",
    "LRUPolicy",
    "LFUPolicy",
    "LayerLRUPolicy",
    "LayerPartitionedPolicy",
    "PinnedLRUPolicy",
    "PolicySpec",
    "LayerCounters",
    "MemoryCapWarning",
    "ReportVersionError",
    "SamplingConfig",
    "SizeFormatError",
    "SmallCacheWarning",
    "StatsReport",
    "StreamError",
    "StreamStats",
    "StreamedExperts",
    "TraceEvent",
    "format_size",
    "make_policy",
    "serving_policy_names",
    "parse_budget",
    "parse_size",
    "read_generate_report",
    "replay",
    "belady",
    "access_sequence",
    "ReplayResult",
    "RoutingTrace",
    "TraceFormatError",
    "TraceHeader",
    "read_trace",
    "write_trace",
    "DumpFormatError",
    "ImportedDump",
    "import_dump",
]


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
