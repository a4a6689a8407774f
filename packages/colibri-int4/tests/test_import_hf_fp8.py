"""import-hf reads DeepSeek's own FP8 release without torch: F8_E4M3 weights beside their
`weight_scale_inv` block scales (safetensors written by hand here, as numpy has no float8) import
to exactly the container of the dequantized checkpoint; a missing or misshaped scale, an FP8
tensor without the config's quantization_config, a NaN code and the fp8 variants import-hf does
not read each fail with one error naming the tensor or field, and leave no output file.
(Logits against transformers on the dequantized weights: colibri-stream's test_hf_import_fp8.py.)"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
from colibri_int4 import HFImportError, export
from colibri_int4.fp8 import E4M3_VALUES, dequantize, scale_shape
from colibri_int4.import_hf import import_hf, planned_container, quant_scheme
from safetensors.numpy import load_file, save_file


def _sibling(filename: str):
    """A test module beside this one (pytest's importlib mode puts no test folder on sys.path)."""
    spec = importlib.util.spec_from_file_location(f"_fp8_{Path(filename).stem}", Path(__file__).with_name(filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_deepseek = _sibling("test_import_hf_deepseek.py")  # its tiny DeepSeek-V3 config and checkpoint writer
CONFIG, _write_checkpoint = _deepseek.CONFIG, _deepseek._write_checkpoint

BLOCK = [24, 20]  # not square and not dividing the tiny shapes: partial edge blocks in both axes
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": BLOCK}
# what DeepSeek-V3's release stores as FP8: every linear weight but the router (mlp.gate) and lm_head
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\..*_proj(_with_mqa)?\.weight$")
_POSITIVE = np.sort(E4M3_VALUES[:0x7F])  # codes 0..126: the finite non-negative values


def _encode(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes, fp32 scale_inv) of `w`: each block scaled so its largest magnitude is 448,
    each element the nearest code (what DeepSeek's quantizer does)."""
    rows, cols = w.shape
    scale = np.empty(scale_shape(w.shape, block), np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = max(float(np.abs(tile).max()), 1e-12) / 448.0
    full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:rows, :cols]
    scaled = w / full
    magnitude = np.abs(np.abs(scaled)[..., None] - _POSITIVE).argmin(-1)
    codes = np.searchsorted(E4M3_VALUES[:0x7F], _POSITIVE[magnitude]).astype(np.uint8)
    codes |= np.where(np.signbit(scaled), 0x80, 0).astype(np.uint8)
    return codes, scale


def save_with_fp8(tensors: dict[str, np.ndarray], fp8: set[str], path) -> None:
    """A safetensors file whose `fp8` tensors (uint8 codes here) are stored as F8_E4M3."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        dtype = "F8_E4M3" if name in fp8 else {np.float32: "F32", np.uint8: "U8"}[array.dtype.type]
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def _fp8_checkpoint(tmp_path, config=None, edit=None):
    """(FP8 directory, the same checkpoint dequantized in fp32): DeepSeek-V3's FP8 form of the
    tiny model; `edit(tensors, fp8)` changes the shard before it is written."""
    plain = _write_checkpoint(tmp_path / "plain", with_mtp=False)
    tensors = load_file(str(plain / "model.safetensors"))
    fp8, dequantized = set(), dict(tensors)
    for name in [n for n in tensors if LINEAR.match(n)]:
        codes, scale = _encode(tensors[name], BLOCK)
        tensors[name], tensors[name + "_scale_inv"] = codes, scale
        dequantized[name] = dequantize(codes, scale, BLOCK)
        fp8.add(name)
    if edit is not None:
        edit(tensors, fp8)
    directory = tmp_path / "fp8"
    directory.mkdir()
    save_with_fp8(tensors, fp8, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": config or FP8_CONFIG}))
    (directory / "tokenizer.json").write_bytes((plain / "tokenizer.json").read_bytes())
    save_file(dequantized, str(plain / "model.safetensors"))  # the reference: fp32 dequantized weights
    return directory, plain, fp8


@pytest.mark.parametrize("quant, row_blocks", [("bf16", False), ("int4", False), ("int4", True)])
def test_an_fp8_checkpoint_imports_to_the_container_of_its_dequantized_weights(tmp_path, monkeypatch, quant, row_blocks):
    if row_blocks:  # matrices read 7 (64 columns) or 14 (32 columns) rows at a time: across the 24-row blocks
        monkeypatch.setattr(export, "ROW_BLOCK_BYTES", 4 * 7 * 64)
    directory, dequantized, fp8 = _fp8_checkpoint(tmp_path)
    assert any("experts.7." in n for n in fp8) and any("shared_experts" in n for n in fp8)
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in fp8  # 40 rows: a 16-row edge block
    assert not any(n.endswith(("mlp.gate.weight", "embed_tokens.weight")) or n == "lm_head.weight" for n in fp8)
    report = import_hf(directory, tmp_path / "fp8.coli", quant_scheme(quant, 32), name="m")
    import_hf(dequantized, tmp_path / "dequantized.coli", quant_scheme(quant, 32), name="m")
    assert (tmp_path / "fp8.coli").read_bytes() == (tmp_path / "dequantized.coli").read_bytes()
    assert planned_container(directory, quant, 32).file_size == report.file_size
    shard = (directory / "model.safetensors").read_bytes()
    assert report.checkpoint_bytes == len(shard) - 8 - int.from_bytes(shard[:8], "little")  # codes and scales


def _drop_scale(tensors, fp8):
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]


def _misshape_scale(tensors, fp8):
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"  # [64, 96] in [24, 20] blocks: [3, 5]
    tensors[name] = np.ones((2, 5), np.float32)


def _orphan_scale(tensors, fp8):
    fp8.discard("model.layers.0.self_attn.o_proj.weight")
    tensors["model.layers.0.self_attn.o_proj.weight"] = dequantize(tensors["model.layers.0.self_attn.o_proj.weight"],
                                                                    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"],
                                                                    BLOCK)


def _nan_code(tensors, fp8):
    tensors["model.layers.1.mlp.experts.5.down_proj.weight"][3, 7] = 0xFF


def _three_d(tensors, fp8):
    tensors["model.layers.0.extra.weight"] = np.zeros((2, 2, 2), np.uint8)
    fp8.add("model.layers.0.extra.weight")


@pytest.mark.parametrize(
    "edit, message",
    [
        (_drop_scale, r"model\.safetensors: F8_E4M3 tensor 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight' "
                      r"has no 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight_scale_inv'"),
        (_misshape_scale, r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight_scale_inv' is F32 "
                          r"\[2, 5\]; 'model\.layers\.0\.mlp\.down_proj\.weight' \[64, 96\] in blocks of \[24, 20\] "
                          r"needs float \[3, 5\]"),
        (_orphan_scale, r"tensor 'model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv' has no F8_E4M3 tensor"),
        (_nan_code, r"tensor 'model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight' \(rows 0:64\) is NaN or infinite"),
        (_three_d, r"F8_E4M3 tensor 'model\.layers\.0\.extra\.weight' has shape \[2, 2, 2\]; .* 2-D"),
    ],
)
def test_a_broken_fp8_shard_fails_naming_the_tensor_and_writes_nothing(tmp_path, edit, message):
    directory, _, _ = _fp8_checkpoint(tmp_path, edit=edit)
    out = tmp_path / "out.coli"
    with pytest.raises(HFImportError, match=message):
        import_hf(directory, out, quant_scheme("int4", 32))
    assert not out.exists() and not out.with_name("out.coli.tmp").exists()


@pytest.mark.parametrize(
    "config, message",
    [
        ({**FP8_CONFIG, "fmt": "e5m2"}, r"config\.json: quantization_config\.fmt='e5m2' is not supported"),
        ({**FP8_CONFIG, "activation_scheme": "static"},
         r"config\.json: quantization_config\.activation_scheme='static' is not supported"),
        ({**FP8_CONFIG, "weight_block_size": None}, r"quantization_config\.weight_block_size=None is not supported"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
         r"quantization_config\.quant_method='compressed-tensors' is not supported"),
    ],
)
def test_fp8_variants_import_hf_does_not_read_are_refused_by_name_and_writes_nothing(tmp_path, config, message):
    directory, _, _ = _fp8_checkpoint(tmp_path, config=config)
    out = tmp_path / "out.coli"
    with pytest.raises(HFImportError, match=message):
        import_hf(directory, out, quant_scheme("bf16"))
    assert not out.exists()


def test_fp8_tensors_under_a_config_without_quantization_config_are_refused(tmp_path):
    directory, _, _ = _fp8_checkpoint(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFImportError, match=r"model\.safetensors: tensor '.*' is F8_E4M3 but .*config\.json has no "
                                             "quantization_config"):
        import_hf(directory, tmp_path / "out.coli", quant_scheme("bf16"))
    assert not (tmp_path / "out.coli").exists()
