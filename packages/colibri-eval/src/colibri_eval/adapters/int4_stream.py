"""Adapter for a colibri-stream int4 container (``int4:PATH``), served at top-1.

Uses colibri-stream's public API: ``Engine.open(path, ram_budget=..., dtype=...)``,
``Engine.packed_logits`` and its sessions (``engine.session()``, ``append``, ``branch_logits``).
The scoring engine's packed rows (each document's context once, its continuations beside it,
under a tree mask) run through ``Engine.packed_logits``: the fast path. Without packing
(``ScoringEngine(pack=False)``) a batch of rows runs as one
right-padded batch on an empty session (each row trimmed after its last scored position).
Shared prefixes (``supports_prefix_cache``: the scoring engine groups continuations of one
context) run once: the context is appended to a session, then its continuations run as one
right-padded batch after it (``Session.branch_logits``, each row over a copy of the context's KV
cache), so a context is neither recomputed nor copied per choice. The tokenizer is the engine's (the one carried in the container, else the bundled SmolLM2 one);
``max_length`` is the engine's ``max_context``. ``dtype`` is the engine's (resident weights and
activations), so ``--dtype bfloat16`` means the same for ``colibri:`` and ``int4:`` models:
both hold their tensors as colibri-model's ``held_dtype`` says (1-D tensors fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from colibri_eval.adapters.loaded_model import LoadedModel
from colibri_eval.adapters.tokenizer_wrappers import TokenizersTokenizer
from colibri_eval.errors import ModelSpecError


class Int4StreamLM:
    """``TokenLogitsModel`` over a colibri-stream ``Engine``."""

    supports_prefix_cache = True
    supports_packing = True

    def __init__(self, engine: Any, max_length: int) -> None:
        self.engine = engine
        self.max_length = max_length

    def packed_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                      rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return self.engine.packed_logits(input_ids, positions, allowed, rows, cols)

    def logits_at(self, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The batch's rows as one padded batch on an empty session (``Session.branch_logits``),
        each trimmed after its last wanted position (the rest is padding, or unused)."""
        members = [r for r in range(input_ids.shape[0]) if bool((rows == r).any())]
        sequences = [input_ids[r, : int(cols[rows == r].max()) + 1].tolist() for r in members]
        skip = int(cols.min())  # no row needs logits before this position (its context)
        by_row = dict(zip(members, self.engine.session().branch_logits(sequences, skip)))
        return torch.stack([by_row[int(r)][int(c) - skip] for r, c in zip(rows, cols)]).cpu()

    def shared_prefix_logits(self, prefix_ids, prefix_lengths, suffix_ids, owner, rows, cols):
        """Each LEFT-padded prefix once on an engine session, then all its suffix rows in one
        padded batch after it (``Session.branch_logits``: over a copy of the prefix's KV cache)."""
        width = prefix_ids.shape[1]
        last, by_row = [], {}
        for group in range(prefix_ids.shape[0]):
            length = int(prefix_lengths[group])
            session = self.engine.session()
            last.append(torch.as_tensor(session.append(prefix_ids[group, width - length:])).cpu())
            members = [r for r in torch.nonzero(owner == group).flatten().tolist() if bool((rows == r).any())]
            if not members:
                continue
            # each row's suffix up to its last scored position (the rest is padding)
            suffixes = [suffix_ids[r, : int(cols[rows == r].max()) + 1].tolist() for r in members]
            for row, logits in zip(members, session.branch_logits(suffixes)):
                by_row[row] = torch.as_tensor(logits).cpu()
        out = torch.stack([by_row[int(r)][int(c)] for r, c in zip(rows, cols)]) if rows.numel() else \
            torch.zeros((0, last[0].shape[-1]))
        return torch.stack(last), out


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

