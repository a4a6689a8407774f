"""`response_format` enforced by constrained decoding (llguidance) and `tools` through the chat
template, with the official `openai` and `anthropic` clients against the real server. The random
tiny model writes nothing JSON-like by itself, so every valid answer here is the grammar's doing."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import torch
from colibri_stream import Engine
from colibri_stream.serve import make_server, serve_in_thread

MODEL = "tiny-test"
MESSAGES = [{"role": "user", "content": "Plan a trip."}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": SCHEMA}}
# Hermes / Qwen2.5's way of offering tools and writing calls, in ChatML
TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'system' %}{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _keeps_schema(value) -> bool:
    return set(value) == {"city", "days"} and value["city"] in ("Paris", "Oslo", "Lima") and 1 <= value["days"] <= 9


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", kernel_dtype="f32") as engine:
        yield engine


def _serve(engine, **options):
    server = make_server(engine, "127.0.0.1", 0, model_name=MODEL, **options)
    serve_in_thread(server)
    return server


@pytest.fixture(scope="module")
def plain(engine):
    server = _serve(engine)
    yield openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def with_tools(engine):
    server = _serve(engine, chat_template=TOOL_TEMPLATE)
    yield (openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120),
           anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=120))
    server.shutdown()
    server.server_close()


def test_json_schema_answers_keep_the_schema_and_report_the_models_logprobs(engine, plain):
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    free = plain.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].message.content)  # the model alone writes no JSON
    got = plain.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0,
                                        response_format=fmt, logprobs=True)
    assert _keeps_schema(json.loads(got.choices[0].message.content)) and got.choices[0].finish_reason == "stop"
    # the reported logprobs are the model's own (raw logits), not the masked distribution's
    prompt = engine.chat_prompt(MESSAGES)
    ids = engine.encode(got.choices[0].message.content)
    rows = torch.log_softmax(engine.logits(prompt + ids), -1)
    first = got.choices[0].logprobs.content[0]
    assert first.logprob == pytest.approx(float(rows[len(prompt) - 1, ids[0]]), abs=1e-4) and first.logprob < -1e-3
    for seed in range(3):  # sampled answers keep it too
        sampled = plain.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=1.0,
                                                seed=seed, response_format=fmt)
        assert _keeps_schema(json.loads(sampled.choices[0].message.content))
    streamed = plain.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0,
                                             response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == got.choices[0].message.content
    two = plain.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0.9, seed=1, n=2,
                                        response_format=fmt)
    assert all(_keeps_schema(json.loads(c.message.content)) for c in two.choices)  # a grammar per batch row


def test_json_object_and_the_other_apis_formats(plain):
    got = plain.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                        response_format={"type": "json_object"})
    text = got.choices[0].message.content
    assert text.startswith("{")
    if got.choices[0].finish_reason == "stop":  # complete: it parses (max_tokens may cut a long object)
        assert isinstance(json.loads(text), dict)
    response = plain.responses.create(model=MODEL, input="Plan a trip.", max_output_tokens=30, temperature=0,
                                      text={"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA}})
    assert _keeps_schema(json.loads(response.output_text))
    claude = anthropic.Anthropic(base_url=str(plain.base_url).removesuffix("/v1/"), api_key="x", max_retries=0)
    message = claude.messages.create(model=MODEL, max_tokens=30, messages=[{"role": "user", "content": "Plan a trip."}],
                                     output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    assert _keeps_schema(json.loads(message.content[0].text))
    with pytest.raises(openai.BadRequestError) as err:
        plain.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "xml"})
    assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        plain.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "$ref": "#/nowhere"}}})
    assert err.value.body["param"] == "response_format"


def test_a_forced_tool_call_is_parsed_into_tool_calls(with_tools):
    client, _ = with_tools
    choice = {"type": "function", "function": {"name": "get_weather"}}
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                         tools=[WEATHER], tool_choice=choice)
    message = got.choices[0].message
    assert got.choices[0].finish_reason == "tool_calls" and not message.content
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert _keeps_schema(json.loads(call.function.arguments))
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                                 tools=[WEATHER], tool_choice=choice, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"] and deltas[0].index == 0
    assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all("<tool_call>" not in (c.choices[0].delta.content or "") for c in chunks)
    # the call and its result go back through the template; the next turn answers in text
    messages = MESSAGES + [message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    follow = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            tools=[WEATHER], tool_choice="none")
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.tool_calls is None
    required = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0.7, seed=2,
                                              tools=[WEATHER], tool_choice="required")
    assert required.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_tools_through_anthropic_and_responses(with_tools):
    client, claude = with_tools
    tool = {"name": "get_weather", "description": "Weather in a city", "input_schema": SCHEMA}
    message = claude.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Trip?"}],
                                     tools=[tool], tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    use = [b for b in message.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and _keeps_schema(use.input) and use.id.startswith("toolu_")
    with claude.messages.stream(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Trip?"}],
                                tools=[tool], tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and _keeps_schema([b for b in final.content if b.type == "tool_use"][0].input)
    back = claude.messages.create(model=MODEL, max_tokens=4, tools=[tool], messages=[
        {"role": "user", "content": "Trip?"}, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}])
    assert back.usage.output_tokens >= 1
    response = client.responses.create(model=MODEL, input="Trip?", max_output_tokens=40, temperature=0,
                                       tools=[{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
                                       tool_choice="required")
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls[0].name == "get_weather" and _keeps_schema(json.loads(calls[0].arguments))


def test_tools_without_template_support_are_a_clear_400(plain, engine):
    with pytest.raises(openai.BadRequestError) as err:
        plain.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])
    assert err.value.body["param"] == "tools" and "template" in err.value.body["message"]
    other = _serve(engine, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}")
    try:
        client = openai.OpenAI(base_url=other.url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="format"):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])
    finally:
        other.shutdown()
        other.server_close()
