"""Planning a Hugging Face model from its config.json alone (no weights): `colibri-stream plan
config.json`. Qwen3-30B-A3B's published config (tests/fixtures/qwen3_30b_a3b/config.json) is
checked against sizes computed by hand here; a tiny imported model checks that the planned
container is the one import-hf writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from colibri_int4 import Container, ContainerError
from colibri_int4.import_hf import planned_container, sizes_by_quant
from colibri_stream import Engine
from colibri_stream.cli import main
from colibri_stream.plan import DEFAULT_MAX_CONTEXT
from colibri_stream.sizes import format_size
from tokenizers import Tokenizer, models

QWEN3_30B = Path(__file__).parent / "fixtures" / "qwen3_30b_a3b"

# Qwen3-30B-A3B by hand: vocab V, width d, L layers, H query heads and KV heads of hd, E experts of F.
V, D, L, H, KV, HD, E, F = 151936, 2048, 48, 32, 4, 128, 128, 768
MATRICES = 2 * V * D + L * (H * HD * D + 2 * KV * HD * D + D * H * HD + E * D)  # embed, head, q k v o, router
VECTORS = D + L * (2 * D + 2 * HD)  # final norm; per layer the two norms and q_norm, k_norm (head_dim wide)
ROUTER_COUNTERS = L * E  # fp32 token counters
# int4 blob: 3 matrices of F x D nibbles + one bf16 scale per 64 weights, padded to 4 KiB
INT4_BLOB = 3 * (F * D // 2 + 2 * F * D // 64)
INT8_BLOB = 3 * (F * D + 2 * F * D // 64)
INT8_EMBEDDING = V * D + 2 * V * D // 64  # import-hf's int8 embedding as stored: a bf16 scale per 64
BF16_BLOB = 3 * F * D * 2


def test_qwen3_30b_a3b_plan_from_config_matches_a_hand_computation():
    assert MATRICES + VECTORS == 1_541_093_376  # the ~1.5B-parameter backbone
    assert INT4_BLOB % 4096 == 0 and INT8_BLOB % 4096 == 0  # no padding at these shapes
    plan = Engine.plan(planned_container(QWEN3_30B, "int4"), compute="int4")
    f = plan.footprint
    # defaults for a 16 GB laptop: bf16 (f32 would be 5.2 GB of backbone weights: the embedding as
    # stored, int8, mapped from the container outside the budget, the rest in f32), 4096 of 40,960 positions
    assert f.dtype == torch.bfloat16 and f.max_context == DEFAULT_MAX_CONTEXT and plan.max_seq_len == 40960
    f32_backbone = INT8_EMBEDDING + 4 * (MATRICES - V * D) + 4 * (VECTORS + ROUTER_COUNTERS)
    assert len(plan.defaults) == 2 and f"{format_size(f32_backbone)} in f32" in plan.defaults[0]
    assert f.resident_by_dtype == {"bf16": 2 * (MATRICES - V * D), "f32": 4 * (VECTORS + ROUTER_COUNTERS)}
    assert f.mapped_bytes == INT8_EMBEDDING
    assert plan.kv_bytes_per_token == 2 * L * KV * HD * 2 == 98_304  # K and V, bf16
    assert plan.kv_cache_at(40960) == 4_026_531_840  # the ~4 GB the config's context would take
    assert f.total_experts == L * E and f.top_k == 8
    assert plan.expert_bytes_on_disk == L * E * INT4_BLOB
    assert plan.min_budget == f.fixed_bytes + 8 * f.slot_bytes
    assert plan.full_budget == f.fixed_bytes + L * E * f.slot_bytes
    # a 16 GB laptop holds the backbone and three quarters of the experts
    split = Engine.plan(planned_container(QWEN3_30B, "int4"), "16GB", compute="int4").budget
    assert 0.7 < split.slots / (L * E) < 0.8
    sizes = sizes_by_quant(QWEN3_30B)
    assert {q: s.blob_length for q, s in sizes.items()} == {"bf16": BF16_BLOB, "int8": INT8_BLOB, "int4": INT4_BLOB}
    assert sizes["int4"].file_size < sizes["int8"].file_size < sizes["bf16"].file_size
    explicit = Engine.plan(planned_container(QWEN3_30B, "bf16"), dtype="f32", max_context=40960)
    assert explicit.defaults == [] and explicit.footprint.resident_by_dtype["f32"] > 4 * (MATRICES - V * D)
    assert "bf16" not in explicit.footprint.resident_by_dtype and explicit.footprint.mapped_bytes == 2 * V * D
    assert explicit.footprint.kv_cache_bytes == 2 * 98_304 * 40960  # f32 KV


def test_plan_cli_from_config_prints_sizes_kv_and_hit_rate_budget(tmp_path):
    run = CliRunner().invoke
    text = run(main, ["plan", str(QWEN3_30B / "config.json"), "--compute", "int4"])
    assert text.exit_code == 0, text.output
    assert "container size bf16 61.07 GB, int8 31.50 GB, int4 17.00 GB" in text.output
    assert "KV cache (bf16, 98.3 KB per token): 2048 tokens 201.3 MB" in text.output and "40960 tokens 4.03 GB" in text.output
    assert "max_context 4096 of the config's 40960" in text.output
    out = json.loads(run(main, ["plan", str(QWEN3_30B), "--quant", "int8", "--compute", "dequant", "--json"]).output)
    assert out["quant"] == "int8" and out["expert_bytes_on_disk"] == L * E * INT8_BLOB
    assert out["kv_cache_by_context"]["40960"] == 40960 * 98_304 and out["resident_by_dtype"]["bf16"] == 2 * (MATRICES - V * D)
    assert out["mapped_bytes"] == INT8_EMBEDDING
    # a hit-rate target from a routing trace of this shape (48 x 128, top-8)
    trace_path = _write_trace(tmp_path / "qwen3.jsonl.gz")
    target = run(main, ["plan", str(QWEN3_30B), "--compute", "int4", "--trace", str(trace_path), "--hit-rate", "0.5",
                        "--json"])
    assert target.exit_code == 0, target.output
    t = json.loads(target.output)["hit_rate_target"]
    assert t["reachable"] and t["hit_rate"] >= 0.5 and t["slots"] <= 48 * 16


def _write_trace(path: Path) -> Path:
    """A routing trace of Qwen3-30B-A3B's shape: 32 tokens, 8 of 16 hot experts per layer."""
    from colibri_stream.traces.events import TraceEvent
    from colibri_stream.traces.routing_trace import write_trace

    generator = torch.Generator().manual_seed(0)
    events = [TraceEvent(step, layer, tuple(torch.randperm(16, generator=generator)[:8].tolist()))
              for step in range(32) for layer in range(L)]
    return write_trace(path, events, n_moe_layers=L, n_experts=E, top_k=8)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(use_sliding_window=True), "use_sliding_window=True is not supported"),
    (lambda c: c.update(attn_logit_softcapping=30.0), "attn_logit_softcapping=30.0 is not supported"),
    (lambda c: c.pop("hidden_size"), "required field 'hidden_size' is missing"),
    (lambda c: c.update(model_type="qwen3_next"), "model_type='qwen3_next' is not supported (Gated DeltaNet"),
])
def test_a_bad_config_is_one_clear_error_and_exit_2(tmp_path, edit, message):
    config = json.loads((QWEN3_30B / "config.json").read_text())
    edit(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = CliRunner().invoke(main, ["plan", str(path)])
    assert result.exit_code == 2, result.output
    assert message in result.output and str(path) in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_not_json_and_quant_on_a_container_are_refused(tmp_path, tiny):
    (tmp_path / "config.json").write_text("{not json")
    result = CliRunner().invoke(main, ["plan", str(tmp_path)])
    assert result.exit_code == 2 and "not valid JSON" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(main, ["plan", str(empty)])
    assert result.exit_code == 2 and "config.json: missing" in result.output
    result = CliRunner().invoke(main, ["plan", str(tiny[0]), "--quant", "int8"])
    assert result.exit_code == 2 and "--quant and --group plan an HF config.json" in result.output


def test_the_planned_container_is_the_one_import_hf_writes(tmp_path):
    transformers = pytest.importorskip("transformers", minversion="5")
    from colibri_int4.import_hf import import_hf, quant_scheme

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=96)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    no_weights = tmp_path / "elsewhere" / "hf"  # the same directory name, without the weights
    no_weights.mkdir(parents=True)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}", "eos_token": "w1"}')
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tmp_path / "hf" / name, no_weights / name)
    for quant in ("int4", "bf16"):
        import_hf(tmp_path / "hf", tmp_path / f"{quant}.coli", quant_scheme(quant))
        planned = planned_container(no_weights, quant)
        with Container.open(tmp_path / f"{quant}.coli") as real:
            assert planned.file_size == real.file_size and planned.blob_layout == real.blob_layout
            assert planned.header.tokenizer_config == real.header.tokenizer_config
            assert [(t.name, t.shape, t.offset, t.length) for t in planned.header.tensors] == \
                   [(t.name, t.shape, t.offset, t.length) for t in real.header.tensors]
            a = Engine.plan(planned, compute="dequant").to_dict()
            b = Engine.plan(real, compute="dequant").to_dict()
        assert {k: v for k, v in a.items() if k != "container"} == {k: v for k, v in b.items() if k != "container"}
        with pytest.raises(ContainerError, match="planned from a config and has no file"):
            planned.read_resident()


DEEPSEEK_V3 = Path(__file__).parent / "fixtures" / "deepseek_v3"


def test_deepseek_v3_plan_from_config_matches_a_hand_computation(tmp_path):
    """DeepSeek-V3's published config, the FP8 release's (import-hf dequantizes its block-scaled
    weights and re-quantizes them, so it plans exactly as its bf16 conversion, the same config
    without quantization_config): 671B parameters, 37B active, and a KV cache of the latent
    (mla.py: 512 + 64 numbers per layer and position, where decompressed per-head keys and values
    would take 128 x (192 + 128), 71x more)."""
    container = planned_container(DEEPSEEK_V3, "int4")
    config = json.loads((DEEPSEEK_V3 / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    bf16_conversion = planned_container(tmp_path, "int4")
    assert container.file_size == bf16_conversion.file_size and container.blob_layout == bf16_conversion.blob_layout
    assert {k: v for k, v in container.config.items() if k != "name"} == \
           {k: v for k, v in bf16_conversion.config.items() if k != "name"}
    c = container.config
    assert (c["attention_kind"], c["router_groups"], c["router_topk_groups"], c["route_scale"]) == ("mla", 8, 4, 2.5)
    assert c["rope_scaling"]["kind"] == "yarn" and c["rope_scaling"]["factor"] == 40.0
    plan = Engine.plan(container, compute="int4")
    assert plan.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272  # bf16
    int4_blob = 3 * (2048 * 7168 // 2 + 2 * 2048 * 7168 // 64)
    assert plan.footprint.total_experts == (61 - 3) * 256 and plan.footprint.top_k == 8
    assert plan.expert_bytes_on_disk == 58 * 256 * int4_blob


GPT_OSS_20B = Path(__file__).parent / "fixtures" / "gpt_oss_20b"


def test_gpt_oss_20b_plan_sizes_the_sliding_layers_at_their_window():
    """gpt-oss-20b's published config: 24 layers of 8 KV heads x 64, every other one (12) sliding
    over 128 positions. A session's cache keeps at most window - 1 + 2 x prefill_chunk = 383
    positions on a sliding layer (session_kv.py), so the plan sizes those at that, and states
    what layers keeping every position would take."""
    plan = Engine.plan(planned_container(GPT_OSS_20B, "int4"), compute="int4")
    layer_position = 2 * 8 * 64 * 2  # K and V, bf16
    assert plan.kv_bytes_per_token == 24 * layer_position == 49_152
    s = plan.sliding_kv
    assert (s.layers, s.total_layers, s.window, s.prefill_chunk, s.positions) == (12, 24, 128, 128, 383)
    for context, held, full in ((4096, 110_075_904, 201_326_592), (32768, 814_718_976, 1_610_612_736)):
        assert plan.kv_cache_at(context) == held == 12 * layer_position * (context + 383)
        assert plan.full_kv_cache_at(context) == full == 24 * layer_position * context
    assert plan.footprint.kv_cache_bytes == plan.kv_cache_at(plan.footprint.max_context)  # what the budget holds
    assert plan.kv_cache_at(300) == plan.full_kv_cache_at(300)  # shorter than what a sliding layer keeps
    out = CliRunner().invoke(main, ["plan", str(GPT_OSS_20B / "config.json"), "--dtype", "bf16"])
    assert out.exit_code == 0, out.output
    assert ("the 12 sliding-window layers of 24 (window 128) keep at most 383 positions each (window - 1 + 2 x "
            "prefill chunk 128); keeping every position they would take") in out.output
    assert "4096 tokens 110.1 MB" in out.output and "4096 tokens 201.3 MB" in out.output
    data = json.loads(CliRunner().invoke(main, ["plan", str(GPT_OSS_20B), "--dtype", "bf16", "--json"]).output)
    assert data["kv_cache_by_context"]["32768"] == 814_718_976 == data["kv_cache_windowed_by_context"]["32768"]
    assert Engine.plan(planned_container(QWEN3_30B, "int4"), compute="int4").sliding_kv is None
