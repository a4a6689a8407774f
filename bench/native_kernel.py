"""The native q4/q8 kernel against torch's: kernel time, decode tokens/s and quality, in one run.

    nice python bench/native_kernel.py kernels                      # one matrix, each route
    nice python bench/native_kernel.py decode CONFIG.json [--dir /var/tmp] [--tokens 24]
    nice python bench/native_kernel.py quality [--workdir /var/tmp/colibri-bench] [--steps 300]

- `kernels`: one token through a [rows x 1024] matrix, best of N calls, each route: native q4
  and q8 (container layout), torch's int4 kernel (bf16 activations, its own layout), dense f32;
  then 1, 4 and 64 activation rows through the native kernel at each level this CPU runs
  (0 portable C, 1 AVX2, 2 AVX-512 VNNI); then `groupings`: q4 (symmetric and with zeros) and q8 in
  groups of 64 and 32 with bf16 and fp16 scales, one row and 64 rows.
- `decode`: a synthetic container of an HF config's shapes (random weights, deleted after),
  opened four ways at a budget that holds every expert (full RAM): compute "native" (experts
  and resident projections from the stored bytes), "native" without its decode fast paths
  (colibri-model's attention and norms), "native" with f32 resident projections, and torch's
  "int4". Each round, each engine prefills the prompt in a new session and decodes
  `--tokens` after it, round-robin, so load drifts hit all alike; medians of `--rounds` rounds and
  ratios against torch's int4, with every expert cached (warm).
- `quality`: the trained routing workload (studies/trained_workload.py, cached in WORKDIR): the
  mean next-token loss on held-out prose under each compute route, against the f32 dequantized
  reference (a difference in nats).

Ratios are measured in one run; report the CPU beside them (`lscpu`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch


def _best_us(call, calls: int = 300) -> float:
    for _ in range(10):
        call()
    best = float("inf")
    for _ in range(calls):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return round(best * 1e6, 1)


def kernels(args) -> dict:
    from colibri_stream.compute import native_kernel as nk

    out = {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    gen = torch.Generator().manual_seed(0)
    cols, group = 1024, 64
    for rows in (1024, 4096):
        nibbles = torch.randint(0, 16, (rows, cols), dtype=torch.int32, generator=gen)
        packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8)
        scales = torch.full((rows, cols // group), 0.01).to(torch.bfloat16)
        weights8 = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=gen)
        x = torch.randn(1, cols, generator=gen)
        torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
        torch_scales = torch.stack([scales.float().T, torch.zeros(cols // group, rows)], -1).to(torch.bfloat16)
        dense = torch.randn(rows, cols, generator=gen)
        xb = x.to(torch.bfloat16)
        bits = scales.view(torch.int16)
        routes = {  # (each timed before the loop moves on: the defaults only pin what the names hold)
            "native_q4_us": lambda x=x, packed=packed, bits=bits: nk.q4_matmul(nk.QuantizedActivations(x), packed,
                                                                              bits, None, group),
            "native_q8_us": lambda x=x, w=weights8, bits=bits: nk.q8_matmul(nk.QuantizedActivations(x), w, bits,
                                                                           group),
            "torch_int4_us": lambda xb=xb, p=torch_packed, s=torch_scales: torch.ops.aten._weight_int4pack_mm_for_cpu(
                xb, p, group, s.contiguous()),
            "dense_f32_us": lambda x=x, dense=dense: torch.nn.functional.linear(x, dense),
        }
        row = {name: _best_us(call) for name, call in routes.items()}
        row["torch_int4_over_native_q4"] = round(row["torch_int4_us"] / row["native_q4_us"], 2)
        out[f"{rows}x{cols}"] = row
    # many activation rows (tiles of 4 share each weight load) at each kernel level this CPU runs
    rows = 1024
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
    weights8 = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=gen)
    bits = torch.full((rows, cols // group), 0.01).to(torch.bfloat16).view(torch.int16)
    levels = range(nk.SCALAR, nk._library().colibri_q4_cpu_level() + 1)
    for m in (1, 4, 64):
        x = nk.QuantizedActivations(torch.randn(m, cols, generator=gen))
        calls = 300 if m < 64 else 50
        out[f"{m} rows x {rows}x{cols}"] = {
            f"level {level} {kind}_us": _best_us(call, calls)
            for level in levels if level > nk.SCALAR or m == 1
            for kind, call in (("q4", lambda x=x, level=level: nk.q4_matmul(x, packed, bits, None, group, level=level)),
                               ("q8", lambda x=x, level=level: nk.q8_matmul(x, weights8, bits, group, level=level)))}
    out["groupings"] = groupings(nk, gen)
    return out


def groupings(nk, gen) -> dict:
    """One token (and 64 rows) through the groupings a container can hold: groups of 64 or 32,
    symmetric or with zeros, bf16 or fp16 scales (import-gguf keeps a Q4_0 file as g32 sym fp16,
    Q4_1 / Q4_K as g32 asym fp16, and the int8 head and attention then share the grouping)."""
    out = {}
    for rows, cols in ((4096, 1024), (2048, 1024)):
        packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
        weights8 = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=gen)
        for m in (1, 64):
            x = nk.QuantizedActivations(torch.randn(m, cols, generator=gen))
            calls = 200 if m == 1 else 30
            row = {}
            for group in (64, 32):
                for fp16 in (False, True):
                    bits = torch.full((rows, cols // group), 0.01).to(torch.float16 if fp16 else torch.bfloat16)
                    bits = bits.view(torch.int16)
                    name = f"g{group} {'fp16' if fp16 else 'bf16'}"
                    for label, call in ((f"q4 sym {name}", partial(nk.q4_matmul, x, packed, bits, None, group, fp16)),
                                        (f"q4 asym {name}", partial(nk.q4_matmul, x, packed, bits, bits, group, fp16)),
                                        (f"q8 {name}", partial(nk.q8_matmul, x, weights8, bits, group, fp16))):
                        row[f"{label}_us"] = _best_us(call, calls)
            out[f"{m} rows x {rows}x{cols}"] = row
    return out


def without_decode_paths(engine):
    """The engine with colibri-model's own attention and norms again (compute/native_decode.py)."""
    from colibri_model import Attention, RMSNorm

    for module in engine.model.modules():
        for base in (Attention, RMSNorm):
            if isinstance(module, base):
                module.__class__ = base
    return engine


def decode(args) -> dict:
    from colibri_int4 import SYNTHETIC_SCHEME, write_synthetic_container
    from colibri_int4.import_hf import read_hf_config
    from colibri_stream import Engine
    from colibri_stream.compute import native_linear

    config, _, _ = read_hf_config(args.config)
    path = Path(args.dir) / f"native-bench-{Path(args.config).resolve().parent.name}.coli"
    engines = {}
    try:
        if not path.exists():
            write_synthetic_container(path, config, SYNTHETIC_SCHEME)
        budget = 2 * path.stat().st_size  # every expert fits: full RAM
        common = dict(ram_budget=budget, prefill_chunk=args.prefill_chunk, prefetch="off")
        engines["native"] = Engine.open(path, compute="native", **common)
        engines["native, no decode fast paths"] = without_decode_paths(Engine.open(path, compute="native", **common))
        rule = native_linear.native_linear_name
        native_linear.native_linear_name = lambda *a: False  # the resident projections dequantized to f32
        try:
            import colibri_stream.footprint as footprint
            import colibri_stream.resident as resident

            footprint.native_linear_name = resident.native_linear_name = native_linear.native_linear_name
            engines["native, f32 resident"] = Engine.open(path, compute="native", **common)
        finally:
            native_linear.native_linear_name = footprint.native_linear_name = resident.native_linear_name = rule
        engines["torch int4"] = Engine.open(path, compute="int4", **common)
        prompt = list(range(1, args.prompt + 1))
        for engine in engines.values():  # every expert read once: the measured steps are hits
            session = engine.session()
            token = int(session.append(prompt).reshape(-1, engine.config.vocab_size)[-1].argmax())
            for _ in range(args.warmup):
                token = int(session.append([token]).reshape(-1).argmax())
        seconds = {name: [] for name in engines}
        prefill = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                session = engine.session()  # a new conversation: the prompt is prefilled again
                started = time.perf_counter()
                logits = session.append(prompt)
                prefill[name].append(time.perf_counter() - started)
                token = int(logits.reshape(-1, engine.config.vocab_size)[-1].argmax())
                started = time.perf_counter()
                for _ in range(args.tokens):
                    token = int(session.append([token]).reshape(-1).argmax())
                seconds[name].append((time.perf_counter() - started) / args.tokens)
        base = statistics.median(seconds["torch int4"])
        base_prefill = statistics.median(prefill["torch int4"])
        rows = {}
        for name, engine in engines.items():
            step, fill = statistics.median(seconds[name]), statistics.median(prefill[name])
            rows[name] = {"decode_tok_s": round(1 / step, 2), "over_torch_int4": round(base / step, 2),
                          "prefill_tok_s": round(len(prompt) / fill, 1),
                          "prefill_over_torch_int4": round(base_prefill / fill, 2),
                          "resident_mb": round(engine.stats.resident_bytes / 1e6, 1),
                          "hit_rate": round(engine.stats.hits / max(1, engine.stats.hits + engine.stats.misses), 3),
                          "compute_mode": engine.stats.compute_mode}
        return {"container_gb": round(path.stat().st_size / 1e9, 2), "threads": torch.get_num_threads(),
                "capability": torch.backends.cpu.get_cpu_capability(), "rounds": args.rounds,
                "tokens_per_round": args.tokens, "engines": rows}
    finally:
        for engine in engines.values():
            engine.close()
        if not args.keep:
            path.unlink(missing_ok=True)


def quality(args) -> dict:
    from colibri_stream import Engine
    from colibri_stream.studies.trained_workload import heldout_prompts, train_routing_model

    workload = train_routing_model(args.workdir, steps=args.steps)
    routes = {"dequant f32": dict(compute="dequant", dtype="f32"), "torch int4 bf16": dict(compute="int4"),
              "torch int4 f32": dict(compute="int4", kernel_dtype="f32"), "native": dict(compute="native")}
    losses = {}
    for name, options in routes.items():
        with Engine.open(workload.container, ram_budget="2GB", **options) as engine:
            total, count = 0.0, 0
            for text in heldout_prompts(count=args.passages):
                ids = torch.tensor(engine.tokenizer.encode(text).ids[: args.max_tokens])
                logits = engine.logits(ids).float()
                total += torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
                count += len(ids) - 1
            losses[name] = total / count
    reference = losses["dequant f32"]
    return {"workload_steps": workload.steps, "tokens": count,
            "loss_nats": {k: round(v, 5) for k, v in losses.items()},
            "delta_vs_dequant_f32": {k: round(v - reference, 5) for k, v in losses.items()}}


def bf16_head(args) -> dict:
    """A bf16 vocab projection (`--vocab` x `--dim`): the native kernel on its bf16 bytes against
    torch's f32 matmul of the same weights widened (what the engine held before), interleaved,
    best of `--repeats`, with each one's error against a float64 product."""
    from colibri_stream.compute import native_kernel as nk

    torch.manual_seed(0)
    weights = (torch.randn(args.vocab, args.dim) * 0.02).bfloat16()
    bits, wide = weights.view(torch.int16), weights.float()
    rows = {}
    for m in (1, 4, 128):
        x = torch.randn(m, args.dim)
        exact = x.double() @ weights.double().T
        native, dense = [], []
        for _ in range(args.repeats):
            native.append(_seconds(lambda x=x: nk.bf16_matmul(x, bits)))
            dense.append(_seconds(lambda x=x: x @ wide.T))
        rows[m] = {"native_ms": round(1e3 * min(native), 2), "torch_f32_ms": round(1e3 * min(dense), 2),
                   "native_over_torch": round(min(native) / min(dense), 3),
                   "native_error": float((nk.bf16_matmul(x, bits).double() - exact).abs().max()),
                   "torch_error": float(((x @ wide.T).double() - exact).abs().max())}
    return {"vocab": args.vocab, "dim": args.dim, "threads": torch.get_num_threads(), "rows": rows}


def _seconds(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("kernels")
    d = sub.add_parser("decode")
    d.add_argument("config", help="a Hugging Face config.json")
    d.add_argument("--dir", default="/var/tmp", help="where the container goes (real storage, not tmpfs)")
    d.add_argument("--tokens", type=int, default=8)
    d.add_argument("--rounds", type=int, default=5)
    d.add_argument("--warmup", type=int, default=48)
    d.add_argument("--prompt", type=int, default=128, help="prompt tokens (prefill)")
    d.add_argument("--prefill-chunk", type=int, default=128)
    d.add_argument("--keep", action="store_true")
    h = sub.add_parser("bf16-head")
    h.add_argument("--vocab", type=int, default=32000)
    h.add_argument("--dim", type=int, default=1024)
    h.add_argument("--repeats", type=int, default=10)
    q = sub.add_parser("quality")
    q.add_argument("--workdir", default="/var/tmp/colibri-bench")
    q.add_argument("--steps", type=int, default=1500, help="training steps of the routing workload (cached)")
    q.add_argument("--passages", type=int, default=4)
    q.add_argument("--max-tokens", type=int, default=256)
    for p in (d, q, h, sub.choices["kernels"]):
        p.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps({"kernels": kernels, "decode": decode, "quality": quality, "bf16-head": bf16_head}[args.what](args), indent=1))


if __name__ == "__main__":
    main()
