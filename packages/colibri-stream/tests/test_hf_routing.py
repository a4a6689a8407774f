"""trace-hf: routing traces of transformers MoE models, checked on tiny random-weight models of
real transformers architectures (the code path a real OLMoE or DeepSeek checkpoint takes)."""

from __future__ import annotations

import inspect

import pytest

transformers = pytest.importorskip("transformers", minversion="5")

import torch  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from colibri_stream.cli import main  # noqa: E402
from colibri_stream.traces.hf_routing import NoRouterError, find_routers, record_routing, token_windows  # noqa: E402
from colibri_stream.traces.routing_trace import read_trace  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def _model(kind: str, **extra):
    configs = {
        "olmoe": lambda: transformers.OlmoeConfig(**{**SMALL, **extra}, num_experts=16, num_experts_per_tok=4),
        "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=8, num_experts_per_tok=2),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **SMALL, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, first_k_dense_replace=1,
            n_group=4, topk_group=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16),
        "gpt_oss": lambda: transformers.GptOssConfig(**SMALL, num_local_experts=8, num_experts_per_tok=2, head_dim=16),
    }
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[kind]()).eval()


@pytest.mark.parametrize("kind, layers, experts, top_k", [
    ("olmoe", [0, 1, 2], 16, 4),
    ("mixtral", [0, 1, 2], 8, 2),
    ("deepseek_v3", [1, 2], 16, 4),  # the first block is dense: MoE layers keep their block index
    ("gpt_oss", [0, 1, 2], 8, 2),
])
def test_record_routing_shapes(kind, layers, experts, top_k):
    model = _model(kind)
    assert [s.layer for s in find_routers(model)] == layers
    trace = record_routing(model, [list(range(10)), [], list(range(5, 25))])
    assert (trace.n_moe_layers, trace.n_experts, trace.top_k, trace.tokens) == (len(layers), experts, top_k, 30)
    assert len(trace.events) == 30 * len(layers)
    assert [e.step for e in trace.events] == [t for t in range(30) for _ in layers]
    assert [e.layer for e in trace.events] == layers * 30
    for e in trace.events:
        assert len(e.experts) == top_k and list(e.experts) == sorted(set(e.experts))
        assert all(0 <= x < experts for x in e.experts)


def test_recorded_experts_are_the_routers_top_k():
    """Against the model's own router logits: OLMoE routes by top-k of softmax(logits)."""
    model = _model("olmoe")
    ids = list(range(3, 40))
    trace = record_routing(model, [ids])
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True, use_cache=False)
    for layer, logits in enumerate(out.router_logits):
        expected = torch.topk(logits.float().softmax(-1), 4, dim=-1).indices.sort(-1).values.tolist()
        got = [list(e.experts) for e in trace.events if e.layer == layer]
        assert got == expected


def test_one_pass_routes_like_token_by_token_decoding():
    """Why a passage may run as one forward pass: causal attention makes each token's routing
    the same as when it is decoded one token at a time through the KV cache."""
    model = _model("olmoe")
    ids = list(range(7, 31))
    trace = record_routing(model, [ids])
    seen: list[tuple[int, ...]] = []
    sites = find_routers(model)
    hooks = [s.module.register_forward_hook(lambda m, a, out: seen.append(tuple(sorted(out[2][0].tolist()))))
             for s in sites]
    try:
        # transformers 5.2x renamed past_key_values to cache
        cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        with torch.inference_mode():
            cache = None
            for token in ids:
                out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{cache_arg: cache})
                cache = getattr(out, "cache", None) or out.past_key_values
    finally:
        for h in hooks:
            h.remove()
    assert seen == [e.experts for e in trace.events]


def test_dense_model_has_no_router():
    config = transformers.LlamaConfig(**SMALL)
    with pytest.raises(NoRouterError, match="found no MoE router in LlamaForCausalLM"):
        find_routers(transformers.AutoModelForCausalLM.from_config(config))


def test_token_windows():
    assert token_windows(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="max_tokens"):
        token_windows([1], 0)


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    """A tiny random OLMoE saved like a Hub checkpoint, with the bundled 49152-token tokenizer."""
    from colibri_model.tokenizer import default_tokenizer_json

    directory = tmp_path_factory.mktemp("olmoe")
    tokenizer_file = directory / "tokenizer.json"
    tokenizer_file.write_text(default_tokenizer_json())
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    tokenizer.save_pretrained(directory)
    _model("olmoe", vocab_size=len(tokenizer)).save_pretrained(directory)
    return directory


def test_trace_hf_cli_then_policy_study(olmoe_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12, encoding="utf-8")
    out = tmp_path / "olmoe.jsonl.gz"
    result = CliRunner().invoke(main, ["trace-hf", str(olmoe_dir), "--text", str(text), "--out", str(out),
                                       "--max-tokens", "40", "--dtype", "f32", "--device", "auto"])
    assert result.exit_code == 0, result.output
    trace = read_trace(out)
    assert (trace.header.n_moe_layers, trace.header.n_experts, trace.header.top_k) == (3, 16, 4)
    assert trace.header.model == str(olmoe_dir) and "text.txt" in trace.header.source
    steps = len({e.step for e in trace.events})
    assert f"{steps} tokens x 3 MoE layers" in result.output and steps > 40  # several windows
    study = CliRunner().invoke(main, ["policy-study", str(out), "--budgets", "25%"])
    assert study.exit_code == 0, study.output
    assert "slots    12" in study.output  # 25% of 3 x 16 experts


def test_trace_hf_cli_errors(olmoe_dir, tmp_path):
    binary, empty, out = tmp_path / "bad.txt", tmp_path / "empty.txt", tmp_path / "o.jsonl"
    binary.write_bytes(b"ok \xff\xfe bad")
    empty.write_text("")
    cases = [
        ([str(tmp_path / "no-model"), "--text", str(empty)], "cannot load"),
        ([str(olmoe_dir), "--text", str(binary)], "bad.txt: not UTF-8 text (invalid start byte at byte 3)"),
        ([str(olmoe_dir), "--text", str(empty)], "hold no tokens"),
        ([str(olmoe_dir), "--text", str(empty), "--device", "nonsense"], "cannot load"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(main, ["trace-hf", *args, "--out", str(out)])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert not out.exists()
    text = tmp_path / "ok.txt"
    text.write_text("Some words to route.")
    result = CliRunner().invoke(main, ["trace-hf", str(olmoe_dir), "--text", str(text),
                                       "--out", str(tmp_path / "missing-dir" / "t.jsonl")])
    assert result.exit_code == 2 and "cannot write the trace" in result.output, result.output
