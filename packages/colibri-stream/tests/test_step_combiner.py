"""Continuous batching of sessions (step_combiner.py): sessions generating on several threads at
once have their decode steps run as one [B, 1] pass, and each row gets what it gets alone: the
same bits with the native kernels, the same tokens (logprobs to float rounding) with torch's, for
plain, sliding-window-with-sinks and latent (MLA) attention. Plus the combiner's own rules: a pass
that fails fails every row it held and the next steps run; a generating session that is slow to
ask for its next token holds the others up by at most `gather_s` per step; no pass holds more rows
than a prefill chunk."""

from __future__ import annotations

import threading

import pytest
import torch
from colibri_int4 import QuantScheme
from colibri_model import ColibriConfig
from colibri_stream import Engine
from colibri_stream.compute.native_kernel import kernel_unavailable
from colibri_stream.studies.synthetic_container import export_random_model

from .conftest import TINY, build_container

JOIN_S = 120  # a deadlock fails the test instead of hanging the suite
PROMPTS = [[5 + i, 17, 33 + i, 9, 81] * (i + 1) for i in range(4)]  # 5, 10, 15, 20 tokens: ragged rows


def _generate(engine, prompt, tokens=24, **kwargs):
    stream = engine.session().stream(prompt, tokens, logprobs=2, **kwargs)
    return [(t.id, t.logprob, t.top_logprobs) for t in stream]


def _ids(generated) -> list[int]:
    return [t[0] for t in generated]


def _concurrently(engine, prompts, errors_out: list | None = None, **kwargs):
    """Each prompt generated on its own thread, all started together; a thread's error is raised,
    or appended to `errors_out` when given (None in the results for that prompt)."""
    got: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def worker(i, prompt):
        try:
            start.wait(timeout=JOIN_S)
            got[i] = _generate(engine, prompt, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=JOIN_S)
    assert not any(t.is_alive() for t in threads), "a generating thread is stuck"
    if errors_out is not None:
        errors_out += errors
    elif errors:
        raise errors[0]
    return [got.get(i) for i in range(len(prompts))]


def _alone_and_together(engine, prompts=PROMPTS, **kwargs):
    engine.runner.batch_sessions = False
    alone = [_generate(engine, p, **kwargs) for p in prompts]
    engine.runner.batch_sessions = True
    combiner = engine.runner.combiner
    combiner.gather_s = 30.0  # every generating session joins every step: full batches, whatever the load
    before = (combiner.passes, combiner.rows)
    together = _concurrently(engine, prompts, **kwargs)
    passes, rows = combiner.passes - before[0], combiner.rows - before[1]
    return alone, together, passes, rows


@pytest.mark.skipif(kernel_unavailable() is not None, reason="no C compiler for the native kernel")
def test_combined_steps_give_each_session_the_bits_it_gets_alone(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", compute="native") as engine:
        alone, together, passes, rows = _alone_and_together(engine)
        sampled = _alone_and_together(engine, temperature=0.9, top_k=20, seed=3)
    assert together == alone  # ids, logprobs and top logprobs, bit for bit
    assert sampled[1] == sampled[0]
    # 4 sessions, 23 decode steps each, all through combined passes; they share passes once all four
    # generate (a session still in its prefill, which runs alone, joins the batch at its first step)
    assert rows == 4 * 23 and passes < rows


@pytest.mark.skipif(kernel_unavailable() is not None, reason="no C compiler for the native kernel")
@pytest.mark.parametrize("top_k", [1, 2])
def test_a_native_moe_layer_gives_each_of_a_few_rows_what_it_gives_the_row_alone(tiny, top_k):
    """The layers of a combined step taken one by one: norm, router (row-wise) and routed experts
    (a few tokens' grouped kernel calls) on 5 rows equal each row run alone, bit for bit."""
    torch.manual_seed(0)
    with Engine.open(tiny[0], ram_budget="200MB", compute="native", top_k=top_k) as engine:
        block = next(b for b in engine.model.layers if b.is_moe)
        x = torch.randn(5, 1, engine.config.d_model)
        with torch.inference_mode():
            for layer in (block.ffn_norm, block.moe):
                together = layer(x)
                alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
                assert torch.equal(together, alone), type(layer).__name__
            ids = block.moe.router(x.view(5, -1), top_k)[0]
        assert len(torch.unique(ids)) > top_k  # the rows share some experts, not all: a real union


@pytest.mark.parametrize("compute", ["int4", "dequant"])
def test_combined_steps_with_torch_kernels_agree_to_rounding(tiny, compute):
    with Engine.open(tiny[0], ram_budget="200MB", compute=compute, kernel_dtype="f32") as engine:
        alone, together, passes, rows = _alone_and_together(engine)
    assert rows > passes  # rows did share passes
    for a, b in zip(alone, together, strict=True):
        assert [t[0] for t in a] == [t[0] for t in b]
        assert max(abs(x[1] - y[1]) for x, y in zip(a, b)) < 1e-4


GPT_OSS = dict(TINY, name="combined-window", qk_norm=False, qkv_bias=True, o_bias=True, attn_sinks=True,
               sliding_window=6, sliding_layers=(0, 2), router_score="softmax", selection_bias=False, router_bias=True,
               expert_proj_bias=True, expert_glu="clamped_swiglu", glu_limit=7.0, shared_expert_dim=0, top_k_infer=2,
               vocab_size=256)
MLA = dict(TINY, name="combined-mla", attention_kind="mla", qk_norm=False, n_kv_heads=2, kv_lora_rank=32,
           qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=32, q_lora_rank=None, rope_interleave=True,
           vocab_size=256)


@pytest.mark.parametrize("variant", [GPT_OSS, MLA], ids=["sliding-window-sinks", "mla"])
def test_every_attention_kind_runs_its_rows_against_their_own_caches(tmp_path, variant):
    container = export_random_model(tmp_path, ColibriConfig(**variant), bias_std=0.5)
    prompts = [[(7 * i + j) % 256 for j in range(4 + 5 * i)] for i in range(3)]  # past the window of 6
    with Engine.open(container, ram_budget="200MB", compute="dequant", prefill_chunk=4) as engine:
        alone, together, passes, rows = _alone_and_together(engine, prompts, tokens=16)
    assert rows > passes
    for a, b in zip(alone, together, strict=True):
        assert [t[0] for t in a] == [t[0] for t in b]
        assert max(abs(x[1] - y[1]) for x, y in zip(a, b)) < 1e-4


def test_a_failed_pass_fails_every_row_it_held_and_the_next_steps_run(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", compute="dequant") as engine:
        runner = engine.runner
        runner.combiner.gather_s = 30.0
        forward, calls = runner.forward, []

        def failing_once(ids, kv, *args, **kwargs):
            if ids.shape[0] > 1 and not calls:
                calls.append(ids.shape[0])
                raise OSError("injected: an expert read failed")
            return forward(ids, kv, *args, **kwargs)

        runner.forward = failing_once
        errors: list[BaseException] = []
        _concurrently(engine, PROMPTS[:3], errors)
        # one pass held two or three rows (a session still in its prefill joins later) and failed each
        assert len(calls) == 1 and calls[0] in (2, 3)
        assert len(errors) == calls[0] and all("injected" in str(e) for e in errors)
        runner.forward = forward
        after = _concurrently(engine, PROMPTS[:3])
        runner.batch_sessions = False
        assert [_ids(r) for r in after] == [_ids(_generate(engine, p)) for p in PROMPTS[:3]]


def test_a_slow_generating_session_holds_the_others_up_by_at_most_the_gather_wait(tiny):
    """One session takes a token and then waits (still generating) until the other has finished
    all of its tokens: the other must not wait for it beyond `gather_s` per step."""
    with Engine.open(tiny[0], ram_budget="200MB", compute="dequant") as engine:
        engine.runner.combiner.gather_s = 0.005
        fast_done = threading.Event()
        results: dict[str, object] = {}

        def slow():
            stream = engine.session().stream(PROMPTS[0], 8)
            results["slow_first"] = next(stream).id
            fast_done.wait(timeout=JOIN_S)  # inside its decode loop: it counts as generating
            results["slow"] = [results["slow_first"]] + [t.id for t in stream]

        def fast():
            results["fast"] = [t.id for t in engine.session().stream(PROMPTS[1], 24)]
            fast_done.set()

        threads = [threading.Thread(target=slow), threading.Thread(target=fast)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=JOIN_S)
        assert not any(t.is_alive() for t in threads)
        engine.runner.batch_sessions = False
        assert results["fast"] == [t[0] for t in _generate(engine, PROMPTS[1])]
        assert results["slow"] == [t[0] for t in _generate(engine, PROMPTS[0], tokens=8)]


def test_no_pass_holds_more_rows_than_a_prefill_chunk(tmp_path):
    container, _ = build_container(tmp_path, QuantScheme(group_size=32, resident_dtype="int8"))
    with Engine.open(container, ram_budget="200MB", compute="dequant", prefill_chunk=2) as engine:
        combiner = engine.runner.combiner
        combiner.gather_s = 30.0
        sizes: list[int] = []
        run_rows = combiner.run_rows

        def recording(caches, tokens):
            sizes.append(len(caches))
            return run_rows(caches, tokens)

        combiner.run_rows = recording
        prompts = [p[:5] for p in PROMPTS] + [PROMPTS[0][:5]]
        together = _concurrently(engine, prompts)
        engine.runner.batch_sessions = False
        assert [_ids(r) for r in together] == [_ids(_generate(engine, p)) for p in prompts]
    assert max(sizes) == 2 and sum(sizes) == 5 * 23


def test_a_long_prefill_lets_generating_sessions_through_between_its_chunks(tiny):
    """A session generating while another reads a 64-token prompt in chunks of 4: the generating
    session's decode steps run between the prompt's chunks (not after all 16), and both get what
    they get alone."""
    prompt = [(11 * i) % 200 + 3 for i in range(64)]
    with Engine.open(tiny[0], ram_budget="200MB", compute="dequant", prefill_chunk=4) as engine:
        runner, order = engine.runner, []
        forward = runner.forward

        def recording(ids, kv, *args, **kwargs):
            order.append((ids.shape[1], kv))
            return forward(ids, kv, *args, **kwargs)

        runner.batch_sessions = False
        alone = (_generate(engine, PROMPTS[0], tokens=40), engine.session().append(prompt))
        runner.batch_sessions = True
        runner.forward = recording
        generating = threading.Event()
        got: dict[str, object] = {}

        def stream():
            tokens = []
            for t in engine.session().stream(PROMPTS[0], 40, logprobs=2):
                tokens.append((t.id, t.logprob, t.top_logprobs))
                if len(tokens) == 2:
                    generating.set()
            got["stream"] = tokens

        def long_prompt():
            generating.wait(timeout=JOIN_S)
            got["logits"] = engine.session().append(prompt)

        threads = [threading.Thread(target=stream), threading.Thread(target=long_prompt)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=JOIN_S)
        assert not any(t.is_alive() for t in threads)
    long_kv = next(kv for tokens, kv in order if sum(1 for t, k in order if k is kv) == 16)
    chunks = [i for i, (_, kv) in enumerate(order) if kv is long_kv]
    between = [tokens for tokens, kv in order[chunks[0] : chunks[-1]] if kv is not long_kv]
    assert between and all(t == 1 for t in between)  # the stream got tokens while the prompt was read
    assert _ids(got["stream"]) == _ids(alone[0])
    assert max(abs(x[1] - y[1]) for x, y in zip(got["stream"], alone[0])) < 1e-4
    torch.testing.assert_close(got["logits"], alone[1], atol=1e-4, rtol=1e-4)
