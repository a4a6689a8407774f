"""DeepSeek-V3 as DeepSeek publishes it (and Qwen3-MoE as Qwen's -FP8 releases do, the same form): every linear weight of attention, the dense MLP, the shared
and the routed experts stored as float8_e4m3fn with a float32 `weight_scale_inv` per block
(embeddings, norms, the router and lm_head in bf16), and config.json's fp8 quantization_config.
The tiny model of test_hf_import.py is written in that form here, in blocks of [16, 24] so its
matrices have several blocks and partial edge blocks in both axes; `import-hf --quant bf16` of
it computes transformers' logits and greedy tokens on the dequantized weights (fp32 products
rounded to bf16, as DeepSeek's own fp8_cast_bf16.py converts them), at a full and at the
minimum RAM budget. A missing scale and the fp8 variants import-hf does not read fail through
the CLI with one error (exit 2) and no output file."""

from __future__ import annotations

import json
import re
import shutil

import pytest

transformers = pytest.importorskip("transformers", minversion="5")

import torch  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from colibri_int4.cli import main as int4_cli  # noqa: E402
from colibri_int4.import_hf import import_hf, quant_scheme  # noqa: E402
from colibri_stream import Engine  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from .test_hf_import import CONTEXT, STEPS, _checkpoint, _hf_greedy, _minimum_budget, _prompt  # noqa: E402

BLOCK = [16, 24]
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": BLOCK}
# DeepSeek-V3's FP8 tensors: the projections of self_attn and mlp (dense, shared, routed), not mlp.gate
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\..*_proj(_with_mqa)?\.weight$")


def _block_view(scale: torch.Tensor, shape) -> torch.Tensor:
    """A per-element copy of a [R, C] block-scale grid for a weight of `shape`."""
    return scale.repeat_interleave(BLOCK[0], 0)[: shape[0]].repeat_interleave(BLOCK[1], 1)[:, : shape[1]]


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 weight_scale_inv): each block's largest magnitude maps to 448,
    as DeepSeek's quantizer does."""
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // BLOCK[0]) * BLOCK[0], -(-cols // BLOCK[1]) * BLOCK[1])
    padded[:rows, :cols] = weight.float().abs()
    amax = padded.reshape(padded.shape[0] // BLOCK[0], BLOCK[0], padded.shape[1] // BLOCK[1], BLOCK[1]).amax((1, 3))
    scale = amax.clamp(min=1e-12) / 448.0
    fp8 = (weight.float() / _block_view(scale, weight.shape)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return fp8, scale


def _fp8_release(tmp_path, family: str = "deepseek_v3") -> tuple:
    """(FP8 checkpoint directory, transformers on its dequantized weights, FP8 tensor names)."""
    _checkpoint(family, tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    fp8_dir, dequantized_dir = tmp_path / "fp8", tmp_path / "dequantized"
    fp8_dir.mkdir(), dequantized_dir.mkdir()
    names = sorted(n for n in tensors if LINEAR.match(n))
    dequantized = dict(tensors)
    for name in names:
        fp8, scale = _quantize(tensors[name])
        tensors[name], tensors[name + "_scale_inv"] = fp8, scale
        dequantized[name] = (fp8.float() * _block_view(scale, fp8.shape)).to(torch.bfloat16)
    save_file(tensors, str(fp8_dir / "model.safetensors"))
    save_file(dequantized, str(dequantized_dir / "model.safetensors"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for directory, extra in ((fp8_dir, {"quantization_config": FP8}), (dequantized_dir, {})):
        (directory / "config.json").write_text(json.dumps({**config, **extra}))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (directory / name).write_bytes((tmp_path / "hf" / name).read_bytes())
    reference = transformers.AutoModelForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32).eval()
    return fp8_dir, reference, names


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return _fp8_release(tmp_path_factory.mktemp("deepseek_v3_fp8"))


def test_deepseek_v3_fp8_release_computes_transformers_logits_on_its_dequantized_weights(release, tmp_path):
    directory, reference, names = release
    with safe_open(str(directory / "model.safetensors"), "pt") as shard:
        assert shard.get_slice("model.layers.1.mlp.experts.7.down_proj.weight").get_dtype() == "F8_E4M3"
        assert shard.get_slice("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv").get_shape() == [3, 3]
        assert shard.get_slice("model.layers.1.mlp.gate.weight").get_dtype() == "BF16"
        assert "lm_head.weight_scale_inv" not in shard.keys()
    assert len(names) == 3 * 5 + 3 + 2 * (8 + 1) * 3  # attention, the dense MLP, routed + shared experts
    _assert_transformers_parity(directory, reference, tmp_path)


def test_qwen3_moe_fp8_release_computes_transformers_logits_on_its_dequantized_weights(tmp_path):
    """Qwen's -FP8 releases (Qwen3-30B-A3B-FP8) use DeepSeek's form: block-scaled E4M3 projections
    beside their weight_scale_inv, the router and embeddings in bf16; the same reader takes them."""
    directory, reference, names = _fp8_release(tmp_path / "release", "qwen3_moe")
    assert any(".self_attn.q_proj." in n for n in names) and any(".mlp.experts." in n for n in names)
    assert not any(n.endswith("mlp.gate.weight") for n in names)
    _assert_transformers_parity(directory, reference, tmp_path)


def _assert_transformers_parity(directory, reference, tmp_path) -> None:
    """`import-hf --quant bf16` of the FP8 directory: transformers' logits on the dequantized
    weights (test_hf_import's bound) and its greedy tokens, at 1 GB and at the minimum budget."""
    import_hf(directory, tmp_path / "fp8.coli", quant_scheme("bf16"))
    prompt = _prompt()
    expected = _hf_greedy(reference, prompt, STEPS)
    with torch.inference_mode():
        ref_logits = reference(torch.tensor([prompt + expected])).logits[0]
    options = dict(dtype="f32", max_context=CONTEXT, prefill_chunk=16)
    for budget in ("1GB", _minimum_budget(tmp_path / "fp8.coli", **options)):
        with Engine.open(tmp_path / "fp8.coli", ram_budget=budget, **options) as eng:
            diff = float((eng.logits(prompt + expected) - ref_logits).abs().max())
            assert diff < 1e-4 * max(1.0, float(ref_logits.abs().max())), (budget, diff)  # test_hf_import's bound
            assert eng.generate(prompt, STEPS, stop_token_ids=[]).token_ids == expected, budget


@pytest.mark.parametrize(
    "change, message",
    [
        ("drop_scale", "F8_E4M3 tensor 'model.layers.2.mlp.experts.4.gate_proj.weight' has no "
                       "'model.layers.2.mlp.experts.4.gate_proj.weight_scale_inv'"),
        ({**FP8, "fmt": "e5m2"}, "quantization_config.fmt='e5m2' is not supported"),
        ({**FP8, "activation_scheme": "static"}, "quantization_config.activation_scheme='static' is not supported"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True},
         "quantization_config.quant_method='bitsandbytes' is not supported"),
    ],
)
def test_a_broken_or_other_fp8_checkpoint_fails_with_one_error_and_no_file(release, tmp_path, change, message):
    directory = shutil.copytree(release[0], tmp_path / "fp8")
    if change == "drop_scale":
        tensors = load_file(str(directory / "model.safetensors"))
        del tensors["model.layers.2.mlp.experts.4.gate_proj.weight_scale_inv"]
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "quantization_config": change}))
    out = tmp_path / "out.coli"
    result = CliRunner().invoke(int4_cli, ["import-hf", str(directory), str(out), "--quant", "bf16"])
    assert result.exit_code == 2, result.output
    assert message in result.output and result.output.count("Error") == 1, result.output
    assert not out.exists() and not out.with_name("out.coli.tmp").exists()
