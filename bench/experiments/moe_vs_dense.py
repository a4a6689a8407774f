"""Finding 4: the MoE beats a token-matched dense model of equal active parameters.

Same data, tokens and seeds. The dense model has the MoE's attention, embedding and depth, and
a SwiGLU FFN in every layer as wide as the MoE layer's active part at top-2 (shared expert + 2
routed experts), so its per-token FLOPs match the MoE's active ones at training (the routers'
E x d per layer is the only difference, <1%). Reported: validation loss curves (the MoE at top-2
and at top-1 serving) and the 7 zero-shot tasks through colibri-eval on its bundled samples,
the MoE scored as served (top-1) and at top-2 (equal active parameters).

    python bench/experiments/moe_vs_dense.py             # ~15 min on 2 vCPUs
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from colibri_eval import evaluate, load_model, parse_task_list
from colibri_model import count_params
from colibri_model.training.metrics import flops_per_token

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402
import runs  # noqa: E402

EXPERIMENT = "moe_vs_dense"
FINDING = "The MoE beats a token-matched dense model of equal active parameters"
EVAL_LIMIT = 100  # items per task of the 200 bundled; the stderr in the JSON says what that resolves


def dense_config(scale: runs.Scale):
    moe = runs.model_config(scale)
    return runs.model_config(scale, name=f"exp-{scale.name}-dense", n_dense_layers=scale.n_layers,
                             dense_ffn_dim=moe.shared_expert_dim + moe.top_k_train * moe.expert_dim)


def score(checkpoint: Path, top_k: int | None, limit: int) -> dict:
    loaded = load_model(f"colibri:{checkpoint}")
    if top_k is not None:
        loaded.model.model.set_top_k(top_k)  # the adapter serves at top_k_infer unless pinned
    results = evaluate(loaded, parse_task_list("all"), "bundled", limit=limit, bootstrap_iters=200)
    return {task: {name: {"value": m.value, "stderr": m.stderr} for name, m in result.metrics.items()}
            for task, result in results.tasks.items()}


def one_run(args, data: Path, kind: str, seed: int, limit: int) -> dict:
    scale = args.scale
    model_cfg = runs.model_config(scale) if kind == "moe" else dense_config(scale)
    train_cfg = runs.train_config(scale, seed=seed)
    began = time.time()
    records, checkpoint = runs.train_run(args.work / EXPERIMENT / f"{kind}-seed{seed}", data, model_cfg, train_cfg)
    trained_s = time.time() - began
    val = runs.val_curve(records)
    curves = {"val": {"step": val["step"], "val_loss": val["val_loss"]}}
    final = {"val_loss": val["val_loss"][-1], "train_seconds": round(trained_s, 1)}
    evals = {}
    if kind == "moe":
        curves["val"]["val_loss_top1"] = val["val_loss_infer"]
        final["val_loss_top1"] = val["val_loss_infer"][-1]
        evals["served_top1"] = score(checkpoint, None, limit)
        evals["top2"] = score(checkpoint, 2, limit)
    else:
        evals["dense"] = score(checkpoint, None, limit)
    final["eval_seconds"] = round(time.time() - began - trained_s, 1)
    params = count_params(model_cfg)
    return {"name": kind, "seed": seed, "curves": curves, "final": final, "eval": evals,
            "params": {**params, "flops_per_token": flops_per_token(model_cfg, scale.seq_len)}}


def primary(task_metrics: dict) -> tuple[str, float]:
    for name in ("acc_norm", "acc"):
        if name in task_metrics:
            return name, task_metrics[name]["value"]
    name = next(iter(task_metrics))
    return name, task_metrics[name]["value"]


def summarize(results: list[dict]) -> dict:
    moe = [r for r in results if r["name"] == "moe"]
    dense = [r for r in results if r["name"] == "dense"]
    summary: dict = {}
    for key, pick in (("val_loss_moe_top2", lambda r: r["final"]["val_loss"]),
                      ("val_loss_moe_top1", lambda r: r["final"]["val_loss_top1"])):
        a, b = [pick(r) for r in moe], [r["final"]["val_loss"] for r in dense]
        summary[key.replace("val_loss_", "val_loss_") + "_vs_dense"] = {
            "moe": report.spread(a), "dense": report.spread(b),
            "moe_minus_dense": report.spread([x - y for x, y in zip(a, b)]),
            "exceeds_seed_spread": report.exceeds_spread(a, b),
            "same_sign_every_seed": report.same_sign_every_seed([x - y for x, y in zip(a, b)])}
    tasks = {}
    for task in moe[0]["eval"]["served_top1"]:
        metric, _ = primary(moe[0]["eval"]["served_top1"][task])
        row = {"metric": metric}
        for label, runs_, key in (("moe_top1", moe, "served_top1"), ("moe_top2", moe, "top2"), ("dense", dense, "dense")):
            values = [r["eval"][key][task][metric]["value"] for r in runs_]
            row[label] = report.spread(values)
            row[f"{label}_stderr"] = max(r["eval"][key][task][metric]["stderr"] or 0.0 for r in runs_)
        tasks[task] = row
    summary["tasks"] = tasks
    summary["params"] = {"moe": moe[0]["params"], "dense": dense[0]["params"]}
    return summary


def plot(results: list[dict], summary: dict, out: Path, title: str) -> Path:
    fig, axes = report.figure(1, 2, title)
    ax = axes[0][0]
    for r in results:
        v = r["curves"]["val"]
        if r["name"] == "moe":
            ax.plot(v["step"], v["val_loss"], color="tab:blue", label=f"MoE top-2 s{r['seed']}")
            ax.plot(v["step"], v["val_loss_top1"], color="tab:cyan", linestyle="--", label=f"MoE served top-1 s{r['seed']}")
        else:
            ax.plot(v["step"], v["val_loss"], color="tab:red", label=f"dense s{r['seed']}")
    ax.set_title("validation loss", fontsize=8)
    ax = axes[0][1]
    tasks = list(summary["tasks"])
    for offset, (label, color) in enumerate((("moe_top1", "tab:cyan"), ("moe_top2", "tab:blue"), ("dense", "tab:red"))):
        means = [summary["tasks"][t][label]["mean"] for t in tasks]
        errs = [summary["tasks"][t][f"{label}_stderr"] for t in tasks]
        xs = [i + (offset - 1) * 0.27 for i in range(len(tasks))]
        ax.bar(xs, means, width=0.27, yerr=errs, color=color, label=label, capsize=1.5)
    ax.set_xticks(range(len(tasks)), [t.replace("_", "\n") for t in tasks], fontsize=6)
    ax.set_title("zero-shot (acc_norm or acc; lambada: acc), mean of seeds, +-1 stderr", fontsize=8)
    return report.save_figure(fig, out, EXPERIMENT)


def main(argv: list[str] | None = None) -> dict:
    args = runs.experiment_args(__doc__.splitlines()[0], argv)
    started = time.time()
    data = runs.prepare_data(args.work)
    limit = EVAL_LIMIT if args.scale.name != "smoke" else 4
    results = [one_run(args, data, kind, seed, limit) for seed in args.seeds for kind in ("moe", "dense")]
    summary = summarize(results)
    settings = {"scale": vars(args.scale), "model": runs.model_config(args.scale).model_dump(),
                "dense_model": dense_config(args.scale).model_dump(), "seeds": args.seeds,
                "eval": {"tasks": "all (7)", "data": "colibri-eval bundled samples", "limit": limit}}
    path = report.write_result(args.out, EXPERIMENT, FINDING, settings, results, summary, started)
    plot(results, summary, args.out, f"{FINDING} ({args.scale.name} scale)")
    print(path)
    return report.read_result(path)


if __name__ == "__main__":
    main()
