"""Tools through the model's own chat template, and the tool calls parsed out of its reply.

The tools go to the template as transformers passes them (`tools=[{"type": "function",
"function": {name, description, parameters}}]`), so the model sees them in the format it was
trained on. Templates that write calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Hermes, Qwen2.5, Qwen3, and the templates derived from them) are the ones whose calls are parsed;
a template that takes no `tools` at all, or that writes calls in another format, gets a 400 with a
request that has tools: the server would otherwise return the calls as plain text and the client
would never see them.

`tool_choice`: "none" renders no tools; "auto" (the default) lets the model choose and parses
what it wrote; "required" and a named function constrain decoding (constrained.py) to one
`<tool_call>` block whose JSON matches a tool's `parameters` schema, so even a small model
returns a call the client can run.
"""

from __future__ import annotations

import json
import re
import uuid

from .errors import bad, unsupported

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def template_tool_format(template) -> str | None:
    """"hermes" when the template renders `tools` and writes `<tool_call>` blocks; None when it
    takes no tools; "other" when it takes tools in a format not parsed here."""
    source = template.source
    if source is None or "tools" not in source:
        return None
    return "hermes" if OPEN in source else "other"


def parse_tools(body: dict) -> list[dict]:
    """OpenAI chat `tools`, checked: a list of {"type": "function", "function": {name, ...}}."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}].function needs a 'name'", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return tools


def tool_choice(body: dict, tools: list[dict]) -> str | dict:
    """"none" | "auto" | "required" | the named tool's function dict."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise bad("tool_choice 'required' needs 'tools'", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                  "{'name': ...}}", "tool_choice")
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool["function"]
    raise bad(f"tool_choice names '{name}', which is not in 'tools'", "tool_choice")


def check_template(template, tools: list[dict], has_tool_messages: bool) -> None:
    """400 unless the chat template can take the tools and write calls we parse."""
    if not tools and not has_tool_messages:
        return
    kind = template_tool_format(template)
    if kind is None:
        raise unsupported("tools", "this model's chat template takes no tools (serve a container whose "
                                   "template renders `tools`, or pass --chat-template)")
    if kind != "hermes":
        raise unsupported("tools", "this model's chat template writes tool calls in a format the server does "
                                   "not parse (it parses <tool_call>{json}</tool_call> blocks)")


def call_grammar_schema(functions: list[dict]) -> dict:
    """The JSON schema of one call's body: {"name": one of the tools, "arguments": its parameters}."""
    options = [{"type": "object", "properties": {"name": {"const": fn["name"]},
                                                 "arguments": fn.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for fn in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def split_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the text outside the call blocks or None, the calls as OpenAI `tool_calls`). A block that
    is not a JSON object with a string `name` stays in the text (the model wrote it, not a call)."""
    calls, kept, last = [], [], 0
    for match in _BLOCK.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(arguments)}})
        kept.append(text[last : match.start()])
        last = match.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


class CallStream:
    """Splits streamed text into content pieces and completed calls: text that may open a call
    block is held back until it does or cannot; a call is handed out when its block closes."""

    def __init__(self):
        self.pending = ""
        self.calls: list[dict] = []

    def feed(self, piece: str) -> list[tuple[str, object]]:
        self.pending += piece
        out: list[tuple[str, object]] = []
        while True:
            start = self.pending.find(OPEN)
            if start < 0:
                keep = _open_prefix(self.pending)
                if len(self.pending) > keep:
                    out.append(("content", self.pending[: len(self.pending) - keep]))
                    self.pending = self.pending[len(self.pending) - keep :]
                return out
            if start > 0:
                out.append(("content", self.pending[:start]))
                self.pending = self.pending[start:]
            end = self.pending.find(CLOSE)
            if end < 0:
                return out
            block = self.pending[: end + len(CLOSE)]
            self.pending = self.pending[end + len(CLOSE) :]
            _, calls = split_calls(block)
            if calls:
                self.calls += calls
                out += [("call", c) for c in calls]
            else:
                out.append(("content", block))

    def finish(self) -> list[tuple[str, object]]:
        rest, self.pending = self.pending, ""
        return [("content", rest)] if rest else []


def _open_prefix(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant `tool_calls` with their arguments as objects (what the templates render with
    `tojson`; OpenAI clients send them as JSON strings)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        raise bad("an assistant tool call's 'arguments' is not JSON", "messages") from None
                calls.append({**call, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
