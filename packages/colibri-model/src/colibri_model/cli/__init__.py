"""The `colibri-model` command line: the group, and where each command lives.

    __init__.py     presets, train-tokenizer
    training.py     prepare, train, sft, convert-checkpoint  (one-line user errors: `UserError`)
    plan_memory.py  plan-memory                              (will a training configuration fit a GPU?)

`colibri-model` (the console script) and `python -m colibri_model.cli` (__main__.py; what
`torchrun -m colibri_model.cli` runs) both call `main`.
"""

from __future__ import annotations

import json

import click

from .. import __version__
from ..param_count import count_params
from ..presets import PRESETS, get_preset
from .plan_memory import plan_memory_command
from .training import UserError, convert_checkpoint, prepare, sft, train


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


@main.command("train-tokenizer")
@click.argument("inputs", nargs=-1)
@click.option("--out", required=True, type=click.Path(),
              help="tokenizer.json to write (or a directory to hold one).")
@click.option("--vocab-size", default=4096, show_default=True, type=int,
              help="Tokens in the vocabulary, special tokens included (259..65536).")
@click.option("--min-frequency", default=2, show_default=True, type=click.IntRange(min=1),
              help="A merge must occur at least this often.")
def train_tokenizer(inputs, out, vocab_size, min_frequency) -> None:
    """Train a byte-level BPE tokenizer on INPUT... (.txt/.md files or directories).

    Without INPUT it trains on the bundled prose corpus. A small vocabulary (2048-4096) keeps
    the LM head cheap for CPU-scale runs; pass the result to `prepare --tokenizer`. Example:
    colibri-model train-tokenizer --vocab-size 2048 --out tok/tokenizer.json
    """
    from ..corpus import prose_files
    from ..tokenizer import TokenizerError
    from ..tokenizer_training import save_tokenizer, train_bpe_tokenizer

    try:
        tokenizer = train_bpe_tokenizer(list(inputs) or prose_files(), vocab_size, min_frequency)
        target = save_tokenizer(tokenizer, out)
    except TokenizerError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"{out}: cannot write ({exc.strerror or exc})") from None
    click.echo(f"{target}: byte-level BPE, {tokenizer.get_vocab_size()} tokens")


main.add_command(prepare)
main.add_command(train)
main.add_command(sft)
main.add_command(convert_checkpoint)
main.add_command(plan_memory_command)

