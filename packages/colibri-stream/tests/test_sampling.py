"""Each sampler against a reference computed by hand (plain Python on given logits), and the
logprobs reported with a stream."""

from __future__ import annotations

import math

import pytest
import torch
from colibri_stream import Engine
from colibri_stream.sampling import SamplingConfig, TokenSampler, token_logprobs

LOGITS = [2.0, 1.5, 0.3, -0.2, -1.0, 0.9]


def softmax(xs):
    finite = [x for x in xs if x != -math.inf]
    m = max(finite)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0, context=()):
    xs = list(logits)
    for t in set(context):  # transformers' RepetitionPenaltyLogitsProcessor
        xs[t] = xs[t] / penalty if xs[t] > 0 else xs[t] * penalty
    xs = [x / temperature for x in xs]
    if top_k:
        kth = sorted(xs, reverse=True)[top_k - 1]
        xs = [x if x >= kth else -math.inf for x in xs]
    if top_p < 1:
        p = softmax(xs)
        order = sorted(range(len(xs)), key=lambda i: -p[i])
        mass = 0.0
        for i in order:
            if mass >= top_p:
                xs[i] = -math.inf
            mass += p[i]
    if min_p:
        p = softmax(xs)
        xs = [x if p[i] >= min_p * max(p) else -math.inf for i, x in enumerate(xs)]
    return softmax(xs)


CASES = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=1.0, repetition_penalty=2.0, context=(0, 4, 4)),
    dict(temperature=0.9, top_k=4, top_p=0.9, min_p=0.1, repetition_penalty=1.5, context=(1, 3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_distribution_matches_the_reference(case):
    case = dict(case)
    context = case.pop("context", ())
    penalty = case.get("repetition_penalty", 1.0)
    config = SamplingConfig(seed=0, **case)
    got = TokenSampler(config).distribution(torch.tensor(LOGITS), context).tolist()
    want = reference(LOGITS, case["temperature"], case.get("top_k", 0), case.get("top_p", 1.0),
                     case.get("min_p", 0.0), penalty, context)
    assert got == pytest.approx(want, abs=1e-6)


def test_draws_follow_the_distribution_and_the_seed():
    config = SamplingConfig(temperature=1.0, top_k=3, seed=11)
    draws = [TokenSampler(config)(torch.tensor(LOGITS)) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same first draw
    sampler = TokenSampler(config)
    counts = [0] * len(LOGITS)
    for _ in range(4000):
        counts[sampler(torch.tensor(LOGITS))] += 1
    want = reference(LOGITS, top_k=3)
    for i, p in enumerate(want):
        assert counts[i] / 4000 == pytest.approx(p, abs=0.03)
    assert counts[3] == counts[4] == 0


def test_greedy_with_a_repetition_penalty_avoids_the_seen_token():
    sampler = TokenSampler(SamplingConfig(repetition_penalty=2.0))
    assert sampler(torch.tensor(LOGITS)) == 0
    assert sampler(torch.tensor(LOGITS), context=[0]) == 1  # 2.0 / 2 = 1.0 < 1.5


@pytest.mark.parametrize("bad, match", [(dict(top_k=-1), "top_k"), (dict(top_k=1.5), "top_k"),
                                        (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0), "repetition"),
                                        (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p")])
def test_bad_settings_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**bad)


def test_token_logprobs_are_the_raw_log_softmax():
    logits = torch.tensor(LOGITS)
    logprob, top = token_logprobs(logits, 2, top_n=2)
    want = [math.log(p) for p in softmax(LOGITS)]
    assert logprob == pytest.approx(want[2], abs=1e-6)
    assert [i for i, _ in top] == [0, 1] and top[0][1] == pytest.approx(want[0], abs=1e-6)


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine.open(tiny[0], ram_budget="200MB") as eng:
        yield eng


def test_stream_reports_ids_text_and_logprobs(engine):
    ids = engine.encode("Once upon a time")
    tokens = list(engine.stream(ids, 5, stop_token_ids=[], logprobs=3))
    assert [t.id for t in tokens][:5] == engine.generate(ids, 5, stop_token_ids=[]).token_ids
    # the first token's logprob is the prompt's last-position log-softmax (greedy: the top one)
    logp = torch.log_softmax(engine.logits(ids)[-1], dim=-1)
    assert tokens[0].logprob == pytest.approx(float(logp.max()), abs=1e-4)
    assert tokens[0].top_logprobs[0][0] == tokens[0].id and len(tokens[0].top_logprobs) == 3
    sampled = engine.generate(ids, 8, temperature=0.8, top_k=20, min_p=0.05, repetition_penalty=1.3, seed=5,
                              stop_token_ids=[])
    again = engine.generate(ids, 8, temperature=0.8, top_k=20, min_p=0.05, repetition_penalty=1.3, seed=5,
                            stop_token_ids=[])
    assert sampled.token_ids == again.token_ids and len(sampled.logprobs) == 8
    with pytest.raises(ValueError, match="logprobs"):
        engine.stream(ids, 2, logprobs=-1)
