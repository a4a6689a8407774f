"""int4 container benchmarks: quality (perplexity delta per scheme), sizes per preset, export memory.

    # perplexity of a trained checkpoint vs its int4 exports (group 32/64/128 x sym/asym)
    python bench/int4_quality.py quality --checkpoint CKPT_DIR --tokens TOKENS
    # no trained checkpoint at hand: train the tiny preset briefly on the first 90% of the tokens
    python bench/int4_quality.py quality --train-steps 400 --tokens corpus.txt
    # container sizes of every colibri_model preset, per scheme
    python bench/int4_quality.py sizes
    # peak RSS of a streaming export vs the size of a synthetic checkpoint
    python bench/int4_quality.py memory --moe-layers 5

TOKENS is a colibri token shard (CLBTOKS), a .npy / raw uint16 .bin array of token ids, or a
.txt file (tokenized with colibri_model's default tokenizer). Perplexity is measured on
non-overlapping windows of the last 10% of the tokens. Every result is printed as JSON; the
quality rows compare the exported model with the original in the same process (a ratio).
The per-tensor error summary (relative RMSE per tensor type) comes from colibri_int4 alone.
This is a bench script: it imports colibri_model (torch); colibri_int4 itself never does.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from colibri_int4 import QuantScheme, dequantize_container, estimate_container_size, export_checkpoint
from colibri_int4.checkpoint import SafetensorsWriter
from colibri_int4.error_report import tensor_error_summary
from colibri_int4.model_shape import ModelShape, checkpoint_tensor_shapes

SCHEMES = [(g, sym) for g in (32, 64, 128) for sym in (True, False)]


# --- tokens and perplexity ---------------------------------------------------------------------
def load_tokens(path: Path) -> np.ndarray:
    raw = path.read_bytes()[:8]
    if raw == b"CLBTOKS\0":
        from colibri_model.data.shards import read_shard

        return np.asarray(read_shard(path), dtype=np.int64)
    if path.suffix == ".npy":
        return np.load(path).astype(np.int64)
    if path.suffix == ".txt":
        from colibri_model import load_tokenizer

        return np.asarray(load_tokenizer().encode(path.read_text(encoding="utf-8")).ids, dtype=np.int64)
    return np.fromfile(path, dtype="<u2").astype(np.int64)


def perplexity(checkpoint: Path, tokens: np.ndarray, seq_len: int, batch: int) -> float:
    import torch
    from colibri_model import ColibriForCausalLM

    model = ColibriForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    n = (len(tokens) - 1) // seq_len
    inputs = torch.from_numpy(tokens[: n * seq_len].reshape(n, seq_len))
    targets = torch.from_numpy(tokens[1 : n * seq_len + 1].reshape(n, seq_len))
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, batch):
            out = model(inputs[i : i + batch], targets=targets[i : i + batch])
            total += float(out.lm_loss) * len(inputs[i : i + batch])
    return math.exp(total / n)


def train_tiny(tokens: np.ndarray, steps: int, seq_len: int, out: Path) -> Path:
    """A short AdamW run of the tiny preset, so the quality table has a trained model to test."""
    import torch
    from colibri_model import ColibriForCausalLM, get_preset, load_tokenizer
    from colibri_model.tokenizer import tokenizer_json

    torch.manual_seed(0)
    model = ColibriForCausalLM(get_preset("tiny", max_seq_len=max(seq_len, 128))).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = np.random.default_rng(0)
    for step in range(steps):
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=8)
        x = torch.from_numpy(np.stack([tokens[s : s + seq_len] for s in starts]))
        y = torch.from_numpy(np.stack([tokens[s + 1 : s + seq_len + 1] for s in starts]))
        for group in opt.param_groups:  # linear warmup then cosine
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = model(x, targets=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(json.dumps({"train_step": step, "loss": round(float(loss.detach()), 4)}), file=sys.stderr)
    model.save_pretrained(out, tokenizer_json=tokenizer_json(load_tokenizer()))
    return out


def quality(args) -> dict:
    tokens = load_tokens(Path(args.tokens))
    split = int(len(tokens) * 0.9)
    train_tokens, val_tokens = tokens[:split], tokens[split:][: args.max_eval_tokens]
    work = Path(tempfile.mkdtemp(prefix="int4-quality-"))
    trained_dir = Path(args.save_trained) if args.save_trained else work / "trained"
    checkpoint = Path(args.checkpoint) if args.checkpoint else train_tiny(train_tokens, args.train_steps, args.seq_len, trained_dir)
    base = perplexity(checkpoint, val_tokens, args.seq_len, args.batch)
    rows = []
    for group, symmetric in SCHEMES:
        for resident, embed in ((args.resident_dtype, args.embed_dtype),) + ((("int4", "int4"),) if group == 64 and symmetric else ()):
            scheme = QuantScheme(group_size=group, symmetric=symmetric, resident_dtype=resident, embed_dtype=embed)
            coli, back = work / f"g{group}{'s' if symmetric else 'a'}{resident}{embed}.coli", work / "back"
            report = export_checkpoint(checkpoint, coli, scheme)
            dequantize_container(coli, back)
            ppl = perplexity(back, val_tokens, args.seq_len, args.batch)
            errors = tensor_error_summary(checkpoint, coli)
            est = estimate_container_size(json.loads((checkpoint / "config.json").read_text()), scheme)
            rows.append({
                "group": group, "symmetric": symmetric, "resident_dtype": resident, "embed_dtype": embed,
                "ppl": round(ppl, 4), "ppl_delta_pct": round(100 * (ppl / base - 1), 3),
                "expert_bits_per_weight_payload": scheme.expert_bits_per_weight(),
                "expert_bits_per_weight_file": round(est.bits_per_weight, 3),
                "file_bits_per_weight": round(8 * report.file_size / est.total_params, 3),
                "file_bytes": report.file_size,
                "relative_rmse": {k: round(v["relative_rmse"], 5) for k, v in sorted(errors.items())},
            })
            print(json.dumps(rows[-1]), file=sys.stderr)
    shutil.rmtree(work / "back", ignore_errors=True)
    for coli in work.glob("*.coli"):
        coli.unlink()
    return {"checkpoint": str(checkpoint), "eval_tokens": int(len(val_tokens)), "seq_len": args.seq_len,
            "baseline_ppl": round(base, 4), "rows": rows}


# --- sizes ---------------------------------------------------------------------------------------
def sizes(_args) -> dict:
    from colibri_model import PRESETS, get_preset

    out = {}
    for name in PRESETS:
        config = json.loads(get_preset(name).model_dump_json())
        for label, scheme in {
            "g64-sym int8 resident, bf16 embed (default)": QuantScheme(),
            "g64-sym all int4": QuantScheme(resident_dtype="int4", embed_dtype="int4"),
            "g64-asym all int4": QuantScheme(symmetric=False, resident_dtype="int4", embed_dtype="int4"),
            "g64-sym bf16 resident": QuantScheme(resident_dtype="bf16", embed_dtype="bf16"),
        }.items():
            est = estimate_container_size(config, scheme)
            out[f"{name} / {label}"] = {
                "file_GB": round(est.file_size / 1e9, 3), "file_GiB": round(est.file_size / 2**30, 3),
                "resident_MB": round(est.resident_bytes / 1e6, 1), "experts_GB": round(est.expert_bytes / 1e9, 3),
                "expert_bits_per_weight": round(est.bits_per_weight, 3),
                "file_bits_per_weight": round(est.bits_per_weight_total, 3),
                "total_params": est.total_params,
            }
    return out


# --- export memory -------------------------------------------------------------------------------
def write_synthetic(directory: Path, moe_layers: int) -> int:
    """A nano-shaped checkpoint (d 1024, 64 x 512 experts) with `moe_layers` MoE layers, written
    tensor by tensor so that the generator itself stays small."""
    config = {"schema_version": "1.0", "format_version": "1.0", "model_type": "colibri", "vocab_size": 49152,
              "d_model": 1024, "n_layers": moe_layers + 1, "n_dense_layers": 1, "n_heads": 16, "n_kv_heads": 4,
              "head_dim": 64, "qk_norm": True, "dense_ffn_dim": 3072, "n_experts": 64, "expert_dim": 512,
              "shared_expert_dim": 2048, "tie_embeddings": False}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    shapes = checkpoint_tensor_shapes(ModelShape.model_validate(config))
    writer = SafetensorsWriter(directory / "model.safetensors", {k: (v, "F32") for k, v in shapes.items()},
                               {"format": "pt", "format_version": "1.0"})
    rng = np.random.default_rng(0)
    for name, dims in shapes.items():
        if len(dims) == 3:
            for e in range(dims[0]):
                writer.write(name, rng.standard_normal(dims[1:], dtype=np.float32) * 0.02, index=e)
        else:
            writer.write(name, rng.standard_normal(dims, dtype=np.float32) * 0.02)
    writer.close()
    return (directory / "model.safetensors").stat().st_size


def memory(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="int4-memory-") as tmp:
        return _memory(Path(tmp), args.moe_layers)


def _memory(work: Path, moe_layers: int) -> dict:
    size = write_synthetic(work / "ckpt", moe_layers)
    # VmHWM (peak RSS of this process image) rather than ru_maxrss, which on Linux keeps the
    # high-water mark of the forked parent across exec.
    hwm = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024"
    code = ("import sys; from colibri_int4 import export_checkpoint; "
            f"r = export_checkpoint(sys.argv[1], sys.argv[2]); print({hwm}, r.mb_per_s)")
    baseline = subprocess.run([sys.executable, "-c", f"import colibri_int4, numpy, pydantic, tqdm; print({hwm})"],
                              check=True, capture_output=True, text=True)
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code, str(work / "ckpt"), str(work / "out.coli")],
                         check=True, capture_output=True, text=True)
    peak, mb_per_s = run.stdout.split()
    return {"checkpoint_bytes": size, "container_bytes": (work / "out.coli").stat().st_size,
            "peak_rss_bytes": int(peak), "import_rss_bytes": int(baseline.stdout), "export_seconds": round(time.perf_counter() - started, 1),
            "mb_per_s": round(float(mb_per_s), 1), "peak_rss_over_checkpoint": round(int(peak) / size, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quality", help="perplexity delta per scheme + per-tensor error summary")
    q.add_argument("--checkpoint", help="trained checkpoint directory (CHECKPOINT.md)")
    q.add_argument("--tokens", required=True, help="token shard, .npy, uint16 .bin or .txt")
    q.add_argument("--train-steps", type=int, default=400, help="without --checkpoint: train tiny this long")
    q.add_argument("--save-trained", help="without --checkpoint: keep the trained tiny checkpoint here")
    q.add_argument("--seq-len", type=int, default=256)
    q.add_argument("--batch", type=int, default=8)
    q.add_argument("--max-eval-tokens", type=int, default=65536)
    q.add_argument("--resident-dtype", default="int8", choices=["int4", "int8", "bf16"])
    q.add_argument("--embed-dtype", default="bf16", choices=["int4", "int8", "bf16"])
    sub.add_parser("sizes", help="container sizes of every colibri_model preset")
    m = sub.add_parser("memory", help="peak RSS of a streaming export of a synthetic nano-shaped checkpoint")
    m.add_argument("--moe-layers", type=int, default=5)
    args = parser.parse_args()
    result = {"quality": quality, "sizes": sizes, "memory": memory}[args.command](args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
