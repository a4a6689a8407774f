"""`/v1/embeddings` through the official `openai` client against the real server: each input's
embedding is colibri-model's last hidden state (the final norm's output, on the same dequantized
weights) averaged over its tokens and L2-normalised, in both encodings (the client's default,
base64, and float), for strings, token ids and lists of them; `--embedding-pooling last`; what it
refuses, by name."""

from __future__ import annotations

import openai
import pytest
import torch
from colibri_stream import Engine
from colibri_stream.serve import make_server, serve_in_thread

MODEL = "tiny-test"


@pytest.fixture(scope="module")
def served(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", compute="dequant", prefill_chunk=8) as engine:
        servers = [make_server(engine, "127.0.0.1", 0, model_name=MODEL, embedding_pooling=p) for p in ("mean", "last")]
        for server in servers:
            serve_in_thread(server)
        yield engine, [openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=120) for s in servers]
        for server in servers:
            server.shutdown()
            server.server_close()


@torch.inference_mode()
def _hidden(reference, ids: list[int]) -> torch.Tensor:
    """colibri-model's final-norm output [T, d], without a cache."""
    captured = []
    hook = reference.norm.register_forward_hook(lambda module, args, output: captured.append(output[0]))
    try:
        reference(torch.tensor([ids]))
    finally:
        hook.remove()
    return captured[0].float()


def test_embeddings_are_the_models_mean_pooled_last_hidden_state(served, reference):
    engine, (client, _) = served
    texts = ["The sky is blue.", "A much longer sentence, so that the prompt runs in several prefill chunks of eight."]
    got = client.embeddings.create(model=MODEL, input=texts)  # base64 on the wire: the client's default
    as_float = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(engine.encode(t)) for t in texts)
    for text, item, plain in zip(texts, got.data, as_float.data, strict=True):
        ids = engine.encode(text)
        expected = torch.nn.functional.normalize(_hidden(reference, ids).mean(0), dim=0)
        vector = torch.tensor(item.embedding)
        assert vector.shape == (engine.config.d_model,)
        assert torch.equal(vector, torch.tensor(plain.embedding))  # the two encodings carry the same floats
        torch.testing.assert_close(vector, expected, atol=1e-5, rtol=1e-4)
        assert abs(float(vector.norm()) - 1.0) < 1e-5
    # token ids in, and a list of them
    ids = engine.encode(texts[0])
    by_ids = client.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float")
    assert torch.equal(torch.tensor(by_ids.data[0].embedding), torch.tensor(as_float.data[0].embedding))
    assert len(by_ids.data) == 2


def test_last_token_pooling_takes_the_last_hidden_state(served, reference):
    engine, (_, last) = served
    ids = engine.encode("Rivers run to the sea.")
    got = torch.tensor(last.embeddings.create(model=MODEL, input=ids, encoding_format="float").data[0].embedding)
    torch.testing.assert_close(got, torch.nn.functional.normalize(_hidden(reference, ids)[-1], dim=0),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("body", "field"), [
    ({"input": ""}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "hi", "dimensions": 7}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "pooling": "cls"}, "pooling"),
    ({}, "input"),
])
def test_what_embeddings_refuse_is_a_400_naming_the_field(served, body, field):
    _, (client, _) = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/embeddings", body={"model": MODEL, **body}, cast_to=object)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == field, caught.value.body


def test_an_input_past_the_context_is_context_length_exceeded(served):
    engine, (client, _) = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input=[1] * (engine.max_context + 1))
    assert caught.value.code == "context_length_exceeded"
