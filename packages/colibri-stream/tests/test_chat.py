"""Chat: the chat template (the container's Jinja one, else ChatML), a chat session keeping its KV
cache across turns (only new tokens prefilled), and the context-overflow policy."""

from __future__ import annotations

import pytest
from colibri_stream import ChatTemplate, ChatTemplateError, ContextOverflowError, Engine

CHATML_JINJA = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TURNS = ["Hello, who are you?", "Tell me about birds.", "And about the sea?"]


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine.open(tiny[0], ram_budget="200MB") as eng:
        yield eng


def test_a_jinja_template_renders_like_chatml(engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    jinja = ChatTemplate(engine.tokenizer, CHATML_JINJA)
    assert jinja.name == "container" and engine.chat_template.name == "chatml"  # the test container has none
    assert jinja.encode(messages) == engine.chat_prompt(messages)
    assert jinja.render(messages).endswith("<|im_start|>assistant\n")


def test_template_errors_are_clear(engine):
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        ChatTemplate(engine.tokenizer, "{% for m in messages %}")
    refusing = ChatTemplate(engine.tokenizer, "{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        refusing.encode([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="role"):
        engine.chat_prompt([{"role": "wizard", "content": "x"}])


def test_a_chat_session_prefills_only_the_new_tokens(engine):
    chat = engine.chat_session()
    messages, prefilled, prompts = [], [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        before = engine.stats.prefill_tokens
        reply = chat.reply(messages, 12, stop_token_ids=[])
        prefilled.append(engine.stats.prefill_tokens - before)
        assert reply.prefilled_tokens == prefilled[-1]
        prompts.append(reply.prompt_tokens)
        # the reused cache gives what a fresh run of the whole history gives
        assert reply.token_ids == engine.chat(messages, 12, stop_token_ids=[]).token_ids
        messages.append({"role": "assistant", "content": reply.text})
    assert prefilled[0] == prompts[0]
    for n in (1, 2):
        new_tokens = prompts[n] - prompts[n - 1]  # the reply and the new user turn
        assert prefilled[n] <= new_tokens + 1, (prefilled, prompts)  # not the whole history again
        assert prompts[n] - prefilled[n] >= prompts[n - 1]  # the whole previous prompt came from the cache


def test_overflow_drops_the_oldest_turns_after_the_system_prompt(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", max_context=64) as eng:
        chat = eng.chat_session()
        messages = [{"role": "system", "content": "You are a bird."}]
        for i in range(6):
            messages += [{"role": "user", "content": f"Question number {i} about the sky?"},
                         {"role": "assistant", "content": f"Answer {i}: blue."}]
        messages.append({"role": "user", "content": "Last one?"})
        reply = chat.reply(messages, 8, stop_token_ids=[])
        assert chat.dropped_messages > 0 and reply.prompt_tokens + 8 <= 64
        assert len(reply.token_ids) == 8
        kept = messages[:1] + messages[1 + chat.dropped_messages:]
        assert chat.session.tokens[: reply.prompt_tokens] == eng.chat_prompt(kept)
        with pytest.raises(ContextOverflowError, match="does not fit the context"):
            chat.reply(messages[:1] + [{"role": "user", "content": "word " * 80}], 8)
