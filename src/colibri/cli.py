"""`colibri`: relay-driven training legs, the relay's status, and the proof-of-loop demo.

Exit status, as for every Colibri command: 0 ok; 1 a check failed (the leg stopped without
pushing because the lease was lost, training diverged, the relay refused: baton held, checksum);
2 bad usage or bad input (a flag, missing data, a store that holds no relay, a relay in the wrong
phase for the leg). Errors are one line on stderr, no traceback. Progress bars only when stderr
is a terminal, unless `--progress` / `--no-progress`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import __version__

# NOTE: relay_leg (torch, the trainer) is imported inside `train`, so that `colibri --help`,
# `--version` and each command's --help start without torch (tests/test_cli_startup.py).

EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 1, 2


def _error(message: str, exit_code: int) -> click.ClickException:
    error = click.ClickException(message)
    error.exit_code = exit_code
    return error


def _relay_error(exc: Exception) -> click.ClickException | None:
    """A colibri-relay error as a one-line click error with its own exit code, else None."""
    from colibri_relay import RelayError

    return _error(f"relay: {exc}", exc.exit_code) if isinstance(exc, RelayError) else None


def _resolve_progress(_ctx, _param, value: bool | None) -> bool:
    return sys.stderr.isatty() if value is None else value


# The relay's store as colibri-relay names it (`--store`, `$COLIBRI_RELAY_STORE`); `--relay` stays an alias.
STORE = click.option("--store", "--relay", "relay_spec", required=True, metavar="STORE", envvar="COLIBRI_RELAY_STORE",
                     help="hf://OWNER/REPO (endpoint from HF_ENDPOINT) or a LocalStore directory "
                          "[env: COLIBRI_RELAY_STORE].")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="colibri")
def main() -> None:
    """Colibri: train a fine-grained MoE in relay legs on one Hub repo, export, stream, evaluate.

    Exit status: 0 ok, 1 a check failed (e.g. the lease was lost, training diverged), 2 bad usage
    or bad input.
    """


@main.command()
@STORE
@click.option("--preset", help="Model preset for an empty relay (tiny, nano, micro, grande).")
@click.option("--data", "data_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Token shards made by `colibri-model prepare` (pretraining legs).")
@click.option("--sft", is_flag=True, help="Train a chat-SFT leg on --chat-data (starts from the relay's weights).")
@click.option("--chat-data", "chat_files", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Chat JSONL with `messages` (repeatable).")
@click.option("--leg-steps", type=click.IntRange(min=1), help="Optimizer steps in this leg.")
@click.option("--leg-hours", type=click.FloatRange(min=0, min_open=True), help="Wall-clock length of this leg.")
@click.option("--decay", is_flag=True, help="This leg is the WSD decay (1-sqrt over --leg-steps).")
@click.option("--parallelism", type=click.Choice(["ddp", "fsdp"]),
              help="Under torchrun: replicate (DDP) or shard (FSDP2) on this machine [default: the run's].")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("colibri-work"),
              show_default=True, help="Local scratch: pulled payload, the leg's run, the push staging.")
@click.option("--holder", help="Name shown in RELAY.json and the ledger (default user@host:pid).")
@click.option("--lease-duration", type=click.FloatRange(min=0, min_open=True), default=1200.0, show_default=True,
              help="Seconds a lease lives without renewal (sized for the Hub's commit limits).")
@click.option("--heartbeat", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="Seconds between lease renewals.")
@click.option("--claim-timeout", type=click.FloatRange(min=0), help="Give up waiting for the baton after this long.")
@click.option("--seq-len", type=click.IntRange(min=8), help="New runs only: sequence length.")
@click.option("--batch-size", type=click.IntRange(min=1), help="New runs only: global sequences per step.")
@click.option("--micro-batch", type=click.IntRange(min=1), help="New runs only: sequences per forward pass.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), help="New runs only: peak learning rate.")
@click.option("--warmup-steps", type=click.IntRange(min=0), help="New runs only: warmup steps.")
@click.option("--eval-every", type=click.IntRange(min=0), help="New runs only: validation cadence in steps.")
@click.option("--bias-gamma", type=click.FloatRange(min=0),
              help="New runs only: the expert-bias balancer's step per optimizer step (the model's "
                   "bias_update_gamma) [default: the preset's, 1e-3, sized for runs of thousands of steps].")
@click.option("--progress/--no-progress", default=None, callback=_resolve_progress,
              help="Progress bar on stderr [default: only when stderr is a terminal].")
@click.option("--parallel", is_flag=True,
              help="Join the run's parallel rounds (DiLoCo) as worker --slot, instead of training one leg.")
@click.option("--slot", type=click.IntRange(min=0), help="Parallel: this worker's slot, 0..workers-1 (its data slice).")
@click.option("--rounds", "n_rounds", type=click.IntRange(min=1), help="Parallel: work until the run has merged this "
              "many rounds.")
@click.option("--workers", type=click.IntRange(min=1), help="Parallel, new runs only: worker slots per round.")
@click.option("--inner-steps", type=click.IntRange(min=1), help="Parallel, new runs only: optimizer steps per round (H).")
@click.option("--round-time", type=click.FloatRange(min=0, min_open=True), default=1800.0, show_default=True,
              help="Parallel, new runs only: seconds the merger waits for every slot before merging.")
@click.option("--min-round-time", type=click.FloatRange(min=0),
              help="Parallel, new runs only: the merger never merges sooner [default: half the round time].")
@click.option("--companion", metavar="STORE", help="Parallel, new runs only: the contributions repo "
              "[default: the relay's name + '-contributions'].")
@click.option("--outer-lr", type=click.FloatRange(min=0, min_open=True), default=0.7, show_default=True,
              help="Parallel, new runs only: the outer Nesterov SGD's learning rate.")
@click.option("--outer-momentum", type=click.FloatRange(min=0, max=1, max_open=True), default=0.9,
              show_default=True, help="Parallel, new runs only: the outer Nesterov SGD's momentum.")
@click.option("--poll", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Parallel: seconds between reads of the repos while waiting.")
@click.option("--no-plan-check", is_flag=True, help="Parallel: skip the check against the Hub's commit and API "
              "limits (for test hubs with scaled quotas).")
def train(relay_spec, preset, data_dir, sft, chat_files, leg_steps, leg_hours, decay, parallelism, work_dir, holder,
          lease_duration, heartbeat, claim_timeout, seq_len, batch_size, micro_batch, lr, warmup_steps,
          eval_every, bias_gamma, progress, parallel, slot, n_rounds, workers, inner_steps, round_time,
          min_round_time, companion, outer_lr, outer_momentum, poll, no_plan_check):
    """Train one leg: claim the baton, pull, train, push, release.

    \b
    Examples:
      colibri train --store ./relay --preset tiny --data shards/ --leg-steps 200
      colibri train --store hf://me/nano-run --data shards/ --leg-hours 6
      colibri train --store hf://me/nano-run --data shards/ --leg-steps 2000 --decay
      colibri train --store hf://me/nano-run --sft --chat-data chat.jsonl --leg-steps 1500
      torchrun --nproc-per-node 8 -m colibri.cli train --store hf://me/nano-run --data shards/ --leg-hours 6

    Parallel rounds (ROUNDS.md): every worker trains H inner steps from the round's base on its
    own data slice and posts its pseudo-gradient once; whoever holds the lease merges.

    \b
      colibri train --parallel --store hf://me/run --data shards/ --slot 0 --rounds 100 \\
          --preset nano --workers 4 --inner-steps 500 --round-time 1800
      colibri train --parallel --store hf://me/run --data shards/ --slot 1 --rounds 100

    Hyper-parameter options apply to a new run only; a resumed run keeps its own.
    Exit codes: 0 leg pushed (parallel: rounds done); 1 leg stopped without pushing (the lease was
    lost), training diverged, or the relay refused; 2 bad usage or bad input (options, data,
    checkpoint, store, a run of the other mode, a plan over the Hub's limits).
    """
    overrides = {k: v for k, v in dict(seq_len=seq_len, batch_size=batch_size, micro_batch=micro_batch, lr=lr,
                                       warmup_steps=warmup_steps, eval_every=eval_every).items() if v is not None}
    if "batch_size" in overrides and "micro_batch" not in overrides:
        overrides["micro_batch"] = overrides["batch_size"]
    if parallel:
        _train_parallel(relay_spec, preset, data_dir, work_dir, holder, lease_duration, heartbeat, overrides,
                        bias_gamma, progress, slot, n_rounds, workers, inner_steps, round_time, min_round_time,
                        companion, outer_lr, outer_momentum, poll, no_plan_check, sft or leg_steps or leg_hours)
        return
    if leg_steps is None and leg_hours is None:
        raise click.UsageError("give --leg-steps N or --leg-hours H")
    from colibri_model.training import TrainingDivergedError

    from .relay_leg import LegError, LegOptions, run_leg

    opts = LegOptions(relay=relay_spec, work_dir=work_dir, data_dir=data_dir, chat_files=list(chat_files), sft=sft,
                      preset=preset, leg_steps=leg_steps, leg_hours=leg_hours, decay=decay,
                      parallelism=parallelism, holder=holder,
                      lease_duration_s=lease_duration, heartbeat_s=heartbeat, claim_timeout_s=claim_timeout,
                      train_overrides=overrides, progress=progress,
                      model_overrides={} if bias_gamma is None else {"bias_update_gamma": bias_gamma},
                      log=lambda msg: click.echo(msg, err=False))
    try:
        outcome = run_leg(opts)
    except TrainingDivergedError as exc:
        raise _error(str(exc).splitlines()[0], EXIT_CHECK_FAILED) from None
    except (LegError, ValueError, OSError) as exc:
        raise _error(str(exc).splitlines()[0], EXIT_BAD_INPUT) from None
    except Exception as exc:  # relay errors are typed; show them in one line
        error = _relay_error(exc)
        if error is None:
            raise
        raise error from None
    if not outcome.ok:
        click.echo(f"leg not pushed: {outcome.reason}", err=True)
        sys.exit(EXIT_CHECK_FAILED)


def _train_parallel(relay_spec, preset, data_dir, work_dir, holder, lease_duration, heartbeat, overrides, bias_gamma,
                    progress, slot, n_rounds, workers, inner_steps, round_time, min_round_time, companion, outer_lr,
                    outer_momentum, poll, no_plan_check, leg_only) -> None:
    if leg_only:
        raise click.UsageError("--parallel trains rounds: --sft, --leg-steps and --leg-hours are for sequential legs")
    if slot is None or n_rounds is None or data_dir is None:
        raise click.UsageError("--parallel needs --slot I, --rounds N and --data DIR")
    from colibri_model.training import TrainingDivergedError

    from .parallel_round import ParallelError, ParallelOptions, run_parallel

    opts = ParallelOptions(relay=relay_spec, work_dir=work_dir, data_dir=data_dir, slot=slot, rounds=n_rounds,
                           companion=companion, preset=preset, workers=workers, inner_steps=inner_steps,
                           round_s=round_time, min_round_s=round_time / 2 if min_round_time is None else min_round_time,
                           outer_lr=outer_lr, outer_momentum=outer_momentum, holder=holder,
                           lease_duration_s=lease_duration, heartbeat_s=heartbeat, poll_s=poll,
                           check_plan=not no_plan_check, train_overrides=overrides, progress=progress,
                           model_overrides={} if bias_gamma is None else {"bias_update_gamma": bias_gamma},
                           log=lambda msg: click.echo(msg, err=False))
    try:
        run_parallel(opts)
    except TrainingDivergedError as exc:
        raise _error(str(exc).splitlines()[0], EXIT_CHECK_FAILED) from None
    except (ParallelError, ValueError, OSError) as exc:
        raise _error(str(exc).splitlines()[0], EXIT_BAD_INPUT) from None
    except Exception as exc:
        error = _relay_error(exc)
        if error is None:
            raise
        raise error from None


@main.command()
@STORE
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(relay_spec, as_json):
    """Show the baton, the ledger and the latest metrics of a relay."""
    from .relay_status import collect_status, render_status

    try:
        info = collect_status(relay_spec)
    except Exception as exc:
        error = _relay_error(exc)
        if error is None:
            raise
        raise error from None
    click.echo(json.dumps(info, indent=2, default=str) if as_json else render_status(info))


@main.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to write everything (default: a new temp directory).")
@click.option("--quick", is_flag=True, help="A shorter run (what the cross-package test uses).")
def demo(out, quick):
    """The proof-of-loop on this machine, offline: relay legs with a takeover, SFT, int4 export,
    streaming generation under a RAM budget, evaluation, the ledger."""
    from .demo import run_demo

    if out is not None and (out / "relay").exists():
        raise _error(f"demo: {out} already holds a relay; give a new --out", EXIT_BAD_INPUT)
    run_demo(out, quick=quick)


if __name__ == "__main__":
    main()
