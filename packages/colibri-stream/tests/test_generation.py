"""Generation: sampling, stop strings and end tokens, streaming, the chat template."""

from __future__ import annotations

import pytest
import torch
from colibri_model import load_tokenizer
from colibri_model.chat import encode_chat
from colibri_stream import Engine
from colibri_stream.generation import SamplingConfig, TextAssembler, TokenSampler


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine.open(tiny[0], ram_budget="200MB") as eng:
        yield eng


def test_stream_pieces_add_up_to_the_result(engine):
    stream = engine.stream("Once upon a time", 24, stop_token_ids=[])
    assert stream.result is None  # known once the stream is exhausted
    tokens = list(stream)
    result = stream.result
    assert "".join(t.text for t in tokens) == result.text
    assert [t.id for t in tokens if t.id is not None] == result.token_ids
    assert "".join(engine.stream_text("Once upon a time", 24, stop_token_ids=[])) == result.text
    assert len(result.token_ids) == 24 and result.finish_reason == "length"
    assert result.text == engine.tokenizer.decode(result.token_ids)


def test_the_deprecated_result_list_still_receives_the_result(engine):
    """The 0.2 series' `stream(result=[])` keeps working, with a DeprecationWarning."""
    sink: list = []
    with pytest.warns(DeprecationWarning, match="TokenStream holds the GenerationResult"):
        stream = engine.session().stream("Once upon a time", 6, stop_token_ids=[], result=sink)
    list(stream)
    assert sink == [stream.result] and len(stream.result.token_ids) == 6


def test_stop_string_cuts_the_text(engine):
    full = engine.generate("Once upon a time", 24, stop_token_ids=[])
    stop = full.text[10:14]
    cut = engine.generate("Once upon a time", 24, stop=[stop], stop_token_ids=[])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    streamed = []
    engine.generate("Once upon a time", 24, stop=[stop], stop_token_ids=[], on_text=streamed.append)
    assert "".join(streamed) == cut.text  # a partial stop string is never shown


def test_end_token_stops_generation(engine):
    first = engine.generate("Once upon a time", 1, stop_token_ids=[]).token_ids[0]
    result = engine.generate("Once upon a time", 10, stop_token_ids=[first])
    assert result.finish_reason == "eos" and result.token_ids == [] and result.text == ""


def test_sampling_is_repeatable_and_top_p_tiny_is_greedy(engine):
    a = engine.generate("Hello", 12, temperature=1.0, seed=7, stop_token_ids=[])
    b = engine.generate("Hello", 12, temperature=1.0, seed=7, stop_token_ids=[])
    greedy = engine.generate("Hello", 12, stop_token_ids=[])
    nucleus_of_one = engine.generate("Hello", 12, temperature=1.0, top_p=1e-9, seed=3, stop_token_ids=[])
    assert a.token_ids == b.token_ids
    assert nucleus_of_one.token_ids == greedy.token_ids
    assert a.token_ids != greedy.token_ids  # near-uniform random model: sampling differs


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = TokenSampler(SamplingConfig(temperature=1.0, top_p=0.75, seed=0))
    drawn = {sampler(logits) for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 + 0.3 >= 0.75: tokens 2 and 3 are outside the nucleus
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)


def test_text_assembler_holds_back_partial_stop_strings():
    tok = load_tokenizer(None)
    ids = tok.encode("Hello world. The end", add_special_tokens=False).ids
    assembler = TextAssembler(tok, stop=(". The",))
    shown = "".join(assembler.add(i) for i in ids)
    assert assembler.stopped and assembler.text == "Hello world"
    assert shown + assembler.finish() == "Hello world"


def test_chat_uses_colibri_model_template(engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = engine.chat_prompt(messages)
    assert ids == encode_chat(messages, engine.tokenizer, add_generation_prompt=True)[0]
    assert engine.tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    reply = engine.chat(messages, max_new_tokens=8)
    assert reply.prompt_tokens == len(ids) and len(reply.token_ids) <= 8


def test_context_limit_ends_with_length(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", max_context=20) as eng:
        result = eng.generate(list(range(1, 16)), 50, stop_token_ids=[])
        assert result.finish_reason == "length" and len(result.token_ids) == 6  # 15 + 5 forwards fill 20
        with pytest.raises(ValueError, match="max_context"):
            eng.logits(list(range(21)))
