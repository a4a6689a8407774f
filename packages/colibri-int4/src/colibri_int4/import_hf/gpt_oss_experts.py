"""GPT-OSS's routed experts, read one expert at a time into Colibri's layout.

GPT-OSS stacks each layer's experts under `model.layers.{i}.mlp.experts.` in one of two forms:

    bf16/f32 (save_pretrained of a transformers model):
        gate_up_proj [E, d, 2F]   `x @ W` layout (in x out); gate and up INTERLEAVED on the last
                                  axis: column 2j is gate row j, column 2j + 1 up row j
        down_proj    [E, F, d]    in x out
    MXFP4 (the published checkpoints, quantization_config.quant_method "mxfp4"; mxfp4.py):
        gate_up_proj_blocks [E, 2F, d/32, 16] + gate_up_proj_scales [E, 2F, d/32]   out x in
        down_proj_blocks    [E, d, F/32, 16]  + down_proj_scales    [E, d, F/32]
    and in both:
        gate_up_proj_bias [E, 2F] (interleaved like its matrix), down_proj_bias [E, d]

`read_expert` gives Colibri's `[gate [F, d], up [F, d], down [d, F], gate_bias [F], up_bias [F],
down_bias [d]]` in fp32, so the exporter re-quantizes MXFP4 experts to the container's int4,
int8 or bf16 like any other weight (MXFP4 values are exact in bf16: 2 significant bits).
"""

from __future__ import annotations

import numpy as np

from ..errors import HFImportError
from ..mxfp4 import BLOCK, decode_mxfp4
from .hf_directory import HFDirectory


def _prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts."


def is_mxfp4(hf: HFDirectory, layer: int) -> bool:
    return _prefix(layer) + "gate_up_proj_blocks" in hf.names


def check_layer(hf: HFDirectory, layer: int, n_experts: int, expert_dim: int, d: int) -> set[str]:
    """The HF tensor names of one layer's experts, each checked for its shape (either form)."""
    p, F = _prefix(layer), expert_dim
    if is_mxfp4(hf, layer):
        for cols in (d, F):
            if cols % BLOCK:
                raise HFImportError(f"{hf.path}: MXFP4 experts need widths that are multiples of {BLOCK}, got {cols}")
        expected = {
            "gate_up_proj_blocks": (n_experts, 2 * F, d // BLOCK, BLOCK // 2),
            "gate_up_proj_scales": (n_experts, 2 * F, d // BLOCK),
            "down_proj_blocks": (n_experts, d, F // BLOCK, BLOCK // 2),
            "down_proj_scales": (n_experts, d, F // BLOCK),
        }
    else:
        expected = {"gate_up_proj": (n_experts, d, 2 * F), "down_proj": (n_experts, F, d)}
    expected.update(gate_up_proj_bias=(n_experts, 2 * F), down_proj_bias=(n_experts, d))
    for name, dims in expected.items():
        if p + name not in hf.names:
            raise HFImportError(f"{hf.path}: tensor '{p + name}' is missing (layer {layer} experts)")
        if hf.shape(p + name) != dims:
            raise HFImportError(f"{hf.path}: tensor '{p + name}' has shape {list(hf.shape(p + name))}, "
                                f"config.json implies {list(dims)}")
    return {p + name for name in expected}


def read_expert(hf: HFDirectory, layer: int, expert: int) -> tuple[list[np.ndarray], int]:
    """One expert in Colibri's layout and the checkpoint bytes read for it (fp32 arrays)."""
    p, nbytes = _prefix(layer), 0

    def read(name: str) -> np.ndarray:
        nonlocal nbytes
        array, n = hf.tensor(p + name, index=expert)
        nbytes += n
        return array

    if is_mxfp4(hf, layer):
        try:
            gate_up = decode_mxfp4(read("gate_up_proj_blocks"), read("gate_up_proj_scales"))  # [2F, d]
            down = decode_mxfp4(read("down_proj_blocks"), read("down_proj_scales"))  # [d, F]
        except ValueError as exc:
            raise HFImportError(f"{hf.path}: layer {layer} expert {expert}: {exc}") from None
    else:
        gate_up, down = read("gate_up_proj").T, read("down_proj").T  # to out x in
    bias = read("gate_up_proj_bias")
    out = [gate_up[0::2], gate_up[1::2], down, bias[0::2], bias[1::2], read("down_proj_bias")]
    return [np.ascontiguousarray(a, dtype=np.float32) for a in out], nbytes
