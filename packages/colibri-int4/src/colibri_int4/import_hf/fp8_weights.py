"""The FP8 weights of a checkpoint directory (DeepSeek-V3/R1's own release; the format: fp8.py):
each F8_E4M3 tensor `X.weight` paired with its `X.weight_scale_inv`, read back as fp32.

Which weights are FP8 is read from the shards, not from `modules_to_not_convert`: a tensor is
FP8 exactly when its dtype is F8_E4M3 (DeepSeek-V3: the linear weights of attention, the dense
MLPs, the shared and routed experts; embeddings, norms, the router and lm_head stay bf16). The
pairing is checked when the directory is opened, from the headers alone: an F8_E4M3 tensor
without its scale, a scale of the wrong shape or dtype, a scale beside a tensor that is not
FP8, or FP8 tensors under a config.json without an fp8 quantization_config each fail there,
naming the tensor and its file. A read decodes only the rows asked for (one `pread` of their
codes, the scale tensor is a few KB), so the import's memory stays one expert or one block of
rows, as for bf16 checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..checkpoint import SafetensorsFile
from ..errors import HFImportError
from ..fp8 import FP8ConfigError, dequantize, parse_quantization_config, scale_shape

FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
_SCALE_DTYPES = ("F32", "BF16", "F16")


def block_size(config: dict, config_path: Path, first_fp8: str, shard: Path) -> tuple[int, int]:
    """`weight_block_size` of config.json's quantization_config, which must be DeepSeek's fp8."""
    quantization = config.get("quantization_config")
    if quantization is None:
        raise HFImportError(f"{shard}: tensor '{first_fp8}' is {FP8_DTYPE} but {config_path} has no "
                            "quantization_config (an FP8 checkpoint states its weight_block_size there)")
    try:
        return parse_quantization_config(quantization)
    except FP8ConfigError as exc:
        raise HFImportError(f"{config_path}: {exc}") from None


class FP8Weights:
    """The FP8 tensors among `where` (tensor name -> its shard) and their scales."""

    def __init__(self, where: dict[str, SafetensorsFile], config: dict, config_path: Path):
        self._where = where
        self.scales: dict[str, str] = {}  # FP8 weight -> its weight_scale_inv
        fp8 = sorted(name for name, shard in where.items() if shard.entries[name][0] == FP8_DTYPE)
        self.block = block_size(config, config_path, fp8[0], where[fp8[0]].path) if fp8 else None
        for name in fp8:
            self.scales[name] = self._check_pair(name)
        for name, shard in where.items():
            if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] not in self.scales:
                raise HFImportError(f"{shard.path}: tensor '{name}' has no {FP8_DTYPE} tensor "
                                    f"'{name[: -len(SCALE_SUFFIX)]}' to scale")

    def _check_pair(self, name: str) -> str:
        shard, scale = self._where[name], name + SCALE_SUFFIX
        dims = shard.entries[name][1]
        if len(dims) != 2:
            raise HFImportError(f"{shard.path}: {FP8_DTYPE} tensor '{name}' has shape {list(dims)}; "
                                "block-scaled FP8 weights are 2-D")
        if scale not in self._where:
            raise HFImportError(f"{shard.path}: {FP8_DTYPE} tensor '{name}' has no '{scale}' "
                                "(its block scales); the checkpoint is incomplete")
        expected = scale_shape(dims, self.block)
        scale_dtype, scale_dims = self._where[scale].entries[scale][:2]
        if scale_dims != expected or scale_dtype not in _SCALE_DTYPES:
            raise HFImportError(
                f"{self._where[scale].path}: tensor '{scale}' is {scale_dtype} {list(scale_dims)}; "
                f"'{name}' {list(dims)} in blocks of {list(self.block)} needs float {list(expected)}")
        return scale

    def rows(self, name: str, start: int, stop: int) -> tuple[np.ndarray, int]:
        """(fp32 rows `start:stop` of FP8 weight `name`, bytes read for them, scale included)."""
        shard, scale_name = self._where[name], self.scales[name]
        rows = shard.entries[name][1][0]
        stop = min(stop, rows)
        scale = self._where[scale_name].read(scale_name)
        values = dequantize(shard.read_rows(name, start, stop), scale, self.block, first_row=start)
        if not np.isfinite(values).all():  # a NaN code (0x7F/0xFF) or a non-finite scale
            raise HFImportError(f"{shard.path}: tensor '{name}' (rows {start}:{stop}) is NaN or infinite "
                                f"after applying '{scale_name}'")
        nbytes = (shard.nbytes(name) + self._where[scale_name].nbytes(scale_name)) * (stop - start) // max(rows, 1)
        return values, nbytes
