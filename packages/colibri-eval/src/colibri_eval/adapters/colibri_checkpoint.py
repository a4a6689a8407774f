"""Adapter for a colibri-model checkpoint directory (``colibri:PATH``).

Uses only colibri-model's public API: ``ColibriForCausalLM.from_pretrained(path)``,
``model(input_ids, positions=..., attention_mask=...).logits`` ``[B, T, V]`` and
``load_tokenizer(path_or_None)`` (a ``tokenizer.json`` in the checkpoint wins, else the bundled
SmolLM2 49152 tokenizer). The scoring engine's packed rows (``packed_logits``) run with their
per-row positions and per-query tree mask; the LM head runs only at the scored positions: a
forward hook on the final norm keeps just those rows of its output (the model's forward is
unchanged; with a 49k vocabulary the head is a fifth of a small model's FLOPs per position).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from colibri_eval.adapters.loaded_model import LoadedModel
from colibri_eval.adapters.tokenizer_wrappers import TokenizersTokenizer
from colibri_eval.errors import ModelSpecError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ColibriCheckpointLM:
    """``TokenLogitsModel`` over a ``ColibriForCausalLM``."""

    supports_prefix_cache = False
    supports_packing = True

    def __init__(self, model: Any, max_length: int) -> None:
        self.model = model.eval()
        self.max_length = max_length

    def logits_at(self, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return self._logits_at(rows, cols, input_ids)

    def packed_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                      rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return self._logits_at(rows, cols, input_ids, positions=positions, attention_mask=allowed)

    def _logits_at(self, rows: torch.Tensor, cols: torch.Tensor, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        def keep_scored(module, args, output):  # [B, T, d] -> [1, N, d]: the head runs N times, not B*T
            return output[rows, cols][None]

        hook = self.model.norm.register_forward_hook(keep_scored)
        try:
            return self.model(input_ids, **kwargs).logits[0]
        finally:
            hook.remove()


def load_colibri(spec: str, path: str, dtype: str) -> LoadedModel:
    from colibri_model import ColibriForCausalLM, load_tokenizer  # noqa: PLC0415 - the `colibri` extra

    directory = Path(path)
    if not directory.exists():
        raise ModelSpecError(f"{path}: no such checkpoint")
    if dtype not in _DTYPES:
        raise ModelSpecError(f"unsupported dtype {dtype!r} (use float32 or bfloat16)")
    try:
        model = ColibriForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"{path}: cannot load a colibri checkpoint ({str(exc).splitlines()[0]})") from None
    has_tokenizer = directory.is_dir() and (directory / "tokenizer.json").is_file()
    tokenizer = load_tokenizer(str(directory) if has_tokenizer else None)
    config = getattr(model, "config", None)
    max_length = int(getattr(config, "max_seq_len", 2048))
    info = {
        "dtype": dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "architecture": type(model).__name__,
        "max_length": max_length,
        "tokenizer": "checkpoint" if has_tokenizer else "bundled smollm2-49152",
    }
    return LoadedModel(spec, "colibri", path, TokenizersTokenizer(tokenizer), ColibriCheckpointLM(model, max_length), info)
