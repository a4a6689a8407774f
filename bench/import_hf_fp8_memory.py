"""Peak RSS of `import-hf` on DeepSeek-V3's FP8 release form, against the checkpoint's size.

Writes a synthetic Hugging Face DeepSeek-V3 directory with the published config.json
(packages/colibri-stream/tests/fixtures/deepseek_v3: hidden 7168, MLA with q/kv latents of
1536/512, 128 heads, dense layers of 18432 (here only the first), routed and shared experts of 2048 x 7168,
fp8 quantization_config in 128 x 128 blocks) but only `--layers` layers, `--experts` routed
experts per MoE layer and a `--vocab` of its choosing. Every projection is stored as F8_E4M3
with its F32 `weight_scale_inv`, and the embeddings, norms, router and lm_head as BF16, as the
release stores them, in shards of about 1 GB with an index. With `--dtype bf16` the same
model is written with bf16 projections and no scales, for comparison. The values are random
bytes, which is enough for memory and time. The import then runs in a fresh interpreter per
`--quant`, measured by `import_hf_memory.measure` (VmHWM).

    python bench/import_hf_fp8_memory.py --layers 3 --experts 16 --quant int4 bf16

Prints JSON in the form of import_hf_memory.py's output.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from import_hf_memory import measure

FIXTURE = Path(__file__).parents[1] / "packages/colibri-stream/tests/fixtures/deepseek_v3/config.json"
BLOCK = 128
CHUNK = 8 << 20  # bytes of random data generated once and repeated


def tensors(config: dict, fp8: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, safetensors dtype) of DeepSeek-V3's tensors under `config`."""
    d, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    linear = "F8_E4M3" if fp8 else "BF16"
    out: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((config["vocab_size"], d), "BF16")}

    def add_linear(name: str, rows: int, cols: int) -> None:
        out[name] = ((rows, cols), linear)
        if fp8:
            out[name + "_scale_inv"] = ((-(-rows // BLOCK), -(-cols // BLOCK)), "F32")

    def add_mlp(prefix: str, hidden: int) -> None:
        add_linear(prefix + "gate_proj.weight", hidden, d)
        add_linear(prefix + "up_proj.weight", hidden, d)
        add_linear(prefix + "down_proj.weight", d, hidden)

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((d,), "BF16")
        out[p + "post_attention_layernorm.weight"] = ((d,), "BF16")
        add_linear(p + "self_attn.q_a_proj.weight", q_rank, d)
        out[p + "self_attn.q_a_layernorm.weight"] = ((q_rank,), "BF16")
        add_linear(p + "self_attn.q_b_proj.weight", heads * (nope + rope), q_rank)
        add_linear(p + "self_attn.kv_a_proj_with_mqa.weight", kv_rank + rope, d)
        out[p + "self_attn.kv_a_layernorm.weight"] = ((kv_rank,), "BF16")
        add_linear(p + "self_attn.kv_b_proj.weight", heads * (nope + v), kv_rank)
        add_linear(p + "self_attn.o_proj.weight", d, heads * v)
        if i < config["first_k_dense_replace"]:
            add_mlp(p + "mlp.", config["intermediate_size"])
            continue
        n, f = config["n_routed_experts"], config["moe_intermediate_size"]
        out[p + "mlp.gate.weight"] = ((n, d), "BF16")
        out[p + "mlp.gate.e_score_correction_bias"] = ((n,), "F32")
        for e in range(n):
            add_mlp(p + f"mlp.experts.{e}.", f)
        add_mlp(p + "mlp.shared_experts.", config["n_shared_experts"] * f)
    out["model.norm.weight"] = ((d,), "BF16")
    out["lm_head.weight"] = ((config["vocab_size"], d), "BF16")
    return out


def _random_bytes(dtype: str, rng) -> bytes:
    if dtype == "F8_E4M3":  # every finite code (0x7F / 0xFF are NaN)
        codes = rng.integers(0, 0x7F, CHUNK, dtype=np.uint8) | (rng.integers(0, 2, CHUNK, dtype=np.uint8) << 7)
        return codes.tobytes()
    if dtype == "BF16":
        values = rng.standard_normal(CHUNK // 2, dtype=np.float32) * 0.02
        return (values.view(np.uint32) >> 16).astype("<u2").tobytes()  # truncated to bf16
    return rng.uniform(1e-5, 1e-4, CHUNK // 4).astype("<f4").tobytes()  # F32: scales, the router bias


def write_shard(path: Path, members: dict[str, tuple[tuple[int, ...], str]], data: dict[str, bytes]) -> int:
    itemsize = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
    header, cursor = {"__metadata__": {"format": "pt"}}, 0
    for name, (dims, dtype) in members.items():
        size = int(np.prod(dims)) * itemsize[dtype]
        header[name] = {"dtype": dtype, "shape": list(dims), "data_offsets": [cursor, cursor + size]}
        cursor += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for dims, dtype in members.values():
            left = int(np.prod(dims)) * itemsize[dtype]
            while left:
                piece = data[dtype][: min(left, CHUNK)]
                f.write(piece)
                left -= len(piece)
    return cursor


def write_checkpoint(directory: Path, config: dict, fp8: bool) -> int:
    directory.mkdir(parents=True)
    if not fp8:
        config = {k: v for k, v in config.items() if k != "quantization_config"}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel",
                                                          "vocab": {"a": 0}, "unk_token": "a"}}))
    rng = np.random.default_rng(0)
    data = {dtype: _random_bytes(dtype, rng) for dtype in ("F8_E4M3", "BF16", "F32")}
    names = tensors(config, fp8)
    shards, current, size = [], {}, 0
    for name, (dims, dtype) in names.items():  # ~1 GB shards in name order, a scale beside its weight
        current[name] = (dims, dtype)
        size += int(np.prod(dims)) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[dtype]
        if size > 1 << 30 and name + "_scale_inv" not in names:
            shards.append(current)
            current, size = {}, 0
    shards.append(current) if current else None
    weight_map, total = {}, 0
    for k, members in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_shard(directory / file, members, data)
        weight_map.update(dict.fromkeys(members, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                         "weight_map": weight_map}))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3, help="decoder layers (the first is dense)")
    parser.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer (the release: 256)")
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="how the projections are stored")
    parser.add_argument("--quant", nargs="+", default=["int4"], choices=["int4", "int8", "bf16"])
    parser.add_argument("--workdir", default=None, help="where to write the checkpoint [default: a temp dir]")
    args = parser.parse_args()
    config = json.loads(FIXTURE.read_text())
    config.update(num_hidden_layers=args.layers, n_routed_experts=args.experts, vocab_size=args.vocab,
                  num_nextn_predict_layers=0, n_group=min(config["n_group"], args.experts),
                  first_k_dense_replace=1)  # the release: 3 dense layers of its 61
    config["topk_group"] = min(config["topk_group"], config["n_group"])
    with tempfile.TemporaryDirectory(prefix="import-hf-fp8-memory-", dir=args.workdir) as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        size = write_checkpoint(work / "hf", config, args.dtype == "fp8")
        results = {"layers": args.layers, "experts": args.experts, "vocab": args.vocab, "dtype": args.dtype,
                   "checkpoint_bytes": size, "generate_seconds": round(time.perf_counter() - started, 1),
                   "runs": [measure(work / "hf", work / "out.coli", quant) for quant in args.quant]}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
