"""`colibri-model` command line: presets (and the data/training commands registered below)."""

from __future__ import annotations

import json

import click

from . import __version__
from .config import PRESETS, count_params, get_preset
from .plan_cli import plan_memory_command
from .training_cli import convert_checkpoint, prepare, sft, train


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="colibri-model")
def main() -> None:
    """Colibri MoE models: presets, data preparation, training, SFT, checkpoint conversion and memory plans.

    Exit status: 0 ok, 1 a check failed (e.g. training diverged), 2 bad usage or bad input.
    """


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def presets(as_json: bool) -> None:
    """List the model presets with total and active parameter counts.

    Active counts are per token, at the training top_k and at the serving top_k (see the
    README for the accounting).
    """
    rows = []
    for name in PRESETS:
        config = get_preset(name)
        rows.append({"name": name, **count_params(config), "top_k_train": config.top_k_train,
                     "top_k_infer": config.top_k_infer})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'preset':<8} {'total':>10} {'active(train)':>14} {'active(serve)':>14}")
    for r in rows:
        click.echo(
            f"{r['name']:<8} {r['total_params'] / 1e9:>9.3f}B {r['active_params_train'] / 1e6:>12.1f}M"
            f" (k={r['top_k_train']}) {r['active_params_infer'] / 1e6:>8.1f}M (k={r['top_k_infer']})"
        )


main.add_command(prepare)
main.add_command(train)
main.add_command(sft)
main.add_command(convert_checkpoint)
main.add_command(plan_memory_command)


if __name__ == "__main__":
    main()
