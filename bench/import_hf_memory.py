"""Peak RSS of `colibri-int4 import-hf` against the size of the checkpoint it converts.

Writes a synthetic Hugging Face Qwen3-MoE directory with Qwen3-30B-A3B's real tensor shapes
(vocab 151,936 x 2048 embedding and LM head, 32 heads x 128 / 4 KV heads, 128 experts of
768 x 2048 per layer) but only `--layers` layers, in bf16, sharded like the Hub
(model-0000k-of-0000n.safetensors + index), written tensor by tensor so the generator itself
stays small. Then imports it in a fresh interpreter per `--quant` and reads VmHWM (the peak RSS
of that process image; ru_maxrss would keep the parent's high-water mark across exec).

    python bench/import_hf_memory.py --layers 2 --quant int4 bf16

Prints JSON: checkpoint bytes, container bytes, peak RSS, the interpreter's RSS after imports,
seconds and MB/s per quant. Needs about 2.6 GB + 1.2 GB per layer of free disk.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from colibri_int4.checkpoint import SafetensorsWriter

SHAPE = dict(vocab=151936, d=2048, heads=32, kv_heads=4, head_dim=128, experts=128, expert_dim=768)


def hf_tensors(layers: int) -> dict[str, tuple[int, ...]]:
    s = SHAPE
    out = {"model.embed_tokens.weight": (s["vocab"], s["d"])}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (s["d"],), p + "post_attention_layernorm.weight": (s["d"],),
                p + "self_attn.q_proj.weight": (s["heads"] * s["head_dim"], s["d"]),
                p + "self_attn.k_proj.weight": (s["kv_heads"] * s["head_dim"], s["d"]),
                p + "self_attn.v_proj.weight": (s["kv_heads"] * s["head_dim"], s["d"]),
                p + "self_attn.o_proj.weight": (s["d"], s["heads"] * s["head_dim"]),
                p + "self_attn.q_norm.weight": (s["head_dim"],), p + "self_attn.k_norm.weight": (s["head_dim"],),
                p + "mlp.gate.weight": (s["experts"], s["d"])}
        for e in range(s["experts"]):
            q = p + f"mlp.experts.{e}."
            out |= {q + "gate_proj.weight": (s["expert_dim"], s["d"]), q + "up_proj.weight": (s["expert_dim"], s["d"]),
                    q + "down_proj.weight": (s["d"], s["expert_dim"])}
    out |= {"model.norm.weight": (s["d"],), "lm_head.weight": (s["vocab"], s["d"])}
    return out


def write_checkpoint(directory: Path, layers: int) -> int:
    directory.mkdir(parents=True)
    s = SHAPE
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": s["vocab"],
              "hidden_size": s["d"], "intermediate_size": 6144, "moe_intermediate_size": s["expert_dim"],
              "num_hidden_layers": layers, "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
              "head_dim": s["head_dim"], "num_experts": s["experts"], "num_experts_per_tok": 8, "norm_topk_prob": True,
              "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
              "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
              "sliding_window": None, "max_window_layers": layers, "mlp_only_layers": [], "decoder_sparse_step": 1,
              "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel",
                                                          "vocab": {"a": 0}, "unk_token": "a"}}))
    names = hf_tensors(layers)
    # shards of about 1 GB in name order, as the Hub's are
    shards, current, size = [], [], 0
    for name, dims in names.items():
        current.append(name)
        size += 2 * int(np.prod(dims))
        if size > 1 << 30:
            shards.append(current)
            current, size = [], 0
    shards.append(current) if current else None
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    for k, members in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsWriter(directory / file, {n: (names[n], "BF16") for n in members}, {"format": "pt"})
        for name in members:
            dims = names[name]
            if len(dims) == 1:
                writer.write(name, np.ones(dims, np.float32))
            else:  # row blocks of random values: the generator never holds a 1.2 GB matrix
                step = max(1, (8 << 20) // dims[1])
                for lo in range(0, dims[0], step):
                    rows = rng.standard_normal((min(step, dims[0] - lo), dims[1]), dtype=np.float32) * 0.02
                    writer.write_rows(name, rows, lo)
            total += 2 * int(np.prod(dims))
            weight_map[name] = file
        writer.close()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                         "weight_map": weight_map}))
    return total


HWM = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024"


def measure(hf_dir: Path, out: Path, quant: str) -> dict:
    code = ("import sys, time; from colibri_int4.import_hf import import_hf, quant_scheme; "
            f"before = {HWM}; t = time.perf_counter(); "
            "r = import_hf(sys.argv[1], sys.argv[2], quant_scheme(sys.argv[3])); "
            f"print(before, {HWM}, time.perf_counter() - t, r.checkpoint_bytes)")
    run = subprocess.run([sys.executable, "-c", code, str(hf_dir), str(out), quant], check=True,
                         capture_output=True, text=True)
    before, peak, seconds, checkpoint = run.stdout.split()
    result = {"quant": quant, "checkpoint_bytes": int(checkpoint), "container_bytes": out.stat().st_size,
              "rss_after_imports_bytes": int(before), "peak_rss_bytes": int(peak), "seconds": round(float(seconds), 1),
              "mb_per_s": round(int(checkpoint) / 1e6 / float(seconds), 1)}
    result["peak_rss_over_checkpoint"] = round(int(peak) / int(checkpoint), 4)
    out.unlink()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--quant", nargs="+", default=["int4", "bf16"], choices=["int4", "int8", "bf16"])
    parser.add_argument("--workdir", default=None, help="where to write the checkpoint [default: a temp dir]")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="import-hf-memory-", dir=args.workdir) as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        size = write_checkpoint(work / "hf", args.layers)
        results = {"layers": args.layers, "shape": SHAPE, "checkpoint_bytes": size,
                   "generate_seconds": round(time.perf_counter() - started, 1),
                   "runs": [measure(work / "hf", work / "out.coli", quant) for quant in args.quant]}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
