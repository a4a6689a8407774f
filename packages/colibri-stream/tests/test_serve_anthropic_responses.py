"""Anthropic's `/v1/messages` through the official `anthropic` SDK and OpenAI's `/v1/responses`
through the official `openai` SDK, against the real server: the same sessions and tokens as
`/v1/chat/completions`, streaming events, usage, stop reasons and each API's error shape."""

from __future__ import annotations

import anthropic
import openai
import pytest
from colibri_stream import Engine
from colibri_stream.serve import make_server, serve_in_thread

MODEL = "tiny-test"
SYSTEM = "Be brief."
USER = "Tell me a story."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


@pytest.fixture(scope="module")
def served(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", kernel_dtype="f32") as engine:
        server = make_server(engine, "127.0.0.1", 0, model_name=MODEL)
        serve_in_thread(server)
        root = server.url.removesuffix("/v1")
        yield (engine, openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120),
               anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0, timeout=120))
        server.shutdown()
        server.server_close()


def test_messages_reply_is_the_chat_completions_reply(served):
    engine, oai, claude = served
    want = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    got = claude.messages.create(model=MODEL, system=SYSTEM, max_tokens=10, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": USER}])
    assert got.type == "message" and got.role == "assistant" and got.id.startswith("msg_")
    assert got.content[0].type == "text" and got.content[0].text == want.choices[0].message.content
    assert got.stop_reason == ("max_tokens" if want.choices[0].finish_reason == "length" else "end_turn")
    assert got.usage.output_tokens == want.usage.completion_tokens
    # Anthropic counts the tokens read from the cache apart from those that ran
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert got.usage.cache_read_input_tokens > 0  # the chat request's pooled session held this prompt
    assert got.model_extra["colibri"]["decode_tokens"] >= 1


def test_messages_stream_events_add_up_to_the_reply(served):
    _, _, claude = served
    kwargs = dict(model=MODEL, max_tokens=12, extra_body={"temperature": 0}, messages=[{"role": "user", "content": USER}])
    full = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text and final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens
    events = [e.type for e in claude.messages.create(**kwargs, stream=True)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events.count("content_block_start") == events.count("content_block_stop") == 1
    assert "content_block_delta" in events


def test_messages_stop_sequence_is_named(served):
    _, _, claude = served
    kwargs = dict(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Go on"}])
    text = claude.messages.create(**kwargs).content[0].text
    stop = text[4:7]
    cut = claude.messages.create(**kwargs, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]


def test_messages_errors_are_anthropic_shaped(served):
    _, _, claude = served
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 1.5}, messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["error"]["type"] == "invalid_request_error" and "temperature" in err.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="text only"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.BadRequestError, match="tools"):  # ChatML: the template takes no tools
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                               tools=[{"name": "f", "input_schema": {"type": "object"}}])
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                               extra_body={"max_tokns": 5})
    assert err.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "unknown parameter 'max_tokns'"}}
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})


def test_responses_output_is_the_chat_reply_and_streams(served):
    _, oai, _ = served
    want = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    got = oai.responses.create(model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=10, temperature=0)
    assert got.output_text == want.choices[0].message.content and got.object == "response"
    assert got.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
    assert got.usage.input_tokens == want.usage.prompt_tokens and got.usage.output_tokens == want.usage.completion_tokens
    assert got.usage.input_tokens_details.cached_tokens > 0  # the pooled session held the prompt
    as_items = oai.responses.create(model=MODEL, input=[{"role": "system", "content": SYSTEM},
                                                        {"role": "user", "content": [{"type": "input_text", "text": USER}]}],
                                    max_output_tokens=10, temperature=0)
    assert as_items.output_text == got.output_text
    events = list(oai.responses.create(model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=10,
                                       temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == got.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.output_tokens == got.usage.output_tokens


def test_responses_is_stateless_and_refuses_what_it_cannot_do(served):
    _, oai, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    assert err.value.body["param"] == "previous_response_id" and "stateless" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-4o", input="Hi")
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="Hi", extra_body={"max_tokens": 5})  # chat's name, not this API's
    assert err.value.body["code"] == "unknown_parameter" and err.value.body["param"] == "max_tokens"
