"""`POST /v1/responses`: OpenAI's Responses API, stateless, over the same sessions as chat.

Request: `model`, `input` (a string, or a list of messages `{role, content}` with text or
`input_text` / `output_text` parts, `function_call` and `function_call_output` items),
`instructions` (a system message), `max_output_tokens`, `temperature`, `top_p`, `stream`,
`text.format` (`text`, `json_object`, `json_schema` with `schema`: constrained.py), `tools`
(`{type: "function", name, description, parameters}`) and `tool_choice`, plus the extensions
`top_k`, `min_p`, `repetition_penalty`, `seed`. Nothing is stored: `store` true is accepted (the
client library's default) but no response can be fetched later, and `previous_response_id` is
a 400 (send the conversation in `input`; the pooled sessions still reuse its KV cache, so the
resent turns are not prefilled again). `metadata`, `user`, `parallel_tool_calls`, `truncation`
("disabled") are accepted and have no effect.

Response: `output` holds a `message` item (`output_text` content) and a `function_call` item per
parsed call (tool_calls.py); `status` is "incomplete" with `incomplete_details.reason`
"max_output_tokens" when the limit cut the reply. Streaming sends the typed events
(`response.created`, `response.output_item.added`, `response.output_text.delta`, ...,
`response.completed`), each with its `sequence_number`.
"""

from __future__ import annotations

import time
import uuid

from . import params
from .constrained import response_format
from .errors import bad, cannot, unsupported
from .openai_chat import plain_messages
from .runs import Answer, Spec, drain
from .tool_calls import CallStream, call_grammar_schema, check_template, split_calls, tool_choice

KNOWN = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "text", "tools",
         "tool_choice", "top_k", "min_p", "repetition_penalty", "seed", "store"}
IGNORED = {"metadata", "user", "parallel_tool_calls", "truncation", "service_tier"}
REFUSED = {"previous_response_id": "this server keeps no responses (stateless): send the conversation in 'input'",
           "conversation": "this server keeps no conversations (stateless): send them in 'input'",
           "reasoning": "this model has no reasoning setting", "include": "there is nothing extra to include",
           "background": "responses run in the foreground only", "prompt": "stored prompts are not kept"}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of parts", "input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise cannot("input", f"{where} has a '{kind}' part: this model reads text only")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def to_chat(body: dict) -> list[dict]:
    messages = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": _text(body["instructions"], "'instructions'")})
    given = body.get("input")
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    for i, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output"))})
        else:
            raise cannot("input", f"input[{i}] is a '{kind}' item: this server reads messages and function calls")
    return messages


def parse(ctx, body):
    params.check_fields(body, KNOWN, IGNORED, REFUSED, ctx.model_name)
    tokens = int(params.number(body, "max_output_tokens", 256, 1, integer=True))
    spec = Spec(max_tokens=tokens, temperature=float(params.number(body, "temperature", 1.0, 0, 2)),
                top_p=float(params.number(body, "top_p", 1.0, 0, 1)) or 1e-9, seed=params.seed(body),
                **params.sampling_extensions(body))
    messages = plain_messages(to_chat(body), ctx.template)
    given = body.get("tools") or []
    if not isinstance(given, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in given):
        raise unsupported("tools", "only function tools (no built-in tools on this server)")
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
             for t in given]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":  # the Responses form names it flat
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    choice = tool_choice({"tool_choice": choice}, tools)
    if choice == "none":
        tools = []
    check_template(ctx.template, tools, any(m["role"] == "tool" or m.get("tool_calls") for m in messages))
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise bad("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is not None:
        fmt = {"type": "json_schema", "json_schema": fmt} if isinstance(fmt, dict) and fmt.get("type") == \
            "json_schema" else fmt
        spec.constraint = response_format({"response_format": fmt}, ctx.grammars)
    if isinstance(choice, dict) or choice == "required":
        if spec.constraint is not None:
            raise bad("'text.format' and a forced tool call cannot both constrain the reply", "text")
        functions = [choice] if isinstance(choice, dict) else [t["function"] for t in tools]
        spec.constraint = ctx.grammars.tool_call(call_grammar_schema(functions))
    return messages, tools, spec, params.boolean(body, "stream"), body


def usage(run) -> dict:
    prompt, completion = run.prompt_token_count(), run.completion_tokens()
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": run.cached_tokens},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _output(text: str, tools: list, message_id: str) -> list[dict]:
    content, calls = split_calls(text) if tools else (text, [])
    out = []
    if content or not calls:
        out.append({"type": "message", "id": message_id, "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": content or "", "annotations": [], "logprobs": []}]})
    out += [_call_item(c) for c in calls]
    return out


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": "fc_" + call["id"][5:], "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def _response(ctx, body, ident: str, status: str, output: list, run=None, result=None) -> dict:
    out = {"id": ident, "object": "response", "created_at": int(time.time()), "status": status, "error": None,
           "incomplete_details": None, "instructions": body.get("instructions"),
           "max_output_tokens": body.get("max_output_tokens"), "model": ctx.model_name, "output": output,
           "parallel_tool_calls": True, "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
           "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [], "store": False,
           "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
           "metadata": body.get("metadata") or {}, "usage": None}
    if result is not None:
        if result.finish_reason == "length":
            out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        out["usage"], out["colibri"] = usage(run), run.telemetry()
    return out


def answer(ctx, body) -> Answer:
    messages, tools, spec, stream, body = parse(ctx, body)
    run = ctx.chat_run(messages, spec, {"tools": tools} if tools else None)
    ident, message_id = "resp_" + uuid.uuid4().hex[:24], "msg_" + uuid.uuid4().hex[:24]
    if stream:
        return Answer(events=_events(ctx, body, run, tools, ident, message_id))
    drain(run)
    result = run.results[0]
    return Answer(_response(ctx, body, ident, "completed", _output(result.text, tools, message_id), run, result))


def _events(ctx, body, run, tools, ident, message_id):
    sequence = iter(range(1 << 30))

    def event(kind: str, **fields):
        return kind, {"type": kind, "sequence_number": next(sequence), **fields}

    yield event("response.created", response=_response(ctx, body, ident, "in_progress", []))
    yield event("response.in_progress", response=_response(ctx, body, ident, "in_progress", []))
    message = {"type": "message", "id": message_id, "status": "in_progress", "role": "assistant", "content": []}
    yield event("response.output_item.added", output_index=0, item=message)
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield event("response.content_part.added", item_id=message_id, output_index=0, content_index=0, part=part)
    splitter, text, calls = CallStream(), [], []

    def pieces(piece: str, final: bool = False):
        parts = splitter.feed(piece) if tools else ([("content", piece)] if piece else [])
        if final and tools:
            parts += splitter.finish()
        for kind, value in parts:
            if kind == "content" and value:
                text.append(value)
                yield event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                            delta=value, logprobs=[])
            elif kind == "call":
                calls.append(value)

    for _, token in run.events:
        yield from pieces(token.text)
    yield from pieces("", final=True)
    full = "".join(text)
    done_part = dict(part, text=full)
    yield event("response.output_text.done", item_id=message_id, output_index=0, content_index=0, text=full,
                logprobs=[])
    yield event("response.content_part.done", item_id=message_id, output_index=0, content_index=0, part=done_part)
    message = dict(message, status="completed", content=[done_part])
    yield event("response.output_item.done", output_index=0, item=message)
    output = [message]
    for i, call in enumerate(calls, start=1):
        item = _call_item(call)
        yield event("response.output_item.added", output_index=i, item=dict(item, arguments="", status="in_progress"))
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                    delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                    arguments=item["arguments"], name=item["name"])
        yield event("response.output_item.done", output_index=i, item=item)
        output.append(item)
    result = run.results[0]
    final = _response(ctx, body, ident, "completed", output, run, result)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)

