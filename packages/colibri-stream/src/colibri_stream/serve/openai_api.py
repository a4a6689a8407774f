"""The OpenAI API's request and response shapes, over an `Engine` (no HTTP here: server.py).

Endpoints: `/v1/chat/completions` (messages through the container's chat template, chat.py),
`/v1/completions` (a prompt string, a list of token ids, or a list of either: one choice per
prompt, `index` = its place, all run as one padded batch, batch_decode.py), `/v1/models`. Parameters: `model`
(must name the served model: else 404), `max_tokens` / `max_completion_tokens`, `temperature`
(OpenAI's default 1.0), `top_p`, `seed`, `stop` (a string or a list), `stream`,
`stream_options.include_usage`, `logprobs` (chat: true + `top_logprobs` n; completions: n), and
the extensions `top_k`, `min_p`, `repetition_penalty` (as llama.cpp's and vLLM's servers take
them). `n` > 1, `echo`, non-zero `presence_penalty` / `frequency_penalty`, tools and
`response_format` are refused with a 400 naming the parameter, not ignored. Every request runs
on its own session, so concurrent requests are safe (the engine serialises forward passes); a
chat request continues the pooled session sharing its longest prefix (session_pool.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from ..batch_decode import stream_batch
from ..chat import ChatTemplateError, ContextOverflowError
from ..generation import GenerationResult, StreamedToken

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias", "suffix")
DEFAULT_MAX_TOKENS = 256


class APIError(Exception):
    """An OpenAI-shaped error: HTTP `status`, and the body's message, type, param and code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class Request:
    kind: str  # "chat" | "completion"
    body: dict
    stream: bool
    include_usage: bool
    kwargs: dict  # Session.stream keywords
    max_tokens: int
    logprobs: int | None  # None: no logprobs; else the number of alternatives


def _number(body: dict, name: str, default, low=None, high=None, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad(f"'{name}' must be in [{low}, {high if high is not None else 'inf'}], got {value!r}", name)
    return value


def parse_request(kind: str, body, model_name: str) -> Request:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if body.get("model") != model_name:
        raise APIError(404, f"The model '{body.get('model')}' does not exist; this server serves '{model_name}'",
                       "model", "model_not_found")
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise bad(f"'{name}' is not supported by colibri-stream serve", name, "unsupported_parameter")
    if _number(body, "n", 1, 1, integer=True) != 1:
        raise bad("only n=1 is supported", "n", "unsupported_parameter")
    if body.get("echo"):
        raise bad("'echo' is not supported", "echo", "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0, -2, 2) != 0:
            raise bad(f"'{name}' is not supported (use 'repetition_penalty')", name, "unsupported_parameter")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise bad("'stop' must be a string or a list of at most 4 strings", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad(f"'seed' must be an integer, got {seed!r}", "seed")
    kwargs = dict(
        temperature=float(_number(body, "temperature", 1.0, 0, 2)),
        top_p=float(_number(body, "top_p", 1.0, 0, 1)) or 1e-9,  # top_p 0: the most likely token only
        top_k=int(_number(body, "top_k", 0, 0, integer=True)),
        min_p=float(_number(body, "min_p", 0.0, 0, 1)),
        repetition_penalty=float(_number(body, "repetition_penalty", 1.0, 1e-6)),
        seed=seed,
        stop=stop,
    )
    if kind == "chat":
        logprobs = None
        if body.get("logprobs"):
            logprobs = int(_number(body, "top_logprobs", 0, 0, 20, integer=True))
    else:
        logprobs = body.get("logprobs")
        if logprobs is not None:
            logprobs = int(_number(body, "logprobs", 0, 0, 20, integer=True))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    return Request(kind, body, stream, bool(options.get("include_usage")), kwargs, max_tokens, logprobs)


def start(engine, request: Request, pool=None) -> tuple[Iterator[StreamedToken], list[GenerationResult]]:
    """Begin generating (errors in the input raise `APIError` here, before any output). Chat
    requests take a session from `pool` (session_pool.py) when one is given."""
    result: list[GenerationResult] = []
    kwargs = dict(request.kwargs, logprobs=request.logprobs or 0, result=result)
    try:
        if request.kind == "chat":
            messages = request.body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise bad("'messages' must be a non-empty list", "messages")
            messages = [_plain_message(m, i) for i, m in enumerate(messages)]
            if pool is None:
                tokens = engine.chat_session().stream(messages, request.max_tokens, **kwargs)
            else:
                chat = pool.take(engine.chat_prompt(messages))
                tokens = pool.returning(chat, chat.stream(messages, request.max_tokens, **kwargs))
        else:
            prompts = _completion_prompts(engine, request.body.get("prompt"))
            if len(prompts) == 1:
                tokens = engine.session().stream(prompts[0], request.max_tokens, **kwargs)
            else:  # one padded batch, every row decoded in each pass (batch_decode.py)
                kwargs.pop("result")
                tokens, batch = stream_batch(engine, prompts, request.max_tokens, **kwargs)
                return tokens, batch
    except ContextOverflowError as exc:
        raise bad(str(exc), "messages", "context_length_exceeded") from None
    except ChatTemplateError as exc:
        raise bad(str(exc), "messages") from None
    except ValueError as exc:
        code = "context_length_exceeded" if "max_context" in str(exc) else None
        raise bad(str(exc), None, code) from None
    return tokens, result


def _completion_prompts(engine, prompt) -> list:
    """The prompts of a completions request: a string, a list of token ids, or a list of either
    (one choice per prompt, run as one batch)."""
    def is_ids(value) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)

    if prompt == "" or prompt == []:
        raise bad("'prompt' is empty", "prompt")
    if isinstance(prompt, str) or is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise bad("'prompt' must be a string, a list of token ids, or a non-empty list of either", "prompt")
    vocab = engine.tokenizer.get_vocab_size()
    for p in prompts:
        if not p:
            raise bad("'prompt' is empty", "prompt")
        if isinstance(p, list) and any(not 0 <= t < vocab for t in p):
            raise bad(f"prompt token ids must be in [0, {vocab})", "prompt")
    return prompts


def _plain_message(message, index: int) -> dict:
    """{role, content} with content a string (OpenAI's list of text parts is joined)."""
    if not isinstance(message, dict):
        raise bad(f"messages[{index}] must be an object", "messages")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise bad(f"messages[{index}]: only text content parts are supported", "messages")
        content = "".join(str(p.get("text", "")) for p in content)
    if message.get("role") not in ("system", "user", "assistant", "developer"):
        raise bad(f"messages[{index}]: role {message.get('role')!r} is not supported", "messages")
    if not isinstance(content, str):
        raise bad(f"messages[{index}] needs a string 'content'", "messages")
    role = "system" if message["role"] == "developer" else message["role"]
    return {"role": role, "content": content}


# --- responses ----------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(results: list[GenerationResult]) -> dict:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_text(engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])


def chat_logprobs(engine, tokens: list[StreamedToken]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = _token_text(engine, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(entry(t.id, t.logprob), top_logprobs=[entry(i, lp) for i, lp in t.top_logprobs])
                        for t in tokens if t.id is not None], "refusal": None}


def completion_logprobs(engine, tokens: list[StreamedToken], offset: int = 0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        if t.id is None:
            continue
        out["tokens"].append(_token_text(engine, t.id))
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({_token_text(engine, i): lp for i, lp in t.top_logprobs})
        out["text_offset"].append(offset)
        offset += len(t.text)
    return out


def full_response(engine, request: Request, model_name: str, results: list[GenerationResult]) -> dict:
    """The whole answer: one choice per result (a completions request's list of prompts gives
    several, `index` = the prompt's)."""
    created = int(time.time())
    choices = []
    for index, result in enumerate(results):
        finish = FINISH[result.finish_reason]
        if request.kind == "chat":
            logprobs = chat_logprobs(engine, result.tokens) if request.logprobs is not None else None
            choices.append({"index": index, "message": {"role": "assistant", "content": result.text, "refusal": None},
                            "logprobs": logprobs, "finish_reason": finish})
        else:
            logprobs = completion_logprobs(engine, result.tokens) if request.logprobs is not None else None
            choices.append({"index": index, "text": result.text, "finish_reason": finish, "logprobs": logprobs})
    kind = "chat.completion" if request.kind == "chat" else "text_completion"
    return {"id": new_id(request.kind), "object": kind, "created": created, "model": model_name,
            "choices": choices, "usage": usage(results), "system_fingerprint": None}


def stream_chunks(engine, request: Request, model_name: str, tokens: Iterator,
                  result: list[GenerationResult]) -> Iterator[dict]:
    """The SSE events' JSON objects, in order (the server adds `data: [DONE]`). `tokens` yields
    `StreamedToken`s, or (choice index, `StreamedToken`) pairs for a batch of prompts; each
    choice's finish chunk comes once all are done (the results are complete then)."""
    ident, created = new_id(request.kind), int(time.time())
    chat = request.kind == "chat"
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, piece: str | None, finish: str | None, token: StreamedToken | None = None,
              first=False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece is not None else {})
            logprobs = chat_logprobs(engine, [token]) if token is not None and request.logprobs is not None else None
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            logprobs = completion_logprobs(engine, [token]) if token is not None and request.logprobs is not None \
                else None
            choice = {"index": index, "text": piece or "", "logprobs": logprobs, "finish_reason": finish}
        out = {"id": ident, "object": kind, "created": created, "model": model_name, "choices": [choice]}
        if request.include_usage:
            out["usage"] = None
        return out

    if chat:
        yield chunk(0, None, None, first=True)
    for item in tokens:
        index, token = item if isinstance(item, tuple) else (0, item)
        if token.text or (token.id is not None and request.logprobs is not None):
            yield chunk(index, token.text, None, token if token.id is not None else None)
    for index, final in enumerate(result):
        yield chunk(index, None, FINISH[final.finish_reason])
    if request.include_usage:
        yield {"id": ident, "object": kind, "created": created, "model": model_name, "choices": [],
               "usage": usage(result)}


def models_response(model_name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "colibri-stream"}]}
