"""How far each int4 grouping moves a GGUF file's own weights: relative RMS error of re-quantizing
tensors of the file (gguf-py's dequantized values) into int4 groups of 64 or 32, symmetric or with
zeros, bf16 or fp16 scales, against those values. A 4-bit block the grouping holds exactly (Q4_0 in
symmetric groups of 32; Q4_1 and Q4_K in asymmetric ones, which keep the step their values lie on)
comes back unchanged up to its 16-bit scale; import-gguf keeps that grouping by default
(colibri_int4/import_gguf/file_grid.py).

    python bench/gguf_grid.py FILE.gguf [--tensors blk.0.ffn_gate_exps.weight,blk.0.attn_q.weight] [--rows 4096]

Without --tensors: every 2-D-or-more tensor of block 0. Prints JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from colibri_int4.import_gguf import EXACT_GRIDS
from colibri_int4.quantize import dequantize_q4, quantize_q4
from gguf import GGUFReader
from gguf.quants import dequantize

GROUPINGS = [(64, True, "bf16"), (32, True, "bf16"), (32, True, "fp16"), (32, False, "bf16"), (32, False, "fp16")]


def relative_rms(values: np.ndarray, group: int, symmetric: bool, scale_dtype: str) -> float:
    q = quantize_q4(values, group, symmetric, scale_dtype)
    back = dequantize_q4(q.data, q.scales, q.zeros, group, scale_dtype)
    return float(np.sqrt(np.mean((back - values) ** 2) / np.mean(values ** 2)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf")
    parser.add_argument("--tensors", default=None, help="Comma-separated tensor names [default: block 0's].")
    parser.add_argument("--rows", type=int, default=4096, help="Rows of each tensor measured (the first ones).")
    args = parser.parse_args()
    reader = GGUFReader(args.gguf)
    wanted = args.tensors.split(",") if args.tensors else None
    out = {"file": args.gguf, "tensors": []}
    for tensor in reader.tensors:
        if wanted is not None and tensor.name not in wanted:
            continue
        if wanted is None and (not tensor.name.startswith("blk.0.") or len(tensor.shape) < 2):
            continue
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        values = values.reshape(-1, values.shape[-1])[: args.rows]
        kind = tensor.tensor_type.name
        row = {"name": tensor.name, "type": kind, "rows": int(values.shape[0]), "cols": int(values.shape[1]),
               "kept_by_import_gguf": EXACT_GRIDS.get(kind)}
        for group, symmetric, scale_dtype in GROUPINGS:
            if values.shape[1] % group == 0:
                label = f"g{group} {'sym' if symmetric else 'asym'} {scale_dtype}"
                row[label] = round(relative_rms(values, group, symmetric, scale_dtype), 5)
        out["tensors"].append(row)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
