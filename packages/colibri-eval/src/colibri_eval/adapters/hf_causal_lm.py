"""Adapter for any Hugging Face transformers causal LM (``hf:PATH``), the dense references.

PATH is a directory that ``AutoModelForCausalLM.from_pretrained`` reads (config.json +
weights + tokenizer), a Hub id when online, or a ``.gguf`` file (loaded with
``gguf_file=``; needs the ``gguf`` package).

Speed: ``packed_logits`` (the scoring engine's packed rows: documents side by side, each context
once, under a tree mask passed as transformers' custom 4-D ``attention_mask`` (additive, 0 or the dtype's minimum) with explicit
``position_ids``) and ``logits_at`` run the decoder body and apply the LM head only at the scored
positions; ``shared_prefix_logits`` runs several documents' shared prefixes once (left-padded, masked,
explicit position ids) and their suffixes on the repeated KV cache. Models whose head is not a plain linear map (final logit
soft-capping, logit scaling) fall back to the full ``model(...).logits``. Models with a sliding
window do not pack: transformers takes a custom 4-D mask as given, so the window would be lost.
``max_length`` follows lm-eval's hf backend: config ``n_positions`` /
``max_position_embeddings`` / ``n_ctx``, else the tokenizer's ``model_max_length``, else 2048.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from colibri_eval.adapters.loaded_model import LoadedModel
from colibri_eval.adapters.tokenizer_wrappers import HFTokenizer
from colibri_eval.errors import ModelSpecError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DEFAULT_MAX_LENGTH = 2048
_HUGE_MODEL_MAX_LENGTH = 1000000000000000019884624838656  # transformers' "unset" sentinel


def lm_eval_max_length(config: Any, tokenizer: Any) -> int:
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        if hasattr(config, attr):
            return int(getattr(config, attr))
    limit = getattr(tokenizer, "model_max_length", None)
    if limit is not None and limit != _HUGE_MODEL_MAX_LENGTH:
        return int(limit)
    return _DEFAULT_MAX_LENGTH


def _full_attention_only(config: Any) -> bool:
    """Every layer attends to the whole context (no sliding window, no chunked or linear
    attention): the layers a custom 4-D mask describes exactly."""
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    window = getattr(config, "sliding_window", None)
    return not window or getattr(config, "use_sliding_window", True) is False


class HFCausalLM:
    """``TokenLogitsModel`` over a transformers ``*ForCausalLM``."""

    supports_prefix_cache = True

    def __init__(self, model: Any, max_length: int) -> None:
        self.model = model.eval()
        self.max_length = max_length
        config = model.config
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        self.head = model.get_output_embeddings()
        plain_head = not getattr(config, "final_logit_softcapping", None) and not getattr(config, "logit_scale", None)
        self.headless = self.decoder is not None and isinstance(self.head, torch.nn.Linear) and plain_head
        self.supports_prefix_cache = self.headless
        # a custom 4-D mask is honoured by the sdpa and eager kernels (as an additive float mask:
        # eager ADDS whatever it is given, so a boolean one would silently shift the scores by 0/1);
        # flash-attention kernels ignore it
        self.supports_packing = _full_attention_only(config) and getattr(config, "_attn_implementation", "sdpa") in (
            "sdpa", "eager")
        # transformers 5.2x renamed ``past_key_values`` to ``cache`` (argument and output)
        params = inspect.signature(self.decoder.forward).parameters if self.decoder is not None else {}
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def logits_at(self, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        if self.headless:
            hidden = self.decoder(input_ids=input_ids, use_cache=False).last_hidden_state
            return self.head(hidden[rows, cols])
        return self.model(input_ids=input_ids, use_cache=False).logits[rows, cols]

    def packed_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                      rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        dtype = self.head.weight.dtype if self.head is not None else torch.float32
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        kwargs = {"input_ids": input_ids, "attention_mask": additive[:, None], "position_ids": positions,
                  "use_cache": False}
        if self.headless:
            return self.head(self.decoder(**kwargs).last_hidden_state[rows, cols])
        return self.model(**kwargs).logits[rows, cols]

    def shared_prefix_logits(
        self, prefix_ids: torch.Tensor, prefix_lengths: torch.Tensor, suffix_ids: torch.Tensor,
        owner: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_prefix, width = prefix_ids.shape
        positions = torch.arange(width)[None, :]
        padding = (width - prefix_lengths)[:, None]
        prefix_mask = (positions >= padding).long()  # left padding is masked out
        prefix_positions = (positions - padding).clamp(min=0)
        out = self.decoder(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=prefix_positions,
                           use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        last_logits = self.head(out.last_hidden_state[:, -1])
        cache.reorder_cache(owner)  # one cache row per suffix (index_select with repeats)
        n_rows, suffix_width = suffix_ids.shape
        mask = torch.cat([prefix_mask[owner], torch.ones((n_rows, suffix_width), dtype=torch.long)], dim=1)
        suffix_positions = prefix_lengths[owner][:, None] + torch.arange(suffix_width)[None, :]
        out = self.decoder(input_ids=suffix_ids, attention_mask=mask, position_ids=suffix_positions,
                           use_cache=True, **{self.cache_arg: cache})
        return last_logits, self.head(out.last_hidden_state[rows, cols])


def load_hf(spec: str, path: str, dtype: str) -> LoadedModel:
    import transformers  # noqa: PLC0415 - the `hf` extra

    if dtype not in _DTYPES:
        raise ModelSpecError(f"unsupported dtype {dtype!r} (use float32 or bfloat16)")
    source = Path(path)
    kwargs: dict[str, Any] = {}
    if source.suffix == ".gguf":
        if not source.is_file():
            raise ModelSpecError(f"{path}: no such GGUF file")
        kwargs["gguf_file"] = source.name
        location = str(source.parent)
    else:
        location = path
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(location, **kwargs)
        model = transformers.AutoModelForCausalLM.from_pretrained(location, dtype=_DTYPES[dtype], **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"{path}: cannot load a transformers causal LM ({str(exc).splitlines()[0]})") from None
    max_length = lm_eval_max_length(model.config, tokenizer)
    info = {
        "dtype": dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "architecture": type(model).__name__,
        "max_length": max_length,
        "revision": getattr(model.config, "_commit_hash", None),
    }
    add_bos = "gemma" in str(getattr(model.config, "model_type", ""))
    return LoadedModel(spec, "hf", path, HFTokenizer(tokenizer, add_special_tokens=add_bos),
                       HFCausalLM(model, max_length), info)
