"""colibri-stream: serve a Colibri int4 container bigger than RAM.

The resident backbone stays in memory; routed experts stream from disk (O_DIRECT) through a
RAM-budgeted cache with a pluggable eviction policy and run on torch's CPU int4 kernels.
`Engine.open(path, ram_budget="600MB")` is the entry point; `colibri-stream` the CLI.
"""

from .budget import Budget
from .cache_policy import POLICIES, CachePolicy, LRUPolicy, make_policy
from .cache_replay import ReplayResult, access_sequence, belady, replay
from .direct_io import AlignedBuffer, BlobReader, IOFallbackWarning
from .engine import Engine
from .errors import BudgetError, ContainerConfigError, ExpertCorruptError, SizeFormatError, StreamError
from .expert_cache import ExpertCache
from .expert_compute import DequantExpert, Int4Expert
from .generation import GenerationResult, SamplingConfig
from .policies import LayerLRUPolicy, LFUPolicy, PinnedLRUPolicy  # registers lfu, lru-layer
from .report import GenerateReport, ReportVersionError, StatsReport, read_generate_report
from .routing_trace import RoutingTrace, TraceFormatError, TraceHeader, read_trace, write_trace
from .sizes import format_size, parse_size
from .stats import LayerCounters, StreamStats, TraceEvent
from .streamed_experts import StreamedExperts

__version__ = "0.2.0"

__all__ = [
    "POLICIES",
    "AlignedBuffer",
    "BlobReader",
    "Budget",
    "BudgetError",
    "CachePolicy",
    "ContainerConfigError",
    "DequantExpert",
    "Engine",
    "ExpertCache",
    "ExpertCorruptError",
    "GenerateReport",
    "GenerationResult",
    "IOFallbackWarning",
    "Int4Expert",
    "LRUPolicy",
    "LFUPolicy",
    "LayerLRUPolicy",
    "PinnedLRUPolicy",
    "LayerCounters",
    "ReportVersionError",
    "SamplingConfig",
    "SizeFormatError",
    "StatsReport",
    "StreamError",
    "StreamStats",
    "StreamedExperts",
    "TraceEvent",
    "format_size",
    "make_policy",
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
]
