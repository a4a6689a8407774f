"""GGUF files imported with `colibri-int4 import-gguf` compute what transformers computes on the
same dequantized weights.

Each GGUF is written here as llama.cpp's converter writes one, with gguf-py's GGUFWriter, from a
tiny random transformers model: its config as `{arch}.*` metadata, tensor names through gguf-py's
TensorNameMap, experts stacked as `ffn_{gate,up,down}_exps`, a llama-architecture q/k permuted for
rotate-every-two RoPE, 1-D tensors in F32 and every matrix in the tensor type under test
(gguf.quants.quantize; the K-quants, which gguf-py can only decode, as random blocks with sane
scales). transformers then runs on the values gguf-py decodes from those bytes, rounded to bf16
as the `--quant bf16` container stores matrices, and the engine's logits and greedy tokens must
match it."""

from __future__ import annotations

import math

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers", minversion="5")

import torch  # noqa: E402
from colibri_int4 import Container, GGUFImportError  # noqa: E402
from colibri_int4.import_gguf import import_gguf  # noqa: E402
from colibri_int4.import_hf import quant_scheme  # noqa: E402
from colibri_stream import Engine  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ w", "r e", "a n"]
TOKENS = SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]
VOCAB = len(TOKENS)
COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=96, initializer_range=0.08, rms_norm_eps=1e-6, eos_token_id=2, pad_token_id=0)


def family_config(family: str, d: int = 64):
    """The tiny model of each family; `d` = 256 for the K-quants: every row a whole number of their
    256-weight blocks."""
    dense, expert, head, shared = (96, 32, 16, 64) if d == 64 else (512, 256, 64, 256)
    common = dict(COMMON, hidden_size=d)
    return {
        "llama": lambda: transformers.LlamaConfig(**common, intermediate_size=dense, tie_word_embeddings=True),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, head_dim=head, intermediate_size=dense, moe_intermediate_size=expert, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **common, intermediate_size=dense, moe_intermediate_size=expert, shared_expert_intermediate_size=shared,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
        "olmoe": lambda: transformers.OlmoeConfig(
            **common, intermediate_size=expert, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
        "mixtral": lambda: transformers.MixtralConfig(
            **common, intermediate_size=expert, num_local_experts=8, num_experts_per_tok=2,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        # sinks, a window shorter than the prompt on even layers, q/k/v/o, router and expert biases,
        # yarn RoPE; llama.cpp fixes the SwiGLU clamp at transformers' default 7.0
        "gpt_oss": lambda: transformers.GptOssConfig(
            **common, head_dim=head, intermediate_size=expert, num_local_experts=8, num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0}),
        # MLA with a q latent, interleaved yarn RoPE (llama.cpp takes mscale = mscale_all_dim), sigmoid
        # routing with a selection bias limited to the best 2 of 4 groups, a leading dense layer,
        # a shared expert and a routed scaling factor
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, intermediate_size=dense, moe_intermediate_size=expert,
            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.8,
                             "rope_theta": 10000.0}),
        # DeepSeek-V2-Lite's shape: MLA without a q latent, a softmax router, plain top-k, gates
        # scaled and not renormalised
        "deepseek_v2": lambda: transformers.DeepseekV2Config(
            **{**common, "num_key_value_heads": 4}, intermediate_size=dense, moe_intermediate_size=expert,
            n_routed_experts=8, num_experts_per_tok=3, topk_method="greedy", n_group=1, topk_group=1,
            n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=1.5, q_lora_rank=None,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                             "rope_theta": 10000.0}),
    }[family]()


ARCH = {"llama": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe",
        "gpt_oss": "gpt-oss", "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2"}
PRE = {"llama": "smollm", "mixtral": "gpt-2", "qwen3_moe": "qwen2", "qwen2_moe": "qwen2", "olmoe": "olmo",
       "gpt_oss": "gpt-4o", "deepseek_v3": "qwen2", "deepseek_v2": "qwen2"}
# (byte offsets of the fp16 scale fields in a block, the largest |code product|): random blocks
# whose scales are set so that the decoded weights stay near the model's own magnitude
K_QUANTS = {"Q2_K": ((80, 82), 45), "Q3_K": ((108,), 128), "Q4_K": ((0, 2), 945), "Q5_K": ((0, 2), 1953),
            "Q6_K": ((208,), 4096)}
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *K_QUANTS]


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of q/k, any trailing dims: works on blocks too)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def encode(weights: np.ndarray, kind: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes GGUF stores, the fp32 values gguf-py decodes from them)."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in K_QUANTS:
        fields, largest = K_QUANTS[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (*weights.shape[:-1], weights.shape[-1] // block, size), dtype=np.uint8)
        scale = np.array([3 * weights.std() / largest], dtype=np.float16).view(np.uint8)
        for offset in fields:
            raw[..., offset:offset + 2] = scale
        raw = raw.reshape(*weights.shape[:-1], -1)
    else:
        raw = gguf.quants.quantize(weights, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(weights.shape)


def write_gguf(path, family: str, model, kind: str, rng) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp's converter would, matrices as `kind`; returns the decoded
    values by HF name (experts as transformers 5 holds them: gate_up_proj, down_proj)."""
    cfg = model.config
    arch = ARCH[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1 if arch == "deepseek2" else cfg.num_key_value_heads)  # MLA as one shared head
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if family in ("qwen3_moe", "gpt_oss"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family == "gpt_oss":
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
    if arch == "llama":
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if arch == "deepseek2":  # what convert_hf_to_gguf.py's DeepseekV2Model writes
        writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
        writer.add_vocab_size(cfg.vocab_size)
        if cfg.q_lora_rank is not None:
            writer.add_q_lora_rank(cfg.q_lora_rank)
        writer.add_kv_lora_rank(cfg.kv_lora_rank)
        writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        writer.add_value_length_mla(cfg.v_head_dim)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_count(cfg.n_shared_experts)
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
        if cfg.norm_topk_prob:
            writer.add_expert_weights_norm(cfg.norm_topk_prob)
        v3 = family == "deepseek_v3"
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
        writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
        writer.add_rope_scaling_yarn_log_mul(0.1 * cfg.rope_parameters["mscale_all_dim"])
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    n_experts = (getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)
                 or getattr(cfg, "n_routed_experts", 0))
    if n_experts:
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if family in ("qwen3_moe", "qwen2_moe"):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE[family])
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages }}")
    names = gguf.TensorNameMap(gguf.MODEL_ARCH(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)),
                               cfg.num_hidden_layers)
    values: dict[str, np.ndarray] = {}

    def add(gguf_name: str, weights: np.ndarray, permute_heads: int = 0, bias: bool = False) -> np.ndarray:
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
        if weights.ndim == 1 or bias or weights.shape[-1] % block:  # llama.cpp keeps these in F32
            writer.add_tensor(gguf_name, np.ascontiguousarray(weights))
            return weights
        raw, decoded = encode(weights, kind, rng)
        if permute_heads:
            raw = llama_cpp_permute(raw, permute_heads)
        writer.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        return decoded

    for hf_name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if family == "gpt_oss" and ".experts." in hf_name:
            # transformers' GPT-OSS: gate_up_proj [E, d, 2F] (x @ W), gate and up interleaved;
            # llama.cpp's converter transposes and de-interleaves them (biases alike)
            prefix = hf_name[: hf_name.index("experts.") + len("experts.")]
            base = {part: names.get_name(prefix + part) for part in ("gate_proj", "up_proj", "down_proj")}
            if hf_name.endswith("gate_up_proj"):
                both = array.transpose(0, 2, 1)
                gate = add(base["gate_proj"] + ".weight", np.ascontiguousarray(both[:, ::2]))
                up = add(base["up_proj"] + ".weight", np.ascontiguousarray(both[:, 1::2]))
                values[hf_name] = np.stack([gate, up], axis=2).reshape(both.shape).transpose(0, 2, 1)
            elif hf_name.endswith("gate_up_proj_bias"):
                gate = add(base["gate_proj"] + ".bias", np.ascontiguousarray(array[:, ::2]), bias=True)
                up = add(base["up_proj"] + ".bias", np.ascontiguousarray(array[:, 1::2]), bias=True)
                values[hf_name] = np.stack([gate, up], axis=2).reshape(array.shape)
            elif hf_name.endswith("down_proj"):
                values[hf_name] = add(base["down_proj"] + ".weight", np.ascontiguousarray(array.transpose(0, 2, 1)))
                values[hf_name] = values[hf_name].transpose(0, 2, 1)
            else:
                values[hf_name] = add(base["down_proj"] + ".bias", array, bias=True)
            continue
        if hf_name.endswith("e_score_correction_bias"):  # renamed to a ".bias" by the converter
            values[hf_name] = add(names.get_name(hf_name[: -len("_bias")]) + ".bias", array)
            continue
        if hf_name.endswith("kv_b_proj.weight"):  # split for MLA's weight absorption, k_b transposed
            heads, nope, v_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            kv_b = array.reshape(heads, nope + v_dim, -1)
            base = hf_name.replace("kv_b_proj", "{}_proj")
            k_b = add(names.get_name(base.format("k_b"), try_suffixes=(".weight",)),
                      np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
            v_b = add(names.get_name(base.format("v_b"), try_suffixes=(".weight",)), np.ascontiguousarray(kv_b[:, nope:]))
            values[hf_name] = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(array.shape)
            continue
        if hf_name.endswith(".sinks"):  # the converter names the parameter ".weight"
            values[hf_name] = add(names.get_name(hf_name) + ".weight", array)
            continue
        if hf_name.endswith("experts.gate_up_proj"):  # [E, 2I, d], gate rows first
            prefix = hf_name[: -len("gate_up_proj")]
            gate, up = np.split(array, 2, axis=1)
            decoded = [add(names.get_name(prefix + part) + ".weight", w) for part, w in (("gate_proj", gate), ("up_proj", up))]
            values[hf_name] = np.concatenate(decoded, axis=1)
            continue
        if hf_name.endswith("experts.down_proj"):
            values[hf_name] = add(names.get_name(hf_name) + ".weight", array)
            continue
        heads = 0
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
        values[hf_name] = add(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), array, heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


@torch.no_grad()
def reference_model(family: str, d: int = 64):
    torch.manual_seed(17)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, d)).eval()
    for name, parameter in model.named_parameters():
        if name.endswith(".bias"):  # transformers initialises biases to zero: a test of them needs them not to be
            parameter.normal_(std=0.08)
        parameter.copy_(parameter.to(torch.bfloat16))  # bf16 weights, as checkpoints ship
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # a zero selection bias would test nothing
            buffer.normal_(0.0, 0.1)
    return model


@torch.no_grad()
def load_values(model, values: dict[str, np.ndarray], bf16_matrices: bool) -> None:
    """Give transformers the decoded GGUF values (matrices rounded to bf16 as the bf16 container is)."""
    for name, parameter in model.state_dict().items():
        if name in values:
            value = torch.from_numpy(np.ascontiguousarray(values[name]))
            parameter.copy_(value.to(torch.bfloat16) if bf16_matrices and value.ndim > 1 else value)


def _prompt(n: int = 12) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(3)).tolist()


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids, out = torch.tensor([prompt]), []
    with torch.inference_mode():
        for _ in range(steps):
            token = int(model(ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def _import_and_compare(tmp_path, family: str, kind: str, d: int = 64, steps: int = 12):
    model = reference_model(family, d)
    path = tmp_path / f"{family}.{kind}.gguf"
    values = write_gguf(path, family, model, kind, np.random.default_rng(0))
    load_values(model, values, bf16_matrices=True)
    container = tmp_path / f"{family}.{kind}.coli"
    report = import_gguf(path, container, quant_scheme("bf16"))
    prompt = _prompt()
    expected = _greedy(model, prompt, steps)
    with torch.inference_mode():
        ref_logits = model(torch.tensor([prompt + expected])).logits[0]
    with Engine.open(container, ram_budget="1GB", dtype="f32", max_context=64, prefill_chunk=16) as eng:
        logits = eng.logits(prompt + expected)
        diff = float((logits - ref_logits).abs().max())  # same bf16 weights, both fp32: summation order only
        assert diff < 1e-4 * max(1.0, float(ref_logits.abs().max())), (family, kind, diff)
        assert eng.generate(prompt, steps, stop_token_ids=[]).token_ids == expected, (family, kind)
    return report, container


@pytest.mark.parametrize("family", sorted(ARCH))
def test_each_family_from_q8_0_computes_transformers_logits_and_greedy_tokens(tmp_path, family):
    report, container = _import_and_compare(tmp_path, family, "Q8_0")
    assert report.tensor_types["Q8_0"] > 0 and report.model_type == family
    with Container.open(container) as c:
        assert c.chat_template == "{{ messages }}" and c.tokenizer_config["eos_token_ids"] == [2]
        assert c.tokenizer_config["bos_token"] == "<|im_start|>"
        assert Tokenizer.from_str(c.read_tokenizer_json()).encode("<|im_end|> the").ids == [2, TOKENS.index("Ġthe")]
        assert c.config["tie_embeddings"] == (family == "llama")


@pytest.mark.parametrize("kind", [t for t in TYPES if t != "Q8_0"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_every_tensor_type_computes_transformers_logits(tmp_path, family, kind):
    """The K-quants' blocks are 256 weights: those models are 256 wide."""
    _import_and_compare(tmp_path, family, kind, d=256 if kind in K_QUANTS else 64, steps=4)


def test_gpt_oss_mxfp4_experts_compute_transformers_logits(tmp_path):
    """llama.cpp's GPT-OSS files keep the experts in MXFP4 (gguf-py quantizes and decodes them)."""
    _import_and_compare(tmp_path, "gpt_oss", "MXFP4")


def test_int4_container_from_a_gguf_keeps_top1_and_kl_close_to_the_dequantized_weights(tmp_path, capsys):
    """The requantization cost: the default int4 scheme against fp32 transformers on the GGUF's
    decoded values (no bf16 rounding on the reference side)."""
    model = reference_model("qwen3_moe")
    path = tmp_path / "q.gguf"
    load_values(model, write_gguf(path, "qwen3_moe", model, "Q8_0", np.random.default_rng(0)), bf16_matrices=False)
    import_gguf(path, tmp_path / "int4.coli", quant_scheme("int4", group_size=32))
    ids = torch.randint(3, VOCAB, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].double()
    with Engine.open(tmp_path / "int4.coli", ram_budget="1GB", max_context=64) as eng:
        got = eng.logits(ids).double()
    top1 = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    with capsys.disabled():
        print(f"\n  qwen3_moe Q8_0 GGUF -> int4 g32: top-1 agreement {top1:.3f}, KL {kl:.5f} nats")
    assert top1 >= 0.75 and math.isfinite(kl) and kl < 0.05, (top1, kl)


def test_unsupported_tensor_type_is_refused_by_name(tmp_path):
    model = reference_model("llama")
    path = tmp_path / "iq.gguf"
    write_gguf(path, "llama", model, "Q8_0", np.random.default_rng(0))
    # relabel one tensor as IQ4_NL (32-weight blocks too, fewer bytes: it still lies inside the file)
    raw = bytearray(path.read_bytes())
    name = b"blk.0.attn_v.weight"
    at = raw.index(name) + len(name)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(raw[type_at:type_at + 4], "little") == gguf.GGMLQuantizationType.Q8_0
    raw[type_at:type_at + 4] = int(gguf.GGMLQuantizationType.IQ4_NL).to_bytes(4, "little")  # also 32-weight blocks
    path.write_bytes(bytes(raw))
    with pytest.raises(GGUFImportError, match=r"tensor 'blk\.0\.attn_v\.weight' is stored as IQ4_NL, which import-gguf "
                                              r"does not read \(supported: F32, F16, BF16"):
        import_gguf(path, tmp_path / "out.coli", quant_scheme("bf16"))
    assert not (tmp_path / "out.coli").exists()
