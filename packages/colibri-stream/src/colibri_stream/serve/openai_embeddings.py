"""`POST /v1/embeddings`: OpenAI's embeddings over a `ServeContext`, from the served language model.

`input` is a string, a list of token ids, or a list of either (one embedding each, `index` in
order). An embedding is the model's last hidden state (the final norm's output) averaged over the
input's tokens and L2-normalised (`Engine.embed`; the server's `--embedding-pooling last` takes
the last token's instead): what llama.cpp serves with `--embedding --pooling mean`. It is a
language model's representation, useful for similarity and retrieval within one model, not a
trained embedding model's. `encoding_format` "float" or "base64" (little-endian float32, what the
official openai client asks for by default and decodes); `dimensions` only as the model's width.
"""

from __future__ import annotations

import base64

from . import params
from .errors import bad, unsupported
from .openai_completions import prompts_of
from .runs import Answer

KNOWN = {"model", "input", "encoding_format", "dimensions"}
IGNORED = {"user"}


def answer(ctx, body) -> Answer:
    params.check_fields(body, KNOWN, IGNORED, model_name=ctx.model_name)
    engine = ctx.engine
    width = engine.config.d_model
    if params.number(body, "dimensions", width, 1, integer=True) != width:
        raise unsupported("dimensions", f"this model's embeddings have {width} dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad(f"'encoding_format' must be float or base64, got {encoding!r}", "encoding_format")
    if "input" not in body:
        raise bad("'input' is required", "input")
    inputs = prompts_of(engine, body["input"], "input")
    for ids in inputs:
        if len(ids) > engine.max_context:
            raise bad(f"an input of {len(ids)} tokens exceeds the engine's max_context={engine.max_context}",
                      "input", "context_length_exceeded")
    data = []
    for index, ids in enumerate(inputs):
        vector = engine.embed(ids, pooling=ctx.embedding_pooling).numpy().astype("<f4")
        embedding = base64.b64encode(vector.tobytes()).decode() if encoding == "base64" else vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(len(ids) for ids in inputs)
    return Answer(body={"object": "list", "data": data, "model": ctx.model_name,
                        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

