"""The `quantization_config` of a block-scaled FP8 E4M3 release (DeepSeek-V3/R1's own, Qwen3's
-FP8 releases): which ones the HF import reads, refused by key and value otherwise. Decoding the
weights is colibri-int4's (`colibri_int4/fp8.py`, FP8.md)."""

from __future__ import annotations

from ..errors import FP8ConfigError

__all__ = ["FP8ConfigError", "parse_quantization_config"]


def parse_quantization_config(config: dict) -> tuple[int, int]:
    """The block size `[B0, B1]` of an FP8 block-scaled quantization_config; an `FP8ConfigError`
    (key, value, why) for anything else (another method, format, activation scheme, a
    per-tensor or malformed block size, or a key this reader does not know)."""
    if not isinstance(config, dict):
        raise FP8ConfigError("quantization_config", config, "expected an object")
    method = config.get("quant_method")
    if method != "fp8":
        raise FP8ConfigError("quantization_config.quant_method", method, "only DeepSeek's block-scaled 'fp8' is read")
    fmt = config.get("fmt", "e4m3")  # transformers' FineGrainedFP8Config does not write it: always e4m3
    if fmt != "e4m3":
        raise FP8ConfigError("quantization_config.fmt", fmt, "only 'e4m3' (E4M3FN) is decoded")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise FP8ConfigError("quantization_config.activation_scheme", scheme,
                         "only 'dynamic' (static activation scales would change the forward)")
    block = config.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise FP8ConfigError("quantization_config.weight_block_size", block, "expected two integers >= 1 [rows, cols]")
    # modules_to_not_convert lists the bf16 modules; which weights are FP8 is read from the
    # shards themselves (an F8_E4M3 tensor with its weight_scale_inv), so it is not needed
    known = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}
    for key in config:
        if key not in known:
            raise FP8ConfigError(f"quantization_config.{key}", config[key], "a field the FP8 reader does not know")
    return int(block[0]), int(block[1])
