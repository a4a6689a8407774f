"""Hugging Face checkpoints imported with `colibri-int4 import-hf` compute what transformers
computes: for each family a tiny random transformers model (its own config class, saved with
`save_pretrained` in bf16), imported with `--quant bf16`, gives the same logits as transformers'
own forward and the same 32 greedy tokens, at a full and at the minimum RAM budget; `--quant
int4` is measured (top-1 agreement, KL) against a loose bound, and the figures printed.

The engine runs colibri-model's ColibriForCausalLM (the variants are its configuration), with
the routed experts streamed from the container: nothing here is a second model."""

from __future__ import annotations

import copy
import math

import pytest

transformers = pytest.importorskip("transformers", minversion="5")

import torch  # noqa: E402
from colibri_int4 import Container  # noqa: E402
from colibri_int4.import_hf import import_hf, quant_scheme  # noqa: E402
from colibri_model import parse_checkpoint_config  # noqa: E402
from colibri_stream import Engine  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=96, initializer_range=0.08, rms_norm_eps=1e-6, eos_token_id=1, pad_token_id=0)
# Each family with the knobs that matter to it, away from the defaults where the default is the easy case.
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0]),
    "olmoe": lambda: transformers.OlmoeConfig(
        **COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False),
    # sinks, a sliding window shorter than the prompt on layers 0 and 2, q/k/v/o biases, yarn RoPE,
    # a router bias, experts with biases and the clamped SwiGLU (a limit the random weights reach)
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON, head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        swiglu_limit=0.5,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0}),
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, intermediate_size=96, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16, "rope_theta": 500000.0}),
    # MLA with a q latent, interleaved yarn RoPE (attention factor and softmax correction both != 1),
    # group-limited sigmoid routing with a score-correction bias (randomised in _checkpoint), a
    # leading dense layer, a shared expert and a routed scaling factor
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0}),
    # DeepSeek-V2-Lite's shape: MLA without a q latent, softmax routing limited to the best of 2
    # groups (scored by their best expert; with top_k <= topk_group the limit would change no pick),
    # gates scaled and not renormalised, yarn as V2 sets it
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=2, topk_group=1, n_shared_experts=2,
        first_k_dense_replace=1, routed_scaling_factor=1.5, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}),
}
CONTEXT = 64
STEPS = 32


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def _checkpoint(family: str, directory):
    torch.manual_seed(17)
    config = FAMILIES[family]()
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a zero selection bias (transformers' init) would test nothing
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    _randomise_zero_initialised(model)
    model.to(torch.bfloat16).save_pretrained(directory)  # what the Hub holds: bf16 safetensors
    _tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}", "eos_token": "w1"}')
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@torch.no_grad()
def _randomise_zero_initialised(model) -> None:
    """transformers initialises biases to zero (GPT-OSS's expert biases, q/k/v/o biases); a test
    of the bias path needs them not to be."""
    for name, parameter in model.named_parameters():
        if name.endswith(("_bias", ".bias")):
            parameter.normal_(std=0.08)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imported(request, tmp_path_factory):
    """(family, transformers model in fp32 with the checkpoint's bf16 weights, bf16 container)."""
    directory = tmp_path_factory.mktemp(request.param)
    reference = _checkpoint(request.param, directory / "hf")
    container = directory / "bf16.coli"
    import_hf(directory / "hf", container, quant_scheme("bf16"))
    return request.param, reference, container, directory


def _prompt() -> list[int]:
    return torch.randint(2, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    for _ in range(steps):
        token = int(model(ids).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def _minimum_budget(container, **options) -> int:
    return Engine.plan(container, **options).min_budget  # from the header: no engine is built


def test_imported_config_is_a_colibri_config_and_the_container_keeps_the_tokenizer(imported):
    family, reference, container, _ = imported
    with Container.open(container) as c:
        config = parse_checkpoint_config(c.config, str(container))  # colibri-model's one reader
        assert c.chat_template == "{{ messages }}" and c.tokenizer_config["eos_token_ids"] == [1]
        assert Tokenizer.from_str(c.read_tokenizer_json()).token_to_id("w7") == 7
        assert c.scheme.expert_dtype == "bf16" and c.version == ((1, 2) if family == "gpt_oss" else (1, 1))
    assert config.n_layers == 3 and config.vocab_size == VOCAB
    assert config.to_dict() == {k: v for k, v in c.config.items() if k not in ("format_version", "model_type")}
    if family == "llama":
        assert config.n_experts == 0 and config.n_moe_layers == 0 and config.tie_embeddings
    elif family == "deepseek_v3":
        assert config.attention_kind == "mla" and config.router_score == "sigmoid" and config.selection_bias
        assert config.router_groups == 4 and config.n_dense_layers == 1 and config.rope_scaling.kind == "yarn"
    else:
        assert config.router_score == "softmax" and not config.selection_bias


def test_chat_goes_through_the_imported_template_and_stops_on_its_end_tokens(imported):
    from colibri_stream.chat import ChatTemplate

    _, _, container, _ = imported
    messages = [{"role": "user", "content": "w3 w4"}]
    with Engine.open(container, ram_budget="1GB") as eng:
        template = ChatTemplate.for_engine(eng)
        assert template.name == "container"  # not the ChatML fallback
        assert template.render(messages) == str(messages)  # the fixture's template: "{{ messages }}"
        assert eng.end_token_ids == [1]  # tokenizer_config's eos_token "w1"


def test_bf16_import_matches_transformers_logits_and_greedy_tokens_at_full_and_tiny_budget(imported):
    family, reference, container, _ = imported
    prompt = _prompt()
    expected = _hf_greedy(reference, prompt, STEPS)
    with torch.inference_mode():
        ref_logits = reference(torch.tensor([prompt + expected])).logits[0]
    options = dict(dtype="f32", max_context=CONTEXT, prefill_chunk=16)
    for budget in ("1GB", _minimum_budget(container, **options)):
        with Engine.open(container, ram_budget=budget, **options) as eng:
            logits = eng.logits(prompt + expected)
            # same bf16 weights, both fp32: only summation order differs
            diff = float((logits - ref_logits).abs().max())
            assert diff < 1e-4 * max(1.0, float(ref_logits.abs().max())), (family, budget, diff)
            result = eng.generate(prompt, STEPS, stop_token_ids=[])
            assert result.token_ids == expected, (family, budget)
            if budget != "1GB" and family != "llama":
                assert eng.stats.to_dict()["misses"] > eng.budget.slots  # the tiny budget really streamed
    # bf16 activations: no further from the fp32 logits than transformers' own bf16 forward is
    # (both round the same bf16 weights; a near-tie in the router can flip in either)
    with Engine.open(container, ram_budget="1GB", dtype="bf16", max_context=CONTEXT) as eng:
        engine_error = float((eng.logits(prompt + expected) - ref_logits).abs().mean())
    with torch.inference_mode():  # a copy: .to(bf16) would also round transformers' RoPE inv_freq buffer
        hf_bf16 = copy.deepcopy(reference).to(torch.bfloat16)(torch.tensor([prompt + expected])).logits[0].float()
    hf_error = float((hf_bf16 - ref_logits).abs().mean())
    assert engine_error <= 2 * hf_error + 1e-3 * float(ref_logits.abs().max()), (family, engine_error, hf_error)


def test_a_padded_batch_decodes_each_prompt_as_transformers_does_alone(imported):
    """Rows of different lengths, decoded together (one [B, 1] pass per step, per-row positions,
    padding masked: batch_decode.py), each give transformers' greedy tokens for that prompt."""
    family, reference, container, _ = imported
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (n,), generator=generator).tolist() for n in (12, 4, 9)]
    steps = 12
    expected = [_hf_greedy(reference, p, steps) for p in prompts]
    options = dict(dtype="f32", max_context=CONTEXT, prefill_chunk=16)
    for budget in ("1GB", _minimum_budget(container, **options)):
        with Engine.open(container, ram_budget=budget, **options) as eng:
            passes = eng.stats.steps
            got = [r.token_ids for r in eng.generate(prompts, steps, stop_token_ids=[])]
            assert got == expected, (family, budget)
            prefill_passes = -(-12 // (16 // 3))  # 16-token chunks over 3 rows: 5 columns a pass
            assert eng.stats.steps - passes == prefill_passes + steps - 1  # then one pass per step


def _agreement(reference_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || other) in nats) over positions."""
    top1 = float((reference_logits.argmax(-1) == logits.argmax(-1)).float().mean())
    p = torch.log_softmax(reference_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    return top1, kl


BOUNDS = {"int4": (0.75, 0.05), "int8": (0.9, 0.005)}  # top-1 at least, KL at most


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_import_top1_agreement_and_kl(imported, quant, capsys):
    family, reference, _, directory = imported
    container = directory / f"{quant}.coli"
    import_hf(directory / "hf", container, quant_scheme(quant, group_size=32))
    ids = torch.randint(2, VOCAB, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        ref_logits = reference(torch.tensor([ids])).logits[0]
    with Engine.open(container, ram_budget="1GB", max_context=CONTEXT) as eng:
        top1, kl = _agreement(ref_logits, eng.logits(ids))
        compute = eng.stats.compute_mode
    with capsys.disabled():
        print(f"\n  {family:10s} {quant} g32 (resident int8, {compute}): top-1 agreement {top1:.3f}, KL {kl:.5f} nats")
    min_top1, max_kl = BOUNDS[quant]
    assert top1 >= min_top1 and math.isfinite(kl) and kl < max_kl, (family, quant, top1, kl)


def test_dequantized_import_is_a_colibri_checkpoint_with_transformers_logits(imported, tmp_path):
    """import-hf --quant bf16, then `colibri-int4 dequantize`: a colibri-model checkpoint that
    load_checkpoint reads (and the trainer could fine-tune), computing transformers' logits."""
    from colibri_int4 import dequantize_container
    from colibri_model import load_checkpoint

    family, reference, container, _ = imported
    model = load_checkpoint(dequantize_container(container, tmp_path / "ckpt")).eval()
    ids = torch.tensor([_prompt()])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)


def test_gpt_oss_mxfp4_checkpoint_computes_transformers_logits_on_its_decoded_weights(tmp_path):
    """The published GPT-OSS form: experts as MXFP4 blocks + scales (packed here from the tiny
    model's weights). Imported with --quant bf16 it equals transformers run on the decoded weights."""
    import json

    from colibri_int4.mxfp4 import decode_mxfp4, encode_mxfp4
    from safetensors.torch import load_file, save_file

    reference = _checkpoint("gpt_oss", tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    mx = tmp_path / "mxfp4"
    mx.mkdir()
    for i in range(reference.config.num_hidden_layers):
        experts = reference.model.layers[i].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            stored = tensors.pop(f"model.layers.{i}.mlp.experts.{proj}")  # [E, in, out]
            blocks, scales = encode_mxfp4(stored.float().transpose(1, 2).numpy())
            tensors[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = torch.from_numpy(blocks)
            tensors[f"model.layers.{i}.mlp.experts.{proj}_scales"] = torch.from_numpy(scales)
            with torch.no_grad():  # what transformers' MXFP4 dequantizer hands the forward
                getattr(experts, proj).copy_(torch.from_numpy(decode_mxfp4(blocks, scales)).transpose(1, 2))
    save_file(tensors, str(mx / "model.safetensors"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mx / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (mx / name).write_bytes((tmp_path / "hf" / name).read_bytes())
    import_hf(mx, tmp_path / "mxfp4.coli", quant_scheme("bf16"))
    ids = _prompt() * 3
    with torch.inference_mode():
        ref_logits = reference(torch.tensor([ids])).logits[0]
    with Engine.open(tmp_path / "mxfp4.coli", ram_budget="1GB", dtype="f32", max_context=CONTEXT) as eng:
        diff = float((eng.logits(ids) - ref_logits).abs().max())
    assert diff < 1e-4 * max(1.0, float(ref_logits.abs().max())), diff


@torch.no_grad()
def test_deepseek_v2_ignores_norm_topk_prob_so_import_refuses_it(tmp_path):
    """transformers' DeepseekV2 router never renormalises, whatever norm_topk_prob says (its gates
    are the top-k softmax probabilities times routed_scaling_factor), while DeepSeek's own code
    renormalises at top_k > 1: import-hf refuses the flag there rather than pick one. If
    transformers starts honouring the flag, the first assertion fails: then map it."""
    import json

    from colibri_int4 import HFImportError
    from colibri_int4.import_hf import colibri_config_from_hf

    config = FAMILIES["deepseek_v2"]()
    config.norm_topk_prob = True
    torch.manual_seed(5)
    moe = transformers.AutoModelForCausalLM.from_config(config).model.layers[1].mlp
    moe.gate.weight.normal_()
    hidden = torch.randn(10, 64)
    _, weights, indices = moe.gate(hidden)
    probabilities = (hidden @ moe.gate.weight.T).softmax(-1)
    torch.testing.assert_close(weights, probabilities.gather(1, indices) * 1.5)
    assert not torch.allclose(weights.sum(-1), torch.full((10,), 1.5))  # not renormalised
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["norm_topk_prob"] is True
    with pytest.raises(HFImportError, match=r"norm_topk_prob=True is not supported \(transformers' DeepseekV2 never"):
        colibri_config_from_hf(data, tmp_path / "config.json")
