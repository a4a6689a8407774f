"""Finding 1: top-1 training freezes the router; top-2 trains it.

The same MoE (same data, tokens, seeds) is trained at top_k=1 and at top_k=2 and both are served
at top-1. Every `probe_every` steps, on held-out probe tokens:
  - router weight change from init, ||W_t - W_0|| / ||W_0|| (mean over MoE layers);
  - the share of probe tokens whose top-1 expert (as served: bias included) differs from the one
    the same model chose at init (mean over MoE layers);
  - the load entropy / log(E) of that top-1 routing (mean over MoE layers);
and from metrics.jsonl the validation loss at top-1 serving.

NOTE: at top-1 the router's gradient is exactly 0 (gate = s/s), yet its routing still moves:
the balancer's bias and the drifting hidden states change the choice, and AdamW's weight decay
shrinks W. The weight change separates "trained" from "frozen"; the flip share shows how much of
the routing change is the router's own learning.

    python bench/experiments/routing_top_k.py            # ~10 min on 2 vCPUs
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
import runs  # noqa: E402

EXPERIMENT = "routing_top_k"
FINDING = "Top-1 training freezes the router; top-2 trains it"
PROBE_TOKENS = 4096


def one_run(args, data: Path, top_k: int, seed: int, probe: torch.Tensor) -> dict:
    scale = args.scale
    model_cfg = runs.model_config(scale, top_k_train=top_k, top_k_infer=1)
    train_cfg = runs.train_config(scale, seed=seed)
    curve = {"step": [], "router_change": [], "flipped_share": [], "top1_entropy": []}
    start: dict = {}

    def measure(step: int, model) -> None:
        weights = [layer.router.weight.detach().clone() for layer in model.moe_layers()]
        routing = runs.probe_routing(model, probe, chunk=min(128, scale.seq_len))
        if not start:
            start.update(weights=weights, routing=routing)
        change = [float((w - w0).norm() / w0.norm()) for w, w0 in zip(weights, start["weights"])]
        flipped = (routing != start["routing"]).double().mean(dim=1)
        entropy = [runs.load_entropy(r, model.config.n_experts) for r in routing]
        curve["step"].append(step)
        curve["router_change"].append(sum(change) / len(change))
        curve["flipped_share"].append(float(flipped.mean()))
        curve["top1_entropy"].append(sum(entropy) / len(entropy))

    run_dir = args.work / EXPERIMENT / f"top{top_k}-seed{seed}"
    began = time.time()
    records, _ = runs.train_run(run_dir, data, model_cfg, train_cfg, probe=measure, probe_every=scale.eval_every)
    val = runs.val_curve(records)
    # served at top-1: val_loss_infer when training used another top_k, val_loss when it was top-1 already
    val_top1 = [vi if vi is not None else v for v, vi in zip(val["val_loss"], val["val_loss_infer"])]
    val_curve = {"step": val["step"], "val_loss_top1": val_top1}
    final = {"router_change": curve["router_change"][-1], "flipped_share": curve["flipped_share"][-1],
             "top1_entropy": curve["top1_entropy"][-1], "val_loss_top1": val_top1[-1],
             "seconds": round(time.time() - began, 1)}
    return {"name": f"top{top_k}", "seed": seed, "top_k_train": top_k, "n_experts": model_cfg.n_experts, "curves": {"probe": curve, "val": val_curve},
            "final": final}


def summarize(results: list[dict]) -> dict:
    summary: dict = {}
    for metric in ("router_change", "flipped_share", "top1_entropy", "val_loss_top1"):
        by = {k: [r["final"][metric] for r in results if r["top_k_train"] == k] for k in (1, 2)}
        summary[metric] = {"top1": report.spread(by[1]), "top2": report.spread(by[2]),
                           "exceeds_seed_spread": report.exceeds_spread(by[1], by[2])}
    return summary


def plot(results: list[dict], out: Path, title: str) -> Path:
    fig, axes = report.figure(1, 4, title)
    panels = [("probe", "router_change", "router ||W-W0||/||W0||"),
              ("probe", "flipped_share", "probe tokens: top-1 expert != init"),
              ("probe", "top1_entropy", "top-1 load entropy / log E"),
              ("val", "val_loss_top1", "val loss, served at top-1")]
    colors = {1: "tab:red", 2: "tab:blue"}
    for ax, (curve, key, label) in zip(axes[0], panels):
        for r in results:
            c = r["curves"][curve]
            ax.plot(c["step"], c[key], color=colors[r["top_k_train"]], alpha=0.8,
                    label=f"train top-{r['top_k_train']} seed {r['seed']}")
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("step", fontsize=7)
    n_experts = results[0].get("n_experts")
    if n_experts:  # a routing unrelated to the one at init agrees with it on 1/E of the tokens
        axes[0][1].axhline(1 - 1 / n_experts, color="gray", linestyle=":", linewidth=1, label="chance (1 - 1/E)")
    return report.save_figure(fig, out, EXPERIMENT)


def main(argv: list[str] | None = None) -> dict:
    args = runs.experiment_args(__doc__.splitlines()[0], argv)
    started = time.time()
    data = runs.prepare_data(args.work)
    probe = runs.probe_ids(data, PROBE_TOKENS if args.scale.name != "smoke" else 64)
    results = [one_run(args, data, top_k, seed, probe) for seed in args.seeds for top_k in (1, 2)]
    settings = {"scale": vars(args.scale), "model": runs.model_config(args.scale).model_dump(),
                "seeds": args.seeds, "probe_tokens": int(probe.numel())}
    summary = summarize(results)
    path = report.write_result(args.out, EXPERIMENT, FINDING, settings, results, summary, started)
    plot(results, args.out, f"{FINDING} ({args.scale.name} scale)")
    print(path)
    return report.read_result(path)


if __name__ == "__main__":
    main()
