"""Finding 2: aux-loss-free balancing keeps dead experts low, and the cache likes what is left.

The same MoE is trained with the balancer's gamma = 0 (off), the default 1e-3, and 10x (1e-2).
From metrics.jsonl (the training batches' routing, top-2): MaxVio, dead experts and load entropy
per MoE layer over training; the validation loss at top-2 and at top-1 serving.

Then each final model's routing on held-out text (the validation tokens after the ones the
validation loss uses) is replayed through colibri-stream's cache replay. The trace comes
straight from the torch model's router at top-1 serving, one decode step per token: a causal
model routes token t the same in a full forward as in token-by-token decoding, so this is the
access sequence the streaming engine would see, without an int4 export in between (int4
rounding could move a few near-tie choices; that is not what this finding is about). Hit rate
of the default policy and of LRU with 25% of the routed experts cached, against Belady's MIN.

    python bench/experiments/balancing_gamma.py          # ~15 min on 2 vCPUs
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from colibri_model.data.manifest import open_data_dir
from colibri_stream.cache.policies import DEFAULT_POLICY, make_policy
from colibri_stream.cache.replay import belady, replay
from colibri_stream.traces.events import TraceEvent

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
import runs  # noqa: E402

EXPERIMENT = "balancing_gamma"
FINDING = "Aux-loss-free balancing keeps dead experts low; its residual skew suits the streaming cache"
GAMMAS = {"off": 0.0, "default": 1e-3, "10x": 1e-2}
CACHE_SHARE = 0.25


def held_out_tokens(data: Path, skip: int, limit: int) -> torch.Tensor:
    _, val, _ = open_data_dir(data)
    tokens = val.tokens[0][skip:skip + limit]
    if len(tokens) < 64:  # a tiny validation shard (smoke data): reuse it from the start
        tokens = val.tokens[0][:limit]
    return torch.from_numpy(tokens.astype("int64")).view(1, -1)


def routing_trace(routing: torch.Tensor, first_layer: int) -> list[TraceEvent]:
    """[layers, N] top-1 experts -> one TraceEvent per token and layer, in decode order."""
    events = []
    for t in range(routing.shape[1]):
        for i in range(routing.shape[0]):
            events.append(TraceEvent(step=t, layer=first_layer + i, experts=(int(routing[i, t]),)))
    return events


def cache_study(model, tokens: torch.Tensor, chunk: int) -> dict:
    routing = runs.probe_routing(model, tokens, chunk=chunk)
    n_experts = model.config.n_experts
    trace = routing_trace(routing, model.config.n_dense_layers)
    total = routing.shape[0] * n_experts
    capacity = max(1, round(CACHE_SHARE * total))
    best = belady(trace, capacity).hit_rate
    default = replay(make_policy(None), trace, capacity).hit_rate
    lru = replay(make_policy("lru"), trace, capacity).hit_rate
    serve_load = []
    for layer in routing:
        counts = torch.bincount(layer, minlength=n_experts).double()
        serve_load.append({"max_vio": float(counts.max() / counts.mean() - 1), "dead": int((counts == 0).sum()),
                           "entropy": runs.load_entropy(layer, n_experts)})
    return {"tokens": int(routing.shape[1]), "capacity": capacity, "routed_experts": total,
            "belady_hit_rate": best, "default_policy": DEFAULT_POLICY, "default_hit_rate": default,
            "lru_hit_rate": lru, "default_vs_belady": default / best if best else None,
            "lru_vs_belady": lru / best if best else None, "serving_top1_load": serve_load}


def one_run(args, data: Path, label: str, gamma: float, seed: int, held_out: torch.Tensor) -> dict:
    scale = args.scale
    model_cfg = runs.model_config(scale, bias_update_gamma=gamma)
    train_cfg = runs.train_config(scale, seed=seed)
    run_dir = args.work / EXPERIMENT / f"{label}-seed{seed}"
    began = time.time()
    study: dict = {}

    def at_end(step: int, model) -> None:
        if step == train_cfg.steps:
            study.update(cache_study(model, held_out, chunk=min(128, scale.seq_len)))

    records, _ = runs.train_run(run_dir, data, model_cfg, train_cfg, probe=at_end,
                                probe_every=0)
    router = runs.router_curve(records, every=max(1, scale.steps // 80))
    val = runs.val_curve(records)
    layers = sorted({int(k[5:].split("_")[0]) for k in router if k.startswith("layer")})
    # the last 10% of steps, so one batch's noise does not decide the number
    tail = [r for r in records if r.router and r.step > 0.9 * train_cfg.steps]
    final = {
        "max_vio": sum(r.router[i].max_vio for r in tail for i in range(len(layers))) / (len(tail) * len(layers)),
        "dead_experts": sum(r.router[i].dead_experts for r in tail for i in range(len(layers))) / len(tail),
        "load_entropy": sum(r.router[i].load_entropy for r in tail for i in range(len(layers)))
        / (len(tail) * len(layers)),
        "val_loss": val["val_loss"][-1], "val_loss_top1": val["val_loss_infer"][-1],
        **{k: study[k] for k in ("belady_hit_rate", "default_hit_rate", "lru_hit_rate", "default_vs_belady",
                                 "lru_vs_belady")},
        "seconds": round(time.time() - began, 1),
    }
    return {"name": label, "seed": seed, "gamma": gamma, "curves": {"router": router, "val": val},
            "final": final, "cache": study}


def summarize(results: list[dict]) -> dict:
    summary: dict = {}
    for metric in ("max_vio", "dead_experts", "load_entropy", "val_loss", "val_loss_top1", "default_hit_rate",
                   "lru_hit_rate", "belady_hit_rate", "default_vs_belady", "lru_vs_belady"):
        by = {label: [r["final"][metric] for r in results if r["name"] == label] for label in GAMMAS}
        entry = {label: report.spread(v) for label, v in by.items() if v}
        entry["exceeds_seed_spread"] = {
            f"{a}_vs_{b}": report.exceeds_spread(by[a], by[b])
            for a, b in (("off", "default"), ("default", "10x"), ("off", "10x")) if by[a] and by[b]}
        summary[metric] = entry
    return summary


def _smooth(values: list[float], window: int = 5) -> list[float]:
    """Rolling mean over up to WINDOW logged points (one batch's routing is noisy)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def plot(results: list[dict], out: Path, title: str) -> Path:
    fig, axes = report.figure(2, 3, title)
    colors = {"off": "tab:red", "default": "tab:blue", "10x": "tab:green"}
    layers = sorted({k.split("_")[0] for k in results[0]["curves"]["router"] if k.startswith("layer")})
    for col, (key, label) in enumerate((("max_vio", "MaxVio (train batches)"), ("dead", "dead experts"),
                                        ("entropy", "load entropy / log E"))):
        ax = axes[0][col]
        for r in results:
            c = r["curves"]["router"]
            for j, layer in enumerate(layers):
                ax.plot(c["step"], _smooth(c[f"{layer}_{key}"]), color=colors[r["name"]], alpha=0.35 + 0.2 * j,
                        linewidth=0.8, label=f"gamma {r['gamma']:g}" if (j == 0 and r["seed"] == results[0]["seed"])
                        else None)
        ax.set_title(f"{label}, each MoE layer (rolling mean of 5 points)", fontsize=8)
    ax = axes[1][0]
    for r in results:
        v = r["curves"]["val"]
        ax.plot(v["step"], v["val_loss_infer"], color=colors[r["name"]], label=f"gamma {r['gamma']:g} s{r['seed']}")
    ax.set_title("val loss, served at top-1", fontsize=8)
    ax = axes[1][1]
    labels = list(GAMMAS)
    for offset, (key, name) in enumerate((("belady_hit_rate", "Belady"), ("default_hit_rate", DEFAULT_POLICY),
                                          ("lru_hit_rate", "LRU"))):
        for i, label in enumerate(labels):
            values = [r["final"][key] for r in results if r["name"] == label]
            ax.scatter([i + (offset - 1) * 0.2] * len(values), values, s=14,
                       color=("black", "tab:purple", "tab:orange")[offset], label=name if i == 0 else None)
    ax.set_xticks(range(len(labels)), [f"gamma {GAMMAS[label]:g}" for label in labels], fontsize=7)
    ax.set_title(f"cache hit rate at {CACHE_SHARE:.0%} of experts (held-out text)", fontsize=8)
    ax = axes[1][2]
    for i, label in enumerate(labels):
        values = [r["final"]["default_vs_belady"] for r in results if r["name"] == label]
        ax.scatter([i] * len(values), values, color=colors[label])
    ax.set_xticks(range(len(labels)), [f"gamma {GAMMAS[label]:g}" for label in labels], fontsize=7)
    ax.set_title(f"{DEFAULT_POLICY} hit rate / Belady", fontsize=8)
    return report.save_figure(fig, out, EXPERIMENT)


def main(argv: list[str] | None = None) -> dict:
    args = runs.experiment_args(__doc__.splitlines()[0], argv)
    started = time.time()
    data = runs.prepare_data(args.work)
    scale = args.scale
    skip = scale.eval_batches * scale.batch_size * scale.seq_len  # past the validation-loss windows
    held_out = held_out_tokens(data, skip, 16384 if scale.name != "smoke" else 256)
    results = [one_run(args, data, label, gamma, seed, held_out) for seed in args.seeds
               for label, gamma in GAMMAS.items()]
    settings = {"scale": vars(scale), "model": runs.model_config(scale).model_dump(), "seeds": args.seeds,
                "gammas": GAMMAS, "cache_share": CACHE_SHARE, "held_out_tokens": int(held_out.numel()),
                "trace": "torch router outputs at top-1 serving, one decode step per token"}
    path = report.write_result(args.out, EXPERIMENT, FINDING, settings, results, summarize(results), started)
    plot(results, args.out, f"{FINDING} ({scale.name} scale)")
    print(path)
    return report.read_result(path)


if __name__ == "__main__":
    main()
