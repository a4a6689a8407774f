"""Adapter for a colibri-stream int4 container (``int4:PATH``), served at top-1.

Uses colibri-stream's public API: ``Engine.open(path, ram_budget=...)`` and
``engine.logits(input_ids)`` -> ``[T, V]`` for ONE sequence, so the engine's batches are
scored row by row (each row trimmed of its right padding). The tokenizer is the one stored
beside the container (``tokenizer.json`` in the same directory) or the bundled SmolLM2 one.
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


def load_int4(spec: str, path: str, ram_budget: str | None) -> LoadedModel:
    from colibri_model import load_tokenizer  # noqa: PLC0415 - the `colibri` extra
    from colibri_stream import Engine  # noqa: PLC0415

    container = Path(path)
    if not container.exists():
        raise ModelSpecError(f"{path}: no such int4 container")
    kwargs = {"ram_budget": ram_budget} if ram_budget else {}
    try:
        engine = Engine.open(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"{path}: cannot open int4 container ({str(exc).splitlines()[0]})") from None
    sidecar = container.parent / "tokenizer.json"
    tokenizer = load_tokenizer(str(sidecar) if sidecar.is_file() else None)
    config = getattr(engine, "config", None)
    max_length = int(getattr(config, "max_seq_len", 2048))
    info = {"ram_budget": ram_budget, "max_length": max_length, "serving": "top-1"}
    return LoadedModel(spec, "int4", path, TokenizersTokenizer(tokenizer), Int4StreamLM(engine, max_length), info)
