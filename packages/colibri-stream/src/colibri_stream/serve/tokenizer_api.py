"""`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`: the served model's own tokenizer
over HTTP, in vLLM's shapes, so a client counts and splits tokens exactly as the server does.
lm-eval's API models (`local-completions`, `tokenizer_backend=remote` or auto-detected) use them
to tokenize context and continuation, then send token ids to `/v1/completions` with `echo`.
The `/v1/...` paths answer too."""

from __future__ import annotations

from . import params
from .errors import bad


def tokenize(ctx, body) -> dict:
    params.check_fields(body, {"prompt", "add_special_tokens", "model"}, model_name=None)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad("'prompt' must be a string", "prompt")
    special = params.boolean(body, "add_special_tokens", False)
    ids = ctx.engine.tokenizer.encode(prompt, add_special_tokens=special).ids
    return {"count": len(ids), "max_model_len": ctx.engine.max_context, "tokens": ids}


def detokenize(ctx, body) -> dict:
    params.check_fields(body, {"tokens", "model"}, model_name=None)
    tokens = body.get("tokens")
    vocab = ctx.engine.tokenizer.get_vocab_size()
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                               for t in tokens):
        raise bad(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
    return {"prompt": ctx.engine.tokenizer.decode(tokens, skip_special_tokens=False)}


def tokenizer_info(ctx) -> dict:
    engine = ctx.engine
    config = engine.container.tokenizer_config or {}
    ends = engine.end_token_ids
    eos = config.get("eos_token") or (engine.tokenizer.id_to_token(ends[0]) if ends else None)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": config.get("bos_token"),
            "pad_token": config.get("pad_token"), "model_max_length": engine.max_context,
            "chat_template": ctx.template.source, "vocab_size": engine.tokenizer.get_vocab_size()}
