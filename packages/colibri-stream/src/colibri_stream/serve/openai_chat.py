"""`POST /v1/chat/completions`: OpenAI's chat request and response shapes over a `ServeContext`.

Fields: `model` (the served name, else 404), `messages` (system / developer / user / assistant
/ tool; text content or text parts), `max_tokens` / `max_completion_tokens`, `temperature`
(OpenAI's default 1.0), `top_p`, `n` (choices, decoded as one batch: runs.py), `seed`, `stop`,
`logprobs` + `top_logprobs` (<= 20), `stream` + `stream_options.include_usage`,
`response_format` (text, json_object, json_schema: constrained.py), `tools` + `tool_choice`
(tool_calls.py), and the extensions `top_k`, `min_p`, `repetition_penalty`. `user`, `metadata`,
`store`, `service_tier` and `parallel_tool_calls` are accepted and have no effect; anything else
this server cannot do is a 400 naming the field (params.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from . import params
from .constrained import response_format
from .errors import bad, cannot
from .runs import Answer, Run, Spec, drain
from .tool_calls import (
    CallStream,
    call_grammar_schema,
    check_template,
    parse_tools,
    split_calls,
    template_messages,
    tool_choice,
)

KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
         "stream_options", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
         "response_format", "tools", "tool_choice", "top_k", "min_p", "repetition_penalty"}
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
REFUSED = {"logit_bias": "the sampler takes no per-token bias",
           "audio": "this model reads and writes text only",
           "prediction": "predicted outputs are not implemented",
           "functions": "use 'tools'", "function_call": "use 'tool_choice'",
           "web_search_options": "this server has no web search",
           "reasoning_effort": "this model has no reasoning setting"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
DEFAULT_MAX_TOKENS = 256
MAX_N = 16


@dataclass
class ChatRequest:
    messages: list[dict]
    spec: Spec
    stream: bool
    include_usage: bool
    tools: list[dict]
    parse_calls: bool  # the reply's <tool_call> blocks become tool_calls


def max_tokens(body: dict, names=("max_completion_tokens", "max_tokens"), default=DEFAULT_MAX_TOKENS,
               low: int = 1) -> int:
    for name in names:
        if body.get(name) is not None:
            return int(params.number(body, name, default, low, integer=True))
    return default


def base_spec(body: dict, tokens: int, temperature_max: float = 2) -> Spec:
    params.no_penalties(body)
    return Spec(max_tokens=tokens, temperature=float(params.number(body, "temperature", 1.0, 0, temperature_max)),
                top_p=float(params.number(body, "top_p", 1.0, 0, 1)) or 1e-9,  # 0: the most likely token only
                seed=params.seed(body), stop=params.stop_strings(body), n=int(params.number(body, "n", 1, 1, MAX_N, True)),
                **params.sampling_extensions(body))


def plain_messages(messages, template) -> list[dict]:
    """The messages as the template takes them: content a string (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}]: role {role!r} is not supported", "messages")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise cannot("messages", f"messages[{i}] has non-text content: this model reads text only")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}] needs a string 'content'", "messages")
        plain = {"role": "system" if role == "developer" else role, "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                plain[key] = m[key]
        out.append(plain)
    return template_messages(out)


def parse(ctx, body) -> ChatRequest:
    params.check_fields(body, KNOWN, IGNORED, REFUSED, ctx.model_name)
    spec = base_spec(body, max_tokens(body))
    if params.boolean(body, "logprobs"):
        spec.logprobs = int(params.number(body, "top_logprobs", 0, 0, 20, integer=True))
    elif body.get("top_logprobs") is not None:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    stream = params.boolean(body, "stream")
    include_usage = params.stream_options(body, stream)
    messages = plain_messages(body.get("messages"), ctx.template)
    tools = parse_tools(body)
    choice = tool_choice(body, tools)
    has_tool_turns = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if choice == "none":
        tools = []
    check_template(ctx.template, tools, has_tool_turns)
    spec.constraint = response_format(body, ctx.grammars)
    if isinstance(choice, dict) or choice == "required":
        if spec.constraint is not None:
            raise bad("'response_format' and a forced tool call cannot both constrain the reply", "response_format")
        functions = [choice] if isinstance(choice, dict) else [t["function"] for t in tools]
        spec.constraint = ctx.grammars.tool_call(call_grammar_schema(functions))
    return ChatRequest(messages, spec, stream, include_usage, tools, bool(tools))


def start(ctx, request: ChatRequest) -> Run:
    variables = {"tools": request.tools} if request.tools else None
    return ctx.chat_run(request.messages, request.spec, variables)


def new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def token_entry(engine, token_id: int, logprob: float) -> dict:
    text = engine.tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def logprobs_of(engine, tokens) -> dict:
    return {"content": [dict(token_entry(engine, t.id, t.logprob),
                             top_logprobs=[token_entry(engine, i, lp) for i, lp in t.top_logprobs])
                        for t in tokens if t.id is not None], "refusal": None}


def full_response(ctx, request: ChatRequest, run: Run) -> dict:
    choices = []
    for index, result in enumerate(run.results):
        content, calls = split_calls(result.text) if request.parse_calls else (result.text, [])
        message = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        logprobs = logprobs_of(ctx.engine, result.tokens) if request.spec.logprobs is not None else None
        choices.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": "tool_calls" if calls else FINISH[result.finish_reason]})
    return {"id": new_id(), "object": "chat.completion", "created": int(time.time()), "model": ctx.model_name,
            "choices": choices, "usage": run.usage(), "system_fingerprint": None, "colibri": run.telemetry()}


def stream_events(ctx, request: ChatRequest, run: Run):
    """The SSE chunks in order (the server adds `data: [DONE]`). The last chunk carries the
    `colibri` telemetry (the usage chunk when `include_usage`, else each choice's finish chunk)."""
    ident, created = new_id(), int(time.time())
    n = request.spec.n
    splitters = [CallStream() for _ in range(n)]
    calls_seen = [0] * n

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs=None) -> dict:
        out = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
               "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if request.include_usage:
            out["usage"] = None
        return out

    def pieces(index: int, text: str, final: bool = False):
        parts = splitters[index].feed(text) if request.parse_calls else [("content", text)] if text else []
        if final and request.parse_calls:
            parts += splitters[index].finish()
        for kind, value in parts:
            if kind == "content":
                yield {"content": value}
            else:
                call = dict(value, index=calls_seen[index])
                calls_seen[index] += 1
                yield {"tool_calls": [call]}

    for index in range(n):
        yield chunk(index, {"role": "assistant", "content": ""})
    for index, token in run.events:
        logprobs = logprobs_of(ctx.engine, [token]) if token.id is not None and request.spec.logprobs is not None \
            else None
        deltas = list(pieces(index, token.text))
        if logprobs is not None and not deltas:
            deltas = [{"content": ""}]
        for k, delta in enumerate(deltas):
            yield chunk(index, delta, logprobs=logprobs if k == 0 else None)
    for index, result in enumerate(run.results):
        for delta in pieces(index, "", final=True):
            yield chunk(index, delta)
        finish = "tool_calls" if calls_seen[index] else FINISH[result.finish_reason]
        last = chunk(index, {}, finish)
        if not request.include_usage:
            last["colibri"] = run.telemetry()
        yield last
    if request.include_usage:
        yield {"id": ident, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
               "choices": [], "usage": run.usage(), "colibri": run.telemetry()}


def answer(ctx, body) -> Answer:
    request = parse(ctx, body)
    run = start(ctx, request)
    if request.stream:
        return Answer(events=((None, c) for c in stream_events(ctx, request, run)), done_marker=True)
    drain(run)
    return Answer(full_response(ctx, request, run))
