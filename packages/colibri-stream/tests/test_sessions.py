"""Sessions: independent contexts on one engine, incremental append / fork / truncate, and the
thread rule (every forward pass under the engine's lock, KV cache per session)."""

from __future__ import annotations

import threading

import pytest
import torch
from colibri_stream import Engine

PROMPTS = ["Once upon a time", "The little bird sang", "Hello there", "In a land far away"]


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine.open(tiny[0], ram_budget="200MB") as eng:
        yield eng


def test_threads_on_one_engine_give_the_sequential_tokens(engine):
    """The issue-17 bug: two threads generating on one Engine shared its one KV cache and got
    wrong tokens. Each thread now runs on its own session; passes are serialised by the lock."""
    expected = {p: engine.generate(p, 20, stop_token_ids=[]).token_ids for p in PROMPTS}
    for _trial in range(3):
        got: dict[str, list[int]] = {}
        errors: list[BaseException] = []

        def work(prompt, got=got, errors=errors):
            try:
                got[prompt] = engine.generate(prompt, 20, stop_token_ids=[]).token_ids
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert got == expected


def test_threads_with_their_own_sessions_interleave_and_agree(engine):
    ids = engine.encode(PROMPTS[0])
    reference = engine.logits(ids)
    results: list[torch.Tensor] = []

    def work():
        s = engine.session()
        rows = [s.append(ids[:3], all_logits=True)] + [s.append([t], all_logits=True) for t in ids[3:]]
        results.append(torch.cat(rows).cpu())

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3
    for r in results:
        torch.testing.assert_close(r, reference, atol=1e-4, rtol=1e-4)


def test_append_is_incremental_and_matches_one_pass(engine):
    ids = engine.encode("The quick brown fox jumps over the lazy dog")
    whole = engine.logits(ids)
    s = engine.session()
    first = s.append(ids[:4], all_logits=True)
    last = s.append(ids[4:])
    assert len(s) == len(ids) and s.tokens == ids
    assert s.prefilled_tokens == len(ids)
    assert first.dtype == torch.float32 and first.shape == (4, whole.shape[1])
    torch.testing.assert_close(first.cpu(), whole[:4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(last.cpu(), whole[-1], atol=1e-4, rtol=1e-4)


def test_fork_and_truncate_are_independent(engine):
    a_ids, b_ids = engine.encode(" red apples"), engine.encode(" blue sky today")
    prefix = engine.encode("I like")
    s = engine.session()
    s.append(prefix)
    branch = s.fork()
    from_a = s.append(a_ids)
    from_b = branch.append(b_ids)
    torch.testing.assert_close(from_a.cpu(), engine.logits(prefix + a_ids)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(from_b.cpu(), engine.logits(prefix + b_ids)[-1], atol=1e-4, rtol=1e-4)
    s.truncate(len(prefix))
    assert len(s) == len(prefix) and s.tokens == prefix
    again = s.append(b_ids)  # overwrites the dropped positions
    torch.testing.assert_close(again, from_b, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="holds"):
        s.truncate(len(s) + 1)


def test_a_session_continues_where_it_stopped(engine):
    s = engine.session()
    first = s.generate("Once upon a time", 6, stop_token_ids=[])
    more = s.generate("", 6, stop_token_ids=[])
    whole = engine.generate("Once upon a time", 12, stop_token_ids=[])
    assert first.token_ids + more.token_ids == whole.token_ids


def test_context_overflow_is_a_clear_error(engine):
    s = engine.session()
    with pytest.raises(ValueError, match="max_context"):
        s.append([1] * (engine.max_context + 1))
    assert len(s) == 0
    with pytest.raises(ValueError, match="does not fit"):
        s.stream([1] * (engine.max_context + 1), 4)


def test_session_kv_grows_with_the_context(engine):
    s = engine.session()
    s.append([1] * 10)
    assert s.kv.capacity < engine.max_context  # not a whole context per session
    s.append([2] * 100)
    assert s.kv.capacity >= 110 and len(s) == 110


@pytest.fixture(scope="module")
def engine_f32(tiny):
    """f32 expert kernels, for tests that hold a padded batch equal to each row alone: torch's
    bf16 int4 kernel takes another route for a many-row batch than for one row where the CPU
    has AMX, and the two round ~5e-4 apart in the logits; in f32 they agree to ~1e-6."""
    with Engine.open(tiny[0], ram_budget="200MB", kernel_dtype="f32") as eng:
        yield eng


def test_a_padded_batch_gives_each_prompt_its_own_result(engine_f32):
    engine = engine_f32
    prompts = ["Once upon a time", "Hi", "The little bird sang a song today"]
    single = [engine.generate(p, 10, stop_token_ids=[]) for p in prompts]
    before = engine.stats.prefill_tokens
    batch = engine.generate(prompts, 10, stop_token_ids=[])
    assert engine.stats.prefill_tokens - before == sum(r.prompt_tokens for r in single)  # padding not counted
    assert [r.token_ids for r in batch] == [r.token_ids for r in single]
    assert [r.prompt_tokens for r in batch] == [r.prompt_tokens for r in single]
    # the padded rows' logits are those of each prompt alone
    from colibri_stream.session import prefill_batch

    ids = [engine.encode(p) for p in prompts]
    for session, row in zip(prefill_batch(engine.runner, engine.codec, ids), ids):
        torch.testing.assert_close(session.last_logits().cpu(), engine.logits(row)[-1], atol=1e-4, rtol=1e-4)
        assert session.tokens == row and len(session) == len(row)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[], [1, 2]], 2)


def test_a_padded_batch_under_bf16_kernels_agrees_to_bf16_rounding(engine):
    """The serving default (bf16 expert kernels): each padded row within bf16's rounding of the
    prompt alone (a leak of padding or of another row moves logits by far more)."""
    from colibri_stream.session import prefill_batch

    ids = [engine.encode(p) for p in ["Once upon a time", "Hi", "The little bird sang a song today"]]
    for session, row in zip(prefill_batch(engine.runner, engine.codec, ids), ids):
        torch.testing.assert_close(session.last_logits().cpu(), engine.logits(row)[-1], atol=1e-2, rtol=1e-2)


def test_a_batch_prefill_is_chunked_by_the_workspace(tiny, engine):
    prompts = ["Once upon a time", "The little bird sang a song today"]
    with Engine.open(tiny[0], ram_budget="200MB", prefill_chunk=4) as small:
        steps = small.stats.steps
        sessions = small.generate(prompts, 3, stop_token_ids=[])
        assert small.stats.steps - steps >= len(small.encode(prompts[1])) // 2  # 2 columns per pass
    assert [r.token_ids for r in sessions] == [engine.generate(p, 3, stop_token_ids=[]).token_ids for p in prompts]


def test_branch_logits_score_continuations_in_one_batch(engine):
    s = engine.session()
    context = engine.encode("The weather today is")
    s.append(context)
    branches = [engine.encode(" sunny and warm"), engine.encode(" cold"), engine.encode(" a mystery to all of us")]
    got = s.branch_logits(branches)
    assert len(s) == len(context) and s.tokens == context  # the session is unchanged
    for logits, branch in zip(got, branches):
        want = engine.logits(context + branch)[len(context):]
        torch.testing.assert_close(logits.cpu(), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="at least one token"):
        s.branch_logits([[]])


def test_branch_logits_can_skip_the_leading_positions(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", prefill_chunk=4) as eng:  # skip spans whole chunks too
        rows = [eng.encode("The weather today is sunny and warm"), eng.encode("Once upon a time there was a bird")]
        full = eng.session().branch_logits(rows)
        for skip in (1, 5, 6):
            cut = eng.session().branch_logits(rows, skip=skip)
            for a, b in zip(cut, full):
                torch.testing.assert_close(a, b[skip:], atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="skip"):
            eng.session().branch_logits(rows, skip=min(len(r) for r in rows))
