"""Adapter for a colibri-stream int4 container (``int4:PATH``), served at top-1.

Uses colibri-stream's public API: ``Engine.open(path, ram_budget=..., dtype=...)`` and
``engine.logits(input_ids)`` -> ``[T, V]`` for ONE sequence, so the engine's batches are
scored row by row (each row trimmed after its last scored position). The tokenizer is the
engine's (the one carried in the container, else the bundled SmolLM2 one);
``max_length`` is the engine's ``max_context``. ``dtype`` is the engine's (resident weights and
activations), so ``--dtype bfloat16`` means the same for ``colibri:`` and ``int4:`` models:
both hold their tensors as colibri-model's ``held_dtype`` says (1-D tensors fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from colibri_eval.adapters import LoadedModel
from colibri_eval.adapters.tokenizer_wrappers import TokenizersTokenizer
from colibri_eval.errors import ModelSpecError


class Int4StreamLM:
    """``TokenLogitsModel`` over a colibri-stream ``Engine``."""

    supports_prefix_cache = False

    def __init__(self, engine: Any, max_length: int) -> None:
        self.engine = engine
        self.max_length = max_length

    def logits_at(self, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        out = []
        for row in range(input_ids.shape[0]):
            wanted = cols[rows == row]
            if wanted.numel() == 0:
                continue
            # positions after the last wanted one are padding (or unused): do not compute them
            length = int(wanted.max()) + 1
            logits = torch.as_tensor(self.engine.logits(input_ids[row, :length]))
            out.append(logits[wanted])
        return torch.cat(out, dim=0)


_DTYPES = ("float32", "bfloat16")


def load_int4(spec: str, path: str, ram_budget: str | None, dtype: str = "float32") -> LoadedModel:
    from colibri_stream import Engine  # noqa: PLC0415 - the `colibri` extra

    container = Path(path)
    if not container.exists():
        raise ModelSpecError(f"{path}: no such int4 container")
    if dtype not in _DTYPES:
        raise ModelSpecError(f"unsupported dtype {dtype!r} (use float32 or bfloat16)")
    kwargs = {"ram_budget": ram_budget} if ram_budget else {}
    try:
        engine = Engine.open(path, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:  # colibri-int4/-stream errors are ValueErrors
        raise ModelSpecError(f"{path}: cannot open int4 container ({str(exc).splitlines()[0]})") from None
    max_length = int(getattr(engine, "max_context", 2048))
    info = {"dtype": dtype, "ram_budget": ram_budget or "engine default", "max_length": max_length, "serving": "top-1"}
    return LoadedModel(spec, "int4", path, TokenizersTokenizer(engine.tokenizer), Int4StreamLM(engine, max_length), info)
