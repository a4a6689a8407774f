"""The `prepare`, `train`, `sft` and `convert-checkpoint` commands of `colibri-model` (registered in cli/__init__.py).

User mistakes (a bad flag value, missing data, a checkpoint of another config or an unknown
format version) end with ONE line on stderr and exit code 2; a diverged run (a failed check)
exits with 1. Progress bars show only when stderr is a terminal, unless `--progress` or
`--no-progress` is given (`PROGRESS` below is the one place that decides). Under `torchrun` the
same commands run one process per device:

    torchrun --nproc-per-node 8 -m colibri_model.cli train --preset nano --data DIR --out RUN --steps N
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click
from colibri_spec import SpecError
from pydantic import ValidationError

from ..config import ColibriConfig
from ..errors import ColibriModelError
from ..presets import get_preset


class UserError(click.ClickException):
    """A one-line error about the user's input; exit code 2 like click's usage errors (or the
    `exit_code` of the package error it reports)."""

    exit_code = 2


class DtypeChoice(click.Choice):
    """`f32|bf16` (and `auto` where offered), the dtype spelling of every Colibri command. `fp32`,
    `float32` and `bfloat16` stay accepted (not shown) so that older scripts keep working; the value
    passed on is the trainer's spelling (`fp32`, `bf16`, `auto`)."""

    ALIASES = {"fp32": "f32", "float32": "f32", "bfloat16": "bf16"}

    def __init__(self, *choices: str) -> None:
        super().__init__(list(choices))

    def convert(self, value, param, ctx):
        value = super().convert(self.ALIASES.get(value, value), param, ctx)
        return "fp32" if value == "f32" else value


def dtype_options(*choices: str, default: str, help: str | None = None):
    """`--dtype`, and `--precision` as its hidden alias (the old name): both land in `precision`."""

    def take_alias(ctx, _param, value):
        if value is not None:
            ctx.params["precision"] = value
        return value

    def keep_alias(ctx, param, value):  # a defaulted --dtype keeps what --precision set
        if ctx.get_parameter_source(param.name) is click.core.ParameterSource.DEFAULT:
            return ctx.params.get("precision", value)
        return value

    def decorate(func):
        func = click.option("--precision", "precision_alias", type=DtypeChoice(*choices), default=None, hidden=True,
                            expose_value=False, callback=take_alias)(func)
        return click.option("--dtype", "precision", type=DtypeChoice(*choices), default=default, show_default=True,
                            help=help, callback=keep_alias)(func)

    return decorate


def _resolve_progress(_ctx, _param, value: bool | None) -> bool:
    return sys.stderr.isatty() if value is None else value


PROGRESS = click.option("--progress/--no-progress", default=None, callback=_resolve_progress,
                        help="Progress bar on stderr [default: only when stderr is a terminal].")


def _first_validation_error(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    where = ".".join(str(p) for p in first["loc"])
    return f"{where + ': ' if where else ''}{first['msg']}"


def _user_errors(func):
    """Turn the package's typed input errors into one-line click errors."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (ColibriModelError, SpecError) as exc:  # each carries its exit code (2: bad input)
            error = UserError(str(exc))
            error.exit_code = exc.exit_code
            raise error from None
        except ValidationError as exc:
            raise UserError(_first_validation_error(exc)) from None

    return wrapper


@click.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Data directory to write (an unfinished one is resumed).")
@click.option("--tokenizer", default=None, help="tokenizer.json path, directory or Hub id [default: bundled SmolLM2].")
@click.option("--shard-tokens", default=100_000_000, show_default=True, type=click.IntRange(min=1),
              help="Target tokens per train shard.")
@click.option("--val-fraction", default=0.01, show_default=True, type=click.FloatRange(0, 1, max_open=True),
              help="Share of documents held out for validation (by content hash).")
@click.option("--max-val-tokens", default=10_000_000, show_default=True, type=click.IntRange(min=1))
@click.option("--text-field", default="text", show_default=True, help="JSONL/parquet field holding the text.")
@click.option("--text-doc-chars", default=4000, show_default=True, type=click.IntRange(min=1),
              help="Plain text: group paragraphs into documents of at least this many characters.")
@click.option("--hf-config", default=None, help="Hub dataset config, e.g. sample-10BT for FineWeb-Edu.")
@click.option("--hf-split", default="train", show_default=True)
@PROGRESS
@_user_errors
def prepare(inputs, out_dir, tokenizer, shard_tokens, val_fraction, max_val_tokens, text_field, text_doc_chars,
            hf_config, hf_split, progress):
    """Tokenize INPUT... into uint16 token shards and a validation shard.

    INPUT is a .txt/.md, .jsonl[.gz] (field `text`) or .parquet file, a directory of them, or a
    Hugging Face dataset id (needs network and `datasets`), e.g. the default pretraining source
    `HuggingFaceFW/fineweb-edu --hf-config sample-10BT`. The shards are written into OUT.partial
    and renamed to OUT when complete; re-running the same command after an interruption resumes
    where the last finished shard ended, and a retry with other arguments starts afresh.
    """
    from ..data.manifest import MANIFEST_FILE, read_manifest
    from ..data.prepare import prepare as run_prepare

    done_before = (Path(out_dir) / MANIFEST_FILE).is_file() and read_manifest(out_dir).complete
    manifest = run_prepare(list(inputs), out_dir, tokenizer=tokenizer, shard_tokens=shard_tokens,
                           val_fraction=val_fraction, max_val_tokens=max_val_tokens, text_field=text_field,
                           text_doc_chars=text_doc_chars, hf_config=hf_config, hf_split=hf_split, progress=progress)
    if done_before:
        click.echo(f"{out_dir}: already prepared by an earlier run with these inputs and settings; nothing to do "
                   "(delete it, or choose another --out, to prepare again)", err=True)
    click.echo(f"{out_dir}: {len(manifest.train_shards)} train shards, {manifest.train_tokens:,} train tokens, "
               f"{manifest.val_shard.tokens:,} validation tokens")


def training_options(func):
    """Options shared by `train` and `sft` (they map 1:1 onto TrainConfig fields)."""
    options = [
        click.option("--out", "run_dir", required=True, type=click.Path(file_okay=False),
                     help="Run directory: checkpoints/ and metrics.jsonl; resumed if it holds a checkpoint."),
        click.option("--steps", required=True, type=click.IntRange(min=1), help="Total optimizer steps to reach."),
        click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=1)),
        click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1),
                     help="Global sequences per optimizer step (all processes)."),
        click.option("--micro-batch", default=None, type=click.IntRange(min=1),
                     help="Sequences per process per forward [default: batch-size / processes]."),
        click.option("--lr", default=1e-3, show_default=True, type=click.FloatRange(min=0, min_open=True)),
        click.option("--min-lr-ratio", default=0.1, show_default=True, type=click.FloatRange(0, 1)),
        click.option("--warmup", "warmup_steps", default=100, show_default=True, type=click.IntRange(min=0)),
        click.option("--schedule", type=click.Choice(["wsd", "cosine"]), default="wsd", show_default=True),
        click.option("--decay-fraction", default=0.0, show_default=True, type=click.FloatRange(0, 1),
                     help="WSD: decay (1-sqrt) over this last fraction of --steps; 0 keeps the rate stable."),
        click.option("--decay-start", default=None, type=click.IntRange(min=0),
                     help="WSD: start the decay at this step (e.g. the step of a stable checkpoint)."),
        click.option("--weight-decay", default=0.1, show_default=True, type=click.FloatRange(min=0)),
        click.option("--grad-clip", default=1.0, show_default=True, type=click.FloatRange(min=0)),
        click.option("--seed", default=0, show_default=True, type=int),
        click.option("--log-every", default=1, show_default=True, type=click.IntRange(min=1)),
        click.option("--eval-every", default=100, show_default=True, type=click.IntRange(min=0)),
        click.option("--eval-batches", default=8, show_default=True, type=click.IntRange(min=1),
                     help="Validation size, in global batches (--batch-size sequences each)."),
        click.option("--save-every", default=500, show_default=True, type=click.IntRange(min=0)),
        click.option("--keep", "keep_checkpoints", default=2, show_default=True, type=click.IntRange(min=1)),
        click.option("--max-bad-steps", default=5, show_default=True, type=click.IntRange(min=1),
                     help="Stop after this many non-finite steps in a row."),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1, ..."),
        click.option("--parallelism", type=click.Choice(["ddp", "fsdp"]), default="ddp", show_default=True,
                     help="Under torchrun: replicate the model (DDP) or shard it (FSDP2)."),
        dtype_options("auto", "f32", "bf16", default="auto",
                      help="Training precision: bf16 autocast or f32; auto: bf16 on CUDA, f32 on CPU."),
        click.option("--compile/--no-compile", default=False, show_default=True, help="torch.compile each transformer block (fullgraph=True) for training."),
        click.option("--activation-checkpointing/--no-activation-checkpointing", default=False, show_default=True),
        click.option("--peak-tflops", default=None, type=click.FloatRange(min=0, min_open=True),
                     help="Per-device peak TFLOP/s for MFU [default: known GPUs only]."),
        click.option("--resume-from", default=None, type=click.Path(exists=True, file_okay=False),
                     help="Continue from this checkpoint (e.g. a stable one, to decay) instead of --out's latest."),
        PROGRESS,
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _train_config(options: dict):
    from ..training import TrainConfig

    fields = dict(options)
    resume_from = fields.pop("resume_from")
    run_dir = fields.pop("run_dir")
    if fields["micro_batch"] is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if fields["batch_size"] % world:
            raise UserError(f"--batch-size {fields['batch_size']} is not divisible by {world} processes")
        fields["micro_batch"] = fields["batch_size"] // world
    return TrainConfig(**fields), run_dir, resume_from


def _model_config(preset: str | None, config_path: str | None) -> ColibriConfig | None:
    """The model config of --preset or --config (None: resume with the run's own); every error
    about a --config file names the file."""
    if preset and config_path:
        raise UserError("give --preset or --config, not both")
    if preset:
        return get_preset(preset)  # ConfigError names the preset and the choices
    if not config_path:
        return None
    from ..checkpoint import CheckpointFormatError, load_config

    try:
        return load_config(config_path)
    except ValidationError as exc:
        raise UserError(f"{config_path}: {_first_validation_error(exc)}") from None
    except CheckpointFormatError as exc:  # a checkpoint's config.json: the message names the file
        raise UserError(str(exc)) from None
    except ValueError as exc:  # not JSON (JSONDecodeError), not UTF-8
        raise UserError(f"{config_path}: not a model config JSON ({exc})") from None
    except OSError as exc:
        raise UserError(f"{config_path}: cannot read ({exc.strerror or exc})") from None


def _report(result, run_dir) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        state = "stopped" if result.stopped else "done"
        val = f", val_loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        click.echo(f"{run_dir}: {state} at step {result.step} ({result.tokens_seen:,} tokens{val}); "
                   f"checkpoint {result.checkpoint}")


@click.command()
@click.option("--preset", default=None, help="Model preset (tiny, nano, micro, grande); optional when resuming.")
@click.option("--config", "config_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A model config JSON instead of a preset.")
@click.option("--data", "data_dir", required=True, type=click.Path(file_okay=False),
              help="Data directory made by `colibri-model prepare`.")
@training_options
@_user_errors
def train(preset, config_path, data_dir, **options):
    """Pretrain a Colibri model on prepared shards, resuming RUN's latest checkpoint.

    Example: colibri-model train --preset tiny --data data/prose --out runs/tiny --steps 200 --seq-len 128
    """
    from ..training import Trainer

    train_config, run_dir, resume_from = _train_config(options)
    model_config = _model_config(preset, config_path)
    if not Path(data_dir).is_dir():
        raise UserError(f"{data_dir}: no such data directory (make one with `colibri-model prepare`)")
    trainer = Trainer.for_pretraining(run_dir, data_dir, model_config, train_config, resume_from=resume_from)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    _report(result, run_dir)


@click.command()
@click.option("--init", "init_from", required=True, type=click.Path(exists=True, file_okay=False),
              help="Pretrained checkpoint to start from (ignored when --out already holds an SFT checkpoint).")
@click.option("--data", "chat_files", required=True, multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Chat JSONL with `messages` (smol-smoltalk's shape); repeatable.")
@click.option("--val-fraction", default=0.05, show_default=True, type=click.FloatRange(0, 1, max_open=True))
@training_options
@_user_errors
def sft(init_from, chat_files, val_fraction, **options):
    """Supervised fine-tuning on chat data, loss on assistant tokens only.

    Conversations are rendered with Colibri's ChatML-style template (colibri_model/chat.py) and
    packed like pretraining data. Example:
    colibri-model sft --init runs/tiny/checkpoints/step_00000200 --data chat.jsonl --out runs/tiny-sft --steps 50
    """
    from ..training import Trainer

    train_config, run_dir, resume_from = _train_config(options)
    trainer = Trainer.for_sft(run_dir, list(chat_files), train_config, init_from=init_from,
                              val_fraction=val_fraction, resume_from=resume_from)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    _report(result, run_dir)


@click.command("convert-checkpoint")
@click.argument("source", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path())
@click.option("--weights-only", is_flag=True,
              help="DCP -> single file: only config.json, model.safetensors, tokenizer.json.")
@_user_errors
def convert_checkpoint(source, out, weights_only):
    """Convert a training checkpoint between the DCP layout (FSDP2 runs) and the single file.

    A DCP SOURCE (it holds dcp.json) becomes model.safetensors + optimizer.safetensors +
    training_state.json (what the relay carries); a single-file SOURCE becomes the DCP layout.
    OUT must be new or empty. Exact: the result resumes bit for bit like SOURCE (TRAINING.md).

    Example: colibri-model convert-checkpoint runs/micro/checkpoints/step_00001000 push/
    """
    from ..training import dcp_to_safetensors, is_dcp_checkpoint, safetensors_to_dcp

    if is_dcp_checkpoint(source):
        written = dcp_to_safetensors(source, out, weights_only=weights_only)
        click.echo(f"{source}: DCP -> single-file checkpoint {written}")
    else:
        if weights_only:
            raise UserError(f"{source}: --weights-only applies to a DCP source; this one is a single-file checkpoint")
        written = safetensors_to_dcp(source, out)
        click.echo(f"{source}: single-file -> DCP checkpoint {written}")
