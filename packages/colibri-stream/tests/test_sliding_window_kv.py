"""A session's KV cache keeps only the window on sliding-window layers (GPT-OSS): window 6 and
prefill chunks of 4 on layers 0 and 2 of a GPT-OSS-shaped container (sinks, biases, clamped
experts), so a 60-token context drops columns many times over. Every number is held against
colibri-model's full forward over the whole sequence, no cache, on the same dequantized weights,
in f32: prefill and decode, truncate inside and beyond what the window keeps, fork, branch
logits and a batch prefill's rows."""

from __future__ import annotations

import pytest
import torch
from colibri_int4 import dequantize_container
from colibri_model import ColibriConfig, load_checkpoint
from colibri_stream import Engine
from colibri_stream.session_kv import windowed_positions
from colibri_stream.studies.synthetic_container import export_random_model

WINDOW, CHUNK = 6, 4
GPT_OSS = dict(name="gpt-oss-window", d_model=64, n_layers=4, n_dense_layers=1, n_heads=2, n_kv_heads=1, head_dim=32,
               dense_ffn_dim=128, n_experts=16, expert_dim=64, max_seq_len=256, top_k_train=2, top_k_infer=2,
               vocab_size=256, qk_norm=False, qkv_bias=True, o_bias=True, attn_sinks=True, sliding_window=WINDOW,
               sliding_layers=(0, 2), router_score="softmax", selection_bias=False, router_bias=True,
               expert_proj_bias=True, expert_glu="clamped_swiglu", glu_limit=7.0, shared_expert_dim=0)
IDS = torch.Generator().manual_seed(5)
TOKENS = torch.randint(0, 256, (60,), generator=IDS).tolist()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(container, full-forward reference model) with random biases and sinks."""
    directory = tmp_path_factory.mktemp("gpt_oss_window")
    container = export_random_model(directory, ColibriConfig(**GPT_OSS), bias_std=0.5)
    return container, load_checkpoint(dequantize_container(container, directory / "dequantized")).eval()


@pytest.fixture()
def engine(gpt_oss):
    with Engine.open(gpt_oss[0], ram_budget="200MB", dtype="f32", compute="dequant", prefill_chunk=CHUNK) as eng:
        yield eng


@torch.inference_mode()
def _reference(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


def test_prefill_and_decode_match_the_full_forward_and_the_sliding_layers_stay_small(engine, gpt_oss):
    expected = _reference(gpt_oss[1], TOKENS)
    session = engine.session()
    got = [session.append(TOKENS[:22], all_logits=True)]
    got += [session.append([t], all_logits=True) for t in TOKENS[22:]]
    _close(torch.cat(got), expected)
    kv, limit = session.kv, windowed_positions(WINDOW, CHUNK)
    assert kv.first[0] > 0 and kv.first[2] > 0 and kv.first[1] == kv.first[3] == 0
    assert kv.keys[0].shape[2] <= limit == 13 and kv.keys[2].shape[2] <= limit
    assert kv.keys[1].shape[2] >= 60  # full layers keep every position
    width = 1 * (32 + 32) * 4  # one KV head of 32 keys + 32 values, f32
    assert kv.nbytes == (kv.keys[1].shape[2] * 2 + limit * 2) * width


def test_truncate_within_the_slack_keeps_the_cache_and_beyond_it_reruns_the_tokens(engine, gpt_oss):
    expected = _reference(gpt_oss[1], TOKENS)
    session = engine.session()
    session.append(TOKENS)
    kv, prefilled = session.kv, session.prefilled_tokens
    session.truncate(57)  # 3 back: inside the prefill chunk of slack
    _close(session.append(TOKENS[57:59], all_logits=True), expected[57:59])
    assert session.kv is kv and session.prefilled_tokens == prefilled + 2
    session.truncate(30)  # the sliding layers dropped the keys position 30 would see
    assert len(session) == 30 and session.tokens == TOKENS[:30]
    _close(session.append(TOKENS[30:34], all_logits=True), expected[30:34])
    assert session.kv is not kv and session.prefilled_tokens == prefilled + 2 + 30 + 4  # the kept 30 ran again
    _close(session.last_logits(), expected[33])


def test_fork_and_branch_logits_of_a_windowed_context(engine, gpt_oss):
    session = engine.session()
    session.append(TOKENS[:40])
    continuations = [TOKENS[40:47], TOKENS[50:53], TOKENS[44:45]]
    branches = session.branch_logits(continuations)
    fork = session.fork()
    fork_logits = fork.append(continuations[0], all_logits=True)
    for continuation, logits in zip(continuations, branches, strict=True):
        _close(logits, _reference(gpt_oss[1], TOKENS[:40] + continuation)[40:])
    _close(fork_logits, branches[0])
    _close(session.append(TOKENS[40:42], all_logits=True), _reference(gpt_oss[1], TOKENS[:42])[40:])


def test_a_batch_prefills_rows_into_windowed_sessions(engine, gpt_oss):
    from colibri_stream.session import prefill_batch

    prompts = [TOKENS[:31], TOKENS[5:14], TOKENS[20:45]]
    for prompt, session in zip(prompts, prefill_batch(engine.runner, engine.codec, prompts), strict=True):
        expected = _reference(gpt_oss[1], prompt + TOKENS[:5])
        _close(session.last_logits(), expected[len(prompt) - 1])
        _close(session.append(TOKENS[:5], all_logits=True), expected[len(prompt):])
        assert session.kv.keys[0].shape[2] <= windowed_positions(WINDOW, CHUNK)


def test_greedy_generation_equals_the_full_forwards_argmax(engine, gpt_oss):
    result = engine.generate(TOKENS[:9], 30, stop_token_ids=[])
    ids = TOKENS[:9]
    for _ in range(30):
        ids.append(int(_reference(gpt_oss[1], ids)[-1].argmax()))
    assert result.token_ids == ids[9:]
