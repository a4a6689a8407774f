"""The next-layer predictor on a trained model's routing: per-layer accuracy, and what prefetch buys.

    nice python bench/prefetch_layers.py [--workdir /var/tmp/colibri-bench] [--steps 1500] [--fraction 0.25]

Trains (or reuses, cached in WORKDIR) the routing workload of studies/trained_workload.py, then
runs the prefetch study (studies/cache_studies.py) on held-out prose at a budget holding
`--fraction` of the experts: prefetch off / predict / on, `--repeats` interleaved cold runs each,
one token per forward pass. Prints, per MoE layer, the share of its experts the predictor named
one layer ahead (the guess has as many experts as the layer uses, so this is precision and recall
at once) and the layer's hit rate without and with prefetch; then hit rate, bytes read per token
and tokens/s of each mode. The first MoE layer is never predicted (nothing runs before it).
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/var/tmp/colibri-bench")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512, help="tokens of each held-out passage")
    parser.add_argument("--threads", type=int, default=2, help="prefetch worker threads")
    args = parser.parse_args()

    import torch
    from colibri_stream.studies.cache_studies import prefetch_study
    from colibri_stream.studies.trained_workload import heldout_prompts, train_routing_model

    torch.set_num_threads(1)
    workload = train_routing_model(args.workdir, steps=args.steps, progress=True)
    study = prefetch_study(workload.container, heldout_prompts(2, 1500), args.fraction, args.repeats, args.tokens,
                           threads=args.threads)
    print(f"workload: {workload.steps} steps, held-out loss {workload.val_loss}")
    print(f"{'layer':>5} {'predicted':>9} {'hit off':>8} {'hit on':>7}")
    for layer, row in study["predict"]["per_layer"].items():
        print(f"{layer:>5} {row['prefetch_accuracy']:>9.3f} {study['off']['per_layer'][layer]['hit_rate']:>8.3f} "
              f"{study['on']['per_layer'][layer]['hit_rate']:>7.3f}")
    for mode in ("off", "predict", "on"):
        row = study[mode]
        print(f"{mode:>8}: hit {row['hit_rate']:.3f}, {row['bytes_read_per_token'] / 1e6:.2f} MB read per token, "
              f"{row['tokens_per_s']:.2f} tok/s, prefetches issued {row['prefetch_issued']}, "
              f"wasted {row['prefetch_wasted']}")
    print(json.dumps(study))


if __name__ == "__main__":
    main()
