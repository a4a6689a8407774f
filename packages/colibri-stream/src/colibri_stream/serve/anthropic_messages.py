"""`POST /v1/messages`: Anthropic's Messages API over the same sessions as OpenAI chat.

Request: `model`, `max_tokens` (required, as Anthropic requires it), `messages` (user / assistant;
content a string or text, `tool_use` and `tool_result` blocks), `system` (a string or text
blocks), `temperature` (0..1, default 1), `top_p`, `top_k`, `stop_sequences`, `stream`, `tools`
(`{name, description, input_schema}`) and `tool_choice` (`auto`, `any`, `tool` + `name`, `none`;
`any` and `tool` are enforced by constrained decoding, tool_calls.py); `metadata` and
`service_tier` are accepted and have no effect (so is `cache_control`: every shared prefix is
reused anyway); `output_config.format` (`json_schema`) is enforced by constrained decoding;
`thinking`, `output_config.effort`, images and documents are a 400. (Recent SDKs no longer
take `temperature`, `top_p`, `top_k` as arguments: pass them in `extra_body`.)

Response: a `message` with `text` and `tool_use` content blocks, `stop_reason` (`end_turn`,
`max_tokens`, `stop_sequence` + `stop_sequence`, `tool_use`) and `usage` as Anthropic counts it:
`input_tokens` are the prompt tokens that ran, `cache_read_input_tokens` those whose KV cache a
pooled session already held (their sum is the prompt). Streaming sends Anthropic's events:
`message_start`, `content_block_start` / `content_block_delta` (`text_delta`,
`input_json_delta`) / `content_block_stop`, `ping`, `message_delta` (stop reason, usage) and
`message_stop`. Errors: `{"type": "error", "error": {"type", "message"}}` (errors.py). The
`colibri` telemetry object sits beside `usage` (in `message_delta` when streaming).
"""

from __future__ import annotations

import json
import uuid

from . import params
from .errors import bad, cannot, unsupported
from .openai_chat import plain_messages
from .runs import Answer, Spec, drain, matched_stop
from .tool_calls import CallStream, call_grammar_schema, check_template, split_calls

KNOWN = {"model", "max_tokens", "messages", "system", "temperature", "top_p", "top_k", "stop_sequences", "stream",
         "tools", "tool_choice", "output_config"}
# cache_control: this server reuses every shared prefix by itself (session_pool.py)
IGNORED = {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "user_profile_id", "workspace_id",
           "diagnostics"}
REFUSED = {"thinking": "this model has no extended thinking", "mcp_servers": "this server runs no MCP client",
           "container": "this server has no code-execution container"}
STOP = {"eos": "end_turn", "length": "max_tokens", "stop": "stop_sequence"}


def _text(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad(f"{where} must be a string or a list of content blocks")
    parts = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise cannot("messages", f"{where} has a '{kind}' block where text is expected: this model "
                                          "reads text only")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def to_chat(body: dict) -> tuple[list[dict], list[dict]]:
    """(OpenAI-style messages for the template, OpenAI-style tools)."""
    messages = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"], "'system'")})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise bad("'messages' must be a non-empty list")
    for i, m in enumerate(given):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"messages.{i}: role must be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"messages.{i}.content must be a string or a list of blocks")
        text, calls = [], []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                 "content": _text(block.get("content", ""), f"messages.{i} tool_result")})
            else:
                raise cannot("messages", f"messages.{i} has a '{kind}' block: this model reads text only (and "
                                         "tool_use / tool_result blocks)")
        if text or calls or m["role"] == "assistant":
            message = {"role": m["role"], "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
        raise bad("'tools' must be a list of {name, description, input_schema}")
    return messages, [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                         "parameters": t.get("input_schema") or {"type": "object"}}}
                      for t in tools]


def parse(ctx, body):
    params.check_fields(body, KNOWN, IGNORED, REFUSED, ctx.model_name)
    if body.get("max_tokens") is None:
        raise bad("max_tokens: field required")
    spec = Spec(max_tokens=int(params.number(body, "max_tokens", 1, 1, integer=True)),
                temperature=float(params.number(body, "temperature", 1.0, 0, 1)),
                top_p=float(params.number(body, "top_p", 1.0, 0, 1)) or 1e-9,
                top_k=int(params.number(body, "top_k", 0, 0, integer=True)),
                stop=params.stop_strings(body, "stop_sequences", None))
    messages, tools = to_chat(body)
    output = body.get("output_config") or {}
    if not isinstance(output, dict) or set(output) - {"format", "effort"}:
        raise bad("output_config must be an object with 'format'")
    if output.get("effort") is not None:
        raise unsupported("output_config", "this model has no effort setting")
    if output.get("format") is not None:
        fmt = output["format"]
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad("output_config.format must be {'type': 'json_schema', 'schema': {...}}")
        spec.constraint = ctx.grammars.json_schema(fmt["schema"], "output_config")
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice.type must be 'auto', 'any', 'tool' or 'none'")
    if kind == "none":
        tools = []
    messages = plain_messages(messages, ctx.template)
    check_template(ctx.template, tools, any(m["role"] == "tool" or m.get("tool_calls") for m in messages))
    if kind in ("any", "tool"):
        if spec.constraint is not None:
            raise bad("output_config.format and a forced tool call cannot both constrain the reply")
        functions = [t["function"] for t in tools if kind == "any" or t["function"]["name"] == choice.get("name")]
        if not functions:
            raise bad("tool_choice names no tool in 'tools'")
        spec.constraint = ctx.grammars.tool_call(call_grammar_schema(functions))
    return messages, tools, spec, params.boolean(body, "stream")


def usage(run) -> dict:
    cached = run.cached_tokens
    return {"input_tokens": run.prompt_token_count() - cached, "output_tokens": run.completion_tokens(),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _blocks(text: str, tools: list) -> list[dict]:
    content, calls = split_calls(text) if tools else (text, [])
    blocks = [{"type": "text", "text": content}] if content else []
    blocks += [{"type": "tool_use", "id": "toolu_" + c["id"][5:], "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"])} for c in calls]
    return blocks


def answer(ctx, body) -> Answer:
    messages, tools, spec, stream = parse(ctx, body)
    run = ctx.chat_run(messages, spec, {"tools": tools} if tools else None)
    ident = "msg_" + uuid.uuid4().hex[:24]
    if stream:
        return Answer(events=_events(ctx, run, spec, tools, ident))
    drain(run)
    result = run.results[0]
    blocks = _blocks(result.text, tools)
    stop = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else STOP[result.finish_reason]
    return Answer({"id": ident, "type": "message", "role": "assistant", "model": ctx.model_name, "content": blocks,
                   "stop_reason": stop, "stop_sequence": matched_stop(ctx.engine, result, spec.stop),
                   "usage": usage(run), "colibri": run.telemetry()})


def _events(ctx, run, spec, tools, ident):
    start_usage = {"input_tokens": run.prompt_token_count() - run.cached_tokens, "output_tokens": 0,
                   "cache_read_input_tokens": run.cached_tokens, "cache_creation_input_tokens": 0}
    yield "message_start", {"type": "message_start", "message": {
        "id": ident, "type": "message", "role": "assistant", "model": ctx.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}}
    yield "ping", {"type": "ping"}
    splitter, index, text_open, used_tool = CallStream(), 0, False, False

    def pieces(text: str, final: bool = False):
        nonlocal index, text_open, used_tool
        parts = splitter.feed(text) if tools else ([("content", text)] if text else [])
        if final and tools:
            parts += splitter.finish()
        for kind, value in parts:
            if kind == "content" and value:
                if not text_open:
                    yield "content_block_start", {"type": "content_block_start", "index": index,
                                                  "content_block": {"type": "text", "text": ""}}
                    text_open = True
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "text_delta", "text": value}}
            elif kind == "call":
                if text_open:
                    yield "content_block_stop", {"type": "content_block_stop", "index": index}
                    index, text_open = index + 1, False
                used_tool = True
                block = {"type": "tool_use", "id": "toolu_" + value["id"][5:], "name": value["function"]["name"],
                         "input": {}}
                yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
                yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": value["function"]["arguments"]}}
                yield "content_block_stop", {"type": "content_block_stop", "index": index}
                index += 1

    for _, token in run.events:
        yield from pieces(token.text)
    yield from pieces("", final=True)
    if text_open:
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    result = run.results[0]
    stop = "tool_use" if used_tool else STOP[result.finish_reason]
    yield "message_delta", {"type": "message_delta",
                            "delta": {"stop_reason": stop, "stop_sequence": matched_stop(ctx.engine, result, spec.stop)},
                            "usage": usage(run), "colibri": run.telemetry()}
    yield "message_stop", {"type": "message_stop"}
