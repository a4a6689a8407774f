"""A batch of prompts decoded together (batch_decode.py): one [B, 1] pass per step for every row
still going, each row at its own position with its padding masked, gives each prompt what it
gets alone (greedy: the same ids; seeded sampling: the same draws), with its own stop rules; a
step reads each distinct expert once for the batch."""

from __future__ import annotations

import pytest
import torch
from colibri_stream import Engine

PROMPTS = ["Once upon a time", "Hi", "The little bird sang a song today", "In a land far away"]


def _alone(engine, prompts, steps, **kwargs):
    return [engine.generate(p, steps, **kwargs) for p in prompts]


@pytest.mark.parametrize("budget", ["full", "minimum"])
def test_greedy_rows_are_the_prompts_alone_at_full_and_small_budget(tiny, minimum_budget, budget):
    ram = "200MB" if budget == "full" else minimum_budget(tiny[0])
    with Engine.open(tiny[0], ram_budget=ram) as eng:
        single = _alone(eng, PROMPTS, 12, stop_token_ids=[])
        steps, decoded = eng.stats.steps, eng.stats.decode_tokens
        batch = eng.generate(PROMPTS, 12, stop_token_ids=[])
        assert [r.token_ids for r in batch] == [r.token_ids for r in single]
        assert [r.text for r in batch] == [r.text for r in single]
        assert all(r.finish_reason == "length" and r.prompt_tokens == len(eng.encode(p)) for r, p in zip(batch, PROMPTS))
        # one pass per step for the whole batch (11 decode steps after the prefill's first token),
        # decode tokens counted per real token
        assert eng.stats.decode_tokens - decoded == len(PROMPTS) * 11
        assert eng.stats.steps - steps == 1 + 11
        if budget == "minimum":
            assert eng.stats.to_dict()["misses"] > eng.budget.slots  # it really streamed


def test_seeded_sampling_draws_what_each_prompt_draws_alone(engine):
    options = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3, seed=7,
                   stop_token_ids=[], logprobs=2)
    single = _alone(engine, PROMPTS, 10, **options)
    batch = engine.generate(PROMPTS, 10, **options)
    assert [r.token_ids for r in batch] == [r.token_ids for r in single]
    for a, b in zip(batch, single):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
        assert [[i for i, _ in t.top_logprobs] for t in a.tokens] == [[i for i, _ in t.top_logprobs] for t in b.tokens]
    unseeded = engine.generate(PROMPTS[:1] * 2, 10, temperature=1.0, stop_token_ids=[])
    assert len(unseeded) == 2  # two rows of one prompt: each its own RNG (from OS entropy)


def test_rows_stop_on_their_own_end_ids_stop_strings_and_lengths(engine):
    greedy = _alone(engine, PROMPTS, 12, stop_token_ids=[])
    end = greedy[1].token_ids[3]  # row 1 ends at its 4th token (others may meet it too: so be it)
    stop = greedy[2].text[len(greedy[2].text) // 2 :][:3]  # a stop string inside row 2's text
    options = dict(stop_token_ids=[end], stop=[stop])
    single = _alone(engine, PROMPTS, 12, **options)
    batch = engine.generate(PROMPTS, 12, **options)
    assert single[1].finish_reason == "eos" and single[2].finish_reason == "stop"
    for a, b in zip(batch, single):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert [(t.id, t.text) for t in a.tokens] == [(t.id, t.text) for t in b.tokens]
    assert engine.generate(PROMPTS, 0)[0].token_ids == []  # max_new_tokens 0: nothing runs


def test_rows_meet_the_context_end_alone(tiny):
    long = "The little bird sang a song today and then it flew"
    with Engine.open(tiny[0], ram_budget="200MB", max_context=20) as eng:
        prompts = [long, "Hi", "Once upon a time"]
        assert 8 < len(eng.encode(long)) < 20
        single = _alone(eng, prompts, 30, stop_token_ids=[])
        batch = eng.generate(prompts, 30, stop_token_ids=[])
        assert [r.token_ids for r in batch] == [r.token_ids for r in single]
        assert len(batch[0].token_ids) == 20 - len(eng.encode(long)) + 1  # the last one is deferred


def test_more_prompts_than_a_pass_holds_run_as_several_batches(tiny, engine):
    prompts = PROMPTS + ["Hello there", "A cat"]
    with Engine.open(tiny[0], ram_budget="200MB", prefill_chunk=4) as small:
        batch = small.generate(prompts, 5, stop_token_ids=[])
    assert [r.token_ids for r in batch] == [r.token_ids for r in _alone(engine, prompts, 5, stop_token_ids=[])]


def test_a_decode_step_reads_each_distinct_expert_once_for_the_batch(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", record_trace=True) as eng:
        moe_layers = eng.config.n_layers - eng.config.n_dense_layers
        eng.generate(PROMPTS, 6, stop_token_ids=[])
        decode_steps = [e for e in eng.stats.trace if e.step > 1]  # step 1 is the prefill
        assert len(decode_steps) == 5 * moe_layers  # one routing event per layer per step, not per row
        assert any(len(e.experts) > 1 for e in decode_steps)  # rows routed apart, fetched together
        assert all(list(e.experts) == sorted(set(e.experts)) for e in decode_steps)


def test_a_batch_and_a_session_on_two_threads_keep_their_own_tokens(engine):
    import threading

    want_batch = [r.token_ids for r in engine.generate(PROMPTS, 10, stop_token_ids=[])]
    want_single = engine.generate("Hello there", 20, stop_token_ids=[]).token_ids
    got = {}
    threads = [threading.Thread(target=lambda: got.update(batch=[r.token_ids for r in engine.generate(
                   PROMPTS, 10, stop_token_ids=[])])),
               threading.Thread(target=lambda: got.update(single=engine.generate(
                   "Hello there", 20, stop_token_ids=[]).token_ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {"batch": want_batch, "single": want_single}  # passes interleave; caches are their own


def test_bad_batch_input_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[], [1, 2]], 2)
    with pytest.raises(ValueError, match="on_text is for one prompt"):
        engine.generate(PROMPTS, 2, on_text=print)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(PROMPTS, 2, temperature=-1)
    with pytest.raises(TypeError):
        engine.generate(PROMPTS, 2, beam_width=4)
    with pytest.raises(ValueError, match="max_context"):
        engine.generate(["Hi", [5] * (engine.max_context + 1)], 2)


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine.open(tiny[0], ram_budget="200MB") as eng:
        yield eng
