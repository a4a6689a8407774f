"""`EngineOptions`: every knob of `Engine.open` besides the path and the budget, validated once.

Kept apart from engine.py so that the CLI, the benchmark and tests build the same options, and so
that new knobs (prefetch, policies) do not lengthen every signature.

`dtype`, `max_context` and `prefill_chunk` left unset (None; "auto" for dtype) start at f32, the
config's max_seq_len and 128 tokens, and are stepped down only where a stated budget cannot hold
them (plan.py says the order); a value set here is never changed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
from tokenizers import Tokenizer

from .cache.policies import CachePolicy
from .compute import COMPUTE_CHOICES

DTYPES = {
    "f32": torch.float32,
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

MAP_WEIGHTS = ("auto", "off", "all")


def resolve_dtype(dtype: str | torch.dtype, what: str = "dtype") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{what} {dtype} is not supported; use f32 or bf16 (fp16 is too slow on CPU)")
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown {what} {dtype!r}; use f32 or bf16") from None


@dataclass(frozen=True)
class EngineOptions:
    """See `Engine.open` for the meaning of each field."""

    compute: Literal["auto", "native", "int4", "dequant"] = "auto"
    dtype: str | torch.dtype | None = None  # resident weights, activations, KV cache; None/"auto": plan.py
    kernel_dtype: str | torch.dtype = "bf16"  # activations inside the int4 expert kernels
    device: str | torch.device = "cpu"
    cache_policy: str | CachePolicy | None = None
    top_k: int | None = None  # routed experts per token per layer
    allow_extra_experts: bool = False  # accept top_k above the trained top-k
    max_context: int | None = None
    prefill_chunk: int | None = None  # tokens per forward pass; None: 128, less where the budget needs
    direct_io: bool = True
    record_trace: bool = False
    prefetch: Literal["auto", "off", "predict", "on"] = "auto"
    prefetch_threads: int = 2
    slab: bool = True  # int4 experts in one allocation made at open (cache/slab.py)
    tokenizer: str | os.PathLike | Tokenizer | None = None
    batch_sessions: bool = True  # concurrent sessions' decode steps in one pass (step_combiner.py)
    map_weights: Literal["auto", "off", "all"] = "auto"  # native projections computed on the container's map (plan.py)

    def __post_init__(self):
        if self.compute not in COMPUTE_CHOICES:
            raise ValueError(f"compute must be one of {', '.join(COMPUTE_CHOICES)}, got {self.compute!r}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.prefetch not in ("auto", "off", "predict", "on"):
            raise ValueError(f"prefetch must be auto, off, predict or on, got {self.prefetch!r}")
        if self.map_weights not in MAP_WEIGHTS:
            raise ValueError(f"map_weights must be one of {', '.join(MAP_WEIGHTS)}, got {self.map_weights!r}")
        if self.prefetch_threads < 1:
            raise ValueError(f"prefetch_threads must be >= 1, got {self.prefetch_threads}")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {self.max_context}")
        if self.dtype is not None and str(self.dtype).lower() != "auto":
            object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        else:
            object.__setattr__(self, "dtype", None)
        object.__setattr__(self, "kernel_dtype", resolve_dtype(self.kernel_dtype, "kernel_dtype"))
        object.__setattr__(self, "device", torch.device(self.device))
