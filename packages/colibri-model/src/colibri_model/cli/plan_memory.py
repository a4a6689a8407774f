"""`colibri-model plan-memory`: will this training configuration fit that GPU? (registered in cli/__init__.py)

Prints the per-GPU plan of training/memory_plan.py as a table (or JSON) and exits 0 when the peak
fits the GPU's memory, 1 when it does not, 2 for bad input.
"""

from __future__ import annotations

import dataclasses
import json

import click

from .training import UserError, _model_config, _user_errors, dtype_options

GIB = 1 << 30


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def _print_table(plan, fit) -> None:
    chunk = "whole-batch logits" if plan.ce_chunk_tokens is None else f"CE in chunks of {plan.ce_chunk_tokens} tokens"
    click.echo(f"{plan.preset}: micro-batch {plan.micro_batch} x seq {plan.seq_len} "
               f"({plan.micro_batch * plan.seq_len:,} tokens), {plan.precision}, AC {plan.ac}, "
               f"{'FSDP over ' + str(plan.fsdp) + ' GPUs' if plan.fsdp > 1 else '1 GPU'}, "
               f"grad accumulation {plan.grad_accum}; compute path {plan.compute_path} ({chunk})")
    click.echo(f"{plan.total_params / 1e9:.3f}B parameters; per GPU, GiB:")
    rows = [("params (fp32 masters)", plan.params), ("grads (fp32)", plan.grads),
            ("optimizer (AdamW m+v, fp32)", plan.optimizer),
            ("bf16 compute copies" + (" (FSDP all-gather)" if plan.fsdp > 1 else ""), plan.compute_copies),
            ("buffers (RoPE tables, router)", plan.buffers),
            ("activations saved for backward", plan.activations)]
    for name, value in rows:
        click.echo(f"  {name:<40}{_gib(value)}")
    for kind, value in plan.activations_by_kind.items():
        if value:
            click.echo(f"    {kind:<38}{_gib(value)}")
    for layer, kinds in plan.activations_per_layer.items():
        detail = ", ".join(f"{k} {v / GIB:.3f}" for k, v in kinds.items())
        click.echo(f"    one {layer.replace('_', ' ')}: {sum(kinds.values()) / GIB:.3f} ({detail})")
    if plan.logits_returned:
        click.echo(f"  {'logits returned by the forward':<40}{_gib(plan.logits_returned)}")
    for name, value in plan.transients.items():
        click.echo(f"  {'transient: ' + name.replace('_', ' '):<40}{_gib(value)}")
    click.echo(f"  {'gradients alive at the peak':<40}{_gib(plan.grads_at_peak)}")
    click.echo(f"  {'peak allocated':<40}{_gib(plan.peak_allocated)}")
    click.echo(f"  {'margin (fragmentation, CUDA context)':<40}{_gib(plan.margin)}")
    click.echo(f"  {'peak on the device':<40}{_gib(plan.peak_device)}")
    for note in plan.notes:
        click.echo(f"  note: {note}")
    verdict = "fits" if fit["fits"] else "does NOT fit"
    click.echo(f"{fit['label']} ({fit['memory'] / GIB:.1f} GiB): {verdict}, headroom {fit['headroom'] / GIB:.2f} GiB")


def _compute_path_name(ctx, param, value: str) -> str:
    from ..training.activations import COMPUTE_PATHS, FORMER_PATH_NAMES

    value = FORMER_PATH_NAMES.get(value, value)  # the 0.1 series' names, still accepted
    if value not in COMPUTE_PATHS:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(COMPUTE_PATHS)}")
    return value


@click.command("plan-memory")
@click.option("--preset", default=None, help="Model preset (tiny, nano, micro, grande).")
@click.option("--config", "config_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A model config JSON instead of a preset.")
@click.option("--micro-batch", required=True, type=click.IntRange(min=1), help="Sequences per GPU per forward.")
@click.option("--seq", "--seq-len", "seq_len", required=True, type=click.IntRange(min=1), help="Sequence length.")
@click.option("--gpu", required=True,
              help="h100-sxm, h100-pcie, h100-nvl, h200, h200-nvl, a100-80gb, a100-40gb, l40s, l4, a10g, "
                   "rtx4090, rtx3090, or a device name as nvidia-smi prints it.")
@click.option("--fsdp", default=1, show_default=True, type=click.IntRange(min=1),
              help="GPUs the model is sharded over (FSDP2); 1: one GPU, no sharding.")
@click.option("--ac", type=click.Choice(["none", "selective", "full"]), default="none", show_default=True,
              help="Activation checkpointing (the trainer has none and full).")
@dtype_options("bf16", "f32", default="bf16", help="Training precision (bf16 autocast or f32).")
@click.option("--grad-accum", default=1, show_default=True, type=click.IntRange(min=1),
              help="Micro-batches per optimizer step (gradients stay alive across them).")
@click.option("--compute-path", default="bf16-experts", show_default=True, callback=_compute_path_name,
              metavar="[bf16-experts|fp32-experts]",
              help="bf16-experts: bf16 expert matmuls, fp32 router, chunked CE; fp32-experts: fp32 experts, "
                   "whole-batch logits.")
@click.option("--ce-chunk", default=None, type=click.IntRange(min=0),
              help="Cross-entropy chunk in tokens (0: whole-batch logits) [default: the compute path's].")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@_user_errors
def plan_memory_command(preset, config_path, micro_batch, seq_len, gpu, fsdp, ac, precision, grad_accum,
                        compute_path, ce_chunk, as_json):
    """Plan the per-GPU memory of a training run and say whether it fits the GPU.

    Pure arithmetic from the model config: fp32 masters, gradients and AdamW moments, bf16
    compute copies, activations per layer by kind, transients and a margin; exit status 1 when
    the peak does not fit. Example:

    \b
        colibri-model plan-memory --preset nano --micro-batch 8 --seq 2048 --gpu h100-sxm
    """
    from ..training.activations import COMPUTE_PATHS
    from ..training.gpus import UnknownGpuError, gpu_spec
    from ..training.memory_plan import MemoryPlanError, plan_memory

    if ac == "selective":
        raise UserError("--ac selective: the trainer has no selective activation checkpointing "
                        "(--activation-checkpointing checkpoints every block); plan --ac none or --ac full")
    config = _model_config(preset, config_path)
    if config is None:
        raise UserError("give --preset or --config")
    try:
        spec = gpu_spec(gpu)
    except UnknownGpuError as exc:
        raise UserError(f"--gpu: {exc}") from None
    path = COMPUTE_PATHS[compute_path]
    if ce_chunk is not None:
        path = dataclasses.replace(path, ce_chunk_tokens=ce_chunk or None)
    try:
        plan = plan_memory(config, micro_batch=micro_batch, seq_len=seq_len, precision=precision, ac=ac,
                           fsdp=fsdp, grad_accum=grad_accum, path=path)
    except MemoryPlanError as exc:
        raise UserError(str(exc)) from None
    fit = plan.fit(spec)
    if as_json:
        click.echo(json.dumps({**plan.to_dict(), "fit": fit}, indent=2))
    else:
        _print_table(plan, fit)
    if not fit["fits"]:
        raise SystemExit(1)
