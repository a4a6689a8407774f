"""`colibri-int4`: export, import-hf, import-gguf, inspect, verify, dequantize and estimate containers.

Exit status, as for every Colibri command: 0 ok; 1 a check failed (a CRC-32 did not match, or
`verify` found any problem); 2 bad usage or bad input (unknown flag, bad choice, a malformed
checkpoint or container, an unwritable destination), with one line on stderr and no traceback. Progress bars go to stderr, and only when it is a terminal
unless `--progress` / `--no-progress` says otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from tqdm import tqdm

from . import __version__
from .container import Container
from .errors import Int4Error
from .scheme import QuantScheme

EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 1, 2


class InputError(click.ClickException):
    """Bad input (a malformed checkpoint or container, an unreadable path): one line, exit 2."""

    exit_code = EXIT_BAD_INPUT


class CheckFailed(click.ClickException):
    """A checksum did not match: one line, exit 1."""

    exit_code = EXIT_CHECK_FAILED


def _error(exc: Int4Error) -> click.ClickException:
    return (CheckFailed if exc.exit_code == EXIT_CHECK_FAILED else InputError)(str(exc))


def _resolve_progress(_ctx, _param, value: bool | None) -> bool:
    # The one place that decides: an explicit flag wins; otherwise bars only on a terminal.
    return sys.stderr.isatty() if value is None else value


PROGRESS = click.option("--progress/--no-progress", default=None, callback=_resolve_progress,
                        help="Progress bar on stderr [default: only when stderr is a terminal].")

_DTYPES = click.Choice(["int4", "int8", "bf16"])
_EMBED_DTYPES = click.Choice(["int4", "int6", "int8", "bf16"])  # int6 is for the embedding and head only
_INT6_HELP = "int6: 6.5 bits a weight at group 32, llama.cpp's Q6_K size for the head."


def _scheme_options(func):
    options = [
        click.option("--group", "group_size", type=click.Choice(["32", "64", "128"]), default="64", show_default=True,
                     help="Weights per int4 group (one 16-bit scale each)."),
        click.option("--sym/--asym", "symmetric", default=True, show_default=True,
                     help="Symmetric groups (scale only) or asymmetric (scale + zero: +16/G bits)."),
        click.option("--scale-dtype", type=click.Choice(["bf16", "fp16"]), default="bf16", show_default=True,
                     help="Storage dtype of scales and zeros."),
        click.option("--resident-dtype", type=_DTYPES, default="int8", show_default=True,
                     help="Attention, dense FFN and shared experts."),
        click.option("--embed-dtype", type=_EMBED_DTYPES, default="bf16", show_default=True,
                     help="embed.weight and lm_head.weight. " + _INT6_HELP),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _scheme(group_size: str, symmetric: bool, scale_dtype: str, resident_dtype: str, embed_dtype: str) -> QuantScheme:
    return QuantScheme(group_size=int(group_size), symmetric=symmetric, scale_dtype=scale_dtype,
                       resident_dtype=resident_dtype, embed_dtype=embed_dtype)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="colibri-int4")
def main() -> None:
    """The Colibri int4 container: one file with a resident region and 4 KiB-aligned,
    checksummed routed-expert blobs (see FORMAT.md).

    Exit status: 0 ok, 1 a check failed (e.g. verify found corruption, a checksum did not match),
    2 bad usage or bad input.
    """


@main.command()
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@_scheme_options
@PROGRESS
def export(checkpoint_dir: Path, out: Path, progress: bool, **scheme_args) -> None:
    """Quantize CHECKPOINT_DIR (config.json + model.safetensors) into the container OUT,
    streaming tensor by tensor."""
    from .export import export_checkpoint

    try:
        report = export_checkpoint(checkpoint_dir, out, _scheme(**scheme_args), progress=progress)
        with Container.open(out) as container:
            bpw = container.bits_per_weight
    except Int4Error as exc:
        raise _error(exc) from None
    except OSError as exc:
        raise InputError(f"{exc.filename or out}: {exc.strerror}") from None
    click.echo(
        f"wrote {out}: {_mb(report.file_size)} (resident {_mb(report.resident_bytes)}, experts "
        f"{_mb(report.expert_bytes)}, {bpw:.3f} bits/weight) in {report.seconds:.1f} s, "
        f"{report.mb_per_s:.1f} MB/s of checkpoint"
    )


def _summary(container: Container, with_experts: bool) -> dict:
    c = container.shape
    summary = {
        "path": str(container.path),
        "format_version": f"{container.version[0]}.{container.version[1]}",
        "config": container.config,
        "quantization": container.scheme.model_dump(),
        "file_size": container.file_size,
        "resident_bytes": container.resident_bytes,
        "expert_bytes": container.expert_bytes,
        "blob_length": container.blob_length,
        "n_routed_experts": len(container.header.experts.entries),
        "bits_per_weight": container.bits_per_weight,
        "bits_per_weight_total": 8 * container.file_size / container.total_weights(),
        "total_params": container.total_weights(),
        "expert_params": container.expert_weights(),
        "moe_layers": [c.moe_layers.start, c.moe_layers.stop],
        "tokenizer_bytes": container.header.tokenizer.length if container.header.tokenizer else 0,
        "tensors": [t.model_dump(exclude={"crc32"}) for t in container.header.tensors],
    }
    if with_experts:
        summary["experts"] = [e.model_dump() for e in container.header.experts.entries]
    return summary


def _quant_options(bf16_note: str | None = None, file_grid: bool = False):
    """The re-quantization options both importers take (the container's scheme). `file_grid`: a
    GGUF's own 4-bit grid, where it has one, is the default grouping (import_gguf/file_grid.py)."""
    bf16 = f"bf16 (everything bf16: {bf16_note})" if bf16_note else "bf16 (everything bf16)"
    from_file = (" [default: the file's own grid where int4 holds its blocks exactly (Q4_0: 32 --sym; Q4_1, "
                 "Q4_K: 32 --asym; fp16 scales), else 64 --sym]") if file_grid else ""
    options = [
        click.option("--quant", type=_DTYPES, default="int4", show_default=True,
                     help=f"Routed experts: int4 (resident int8), int8 (resident int8) or {bf16}. "
                          "Embeddings and LM head: int8, bf16 under --quant bf16."),
        click.option("--group", "group_size", type=click.Choice(["32", "64", "128"]),
                     default=None if file_grid else "64", show_default=not file_grid,
                     help="Weights per int4/int8 group (one 16-bit scale each)." + from_file),
        click.option("--sym/--asym", "symmetric", default=None if file_grid else True, show_default=not file_grid,
                     help="int4 groups with or without a zero." + from_file),
        click.option("--resident-dtype", type=_DTYPES, default=None,
                     help="Override --quant for attention, dense FFN, shared experts."),
        click.option("--embed-dtype", type=_EMBED_DTYPES, default=None,
                     help="Override --quant for embed.weight and lm_head.weight. " + _INT6_HELP),
    ]

    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command

    return apply


def _run_import(convert, out: Path, quant: str, group_size: str, symmetric: bool, resident_dtype: str | None,
                embed_dtype: str | None):
    """`convert(scheme)` with the options' scheme, then what the written container holds (its experts' bits
    per weight, or the whole file's without experts); the importers' errors as one line (exit 2)."""
    from .import_hf import quant_scheme

    try:
        # an option left unset (import-gguf's grouping) is the scheme's default (quant_scheme drops None)
        grouping = {"group_size": int(group_size)} if group_size else {}
        scheme = quant_scheme(quant, symmetric=symmetric, resident_dtype=resident_dtype, embed_dtype=embed_dtype,
                              **grouping)
        report = convert(scheme)
        with Container.open(out) as container:
            if not container.header.experts.entries:  # a dense model: no expert bits to report
                whole = 8 * container.file_size / container.total_weights()
                return report, f"no routed experts, {whole:.3f} bits/weight in all"
            return report, f"experts {quant}, {container.bits_per_weight:.3f} bits/weight"
    except Int4Error as exc:
        raise _error(exc) from None
    except OSError as exc:
        raise InputError(f"{exc.filename or out}: {exc.strerror}") from None


@main.command("import-hf")
@click.argument("hf_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@_quant_options("lossless for a bf16 checkpoint")
@click.option("--name", default=None, help="The model name stored in the config [default: MODEL_TYPE:DIRNAME].")
@PROGRESS
def import_hf_command(hf_dir: Path, out: Path, quant: str, group_size: str, symmetric: bool, resident_dtype: str | None,
                      embed_dtype: str | None, name: str | None, progress: bool) -> None:
    """Convert a Hugging Face checkpoint directory (config.json, safetensors shards, tokenizer.json,
    chat template) into the container OUT, one tensor at a time.

    Families: qwen3_moe, qwen2_moe, olmoe, mixtral, llama (dense), deepseek_v3, deepseek_v2,
    gpt_oss. Weights in bf16/fp16/fp32, or block-scaled FP8 E4M3 (DeepSeek's own release, Qwen3's
    -FP8 releases), or GPT-OSS's MXFP4 experts: decoded, then re-quantized to --quant. A config
    field whose value Colibri cannot represent is refused by name and value (exit 2).
    """
    from .import_hf import import_hf

    report, weights = _run_import(lambda scheme: import_hf(hf_dir, out, scheme, name=name, progress=progress), out,
                                  quant, group_size, symmetric, resident_dtype, embed_dtype)
    click.echo(
        f"wrote {out}: {report.model_type}, {_mb(report.file_size)} from {_mb(report.checkpoint_bytes)} of "
        f"safetensors ({weights}) in {report.seconds:.1f} s"
    )


@main.command("import-gguf")
@click.argument("gguf_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@_quant_options(file_grid=True)
@click.option("--name", default=None, help="The model name stored in the config [default: MODEL_TYPE:general.name].")
@PROGRESS
def import_gguf_command(gguf_file: Path, out: Path, quant: str, group_size: str | None, symmetric: bool | None,
                        resident_dtype: str | None, embed_dtype: str | None, name: str | None, progress: bool) -> None:
    """Convert a GGUF file (llama.cpp's format) into the container OUT, one tensor at a time.
    Needs the gguf package: pip install 'colibri-int4[gguf]'.

    Architectures: llama (dense, and Mixtral's experts), qwen3moe, qwen2moe, olmoe, gpt-oss,
    deepseek2 (DeepSeek-V2/V3).
    Tensors in F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K..Q6_K or MXFP4 are
    dequantized by gguf-py, then re-quantized to --quant; without --group and --sym/--asym, on the
    file's own grid where int4 holds its blocks exactly (Q4_0, Q4_1, Q4_K: no weight moves). The
    tokenizer and chat template come from the file's metadata. A metadata key, tensor or tensor type
    Colibri has no place for is refused by name (exit 2).
    """
    from .import_gguf import import_gguf

    keep_grid = group_size is None and symmetric is None
    report, weights = _run_import(
        lambda scheme: import_gguf(gguf_file, out, scheme, name=name, progress=progress, keep_file_grid=keep_grid),
        out, quant, group_size, symmetric, resident_dtype, embed_dtype)
    types = ", ".join(f"{n} {kind}" for kind, n in sorted(report.tensor_types.items()))
    click.echo(
        f"wrote {out}: {report.architecture} as {report.model_type}, {_mb(report.file_size)} from "
        f"{_mb(report.gguf_tensor_bytes)} of GGUF tensors ({types}; {weights}) in {report.seconds:.1f} s"
    )
    if report.grid:
        click.echo(f"grid: {report.grid}")
    offset = sorted(set(report.tensor_types) & {"Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"})
    moe = report.config["n_dense_layers"] < report.config["n_layers"]
    if (offset and symmetric is not False and report.grid is None
            and ((quant == "int4" and moe) or "int4" in (resident_dtype, embed_dtype))):
        # symmetric int4 cannot hold a grid with a per-block minimum: measured on SmolLM2's Q4_1
        # file, KL 0.56 nats with --sym against 0.0019 with --asym --group 32 (bench/RESULTS.md)
        click.echo(f"note: {', '.join(offset)} blocks have a minimum (an asymmetric grid); "
                   "--asym --group 32 keeps them far closer than symmetric int4", err=True)


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable: includes every expert's offset and length.")
def inspect(file: Path, as_json: bool) -> None:
    """Summarise a container: config, scheme, sizes, bits per weight."""
    try:
        with Container.open(file) as container:
            summary = _summary(container, with_experts=as_json)
    except Int4Error as exc:
        raise _error(exc) from None
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    q = summary["quantization"]
    cfg = summary["config"]
    click.echo(f"{file}  (colibri-int4 {summary['format_version']})")
    click.echo(f"  model      d_model {cfg.get('d_model')}, {cfg.get('n_layers')} layers, {cfg.get('n_experts')} experts "
               f"x {cfg.get('expert_dim')}, vocab {cfg.get('vocab_size')}; {summary['total_params']:,} params")
    click.echo(f"  scheme     experts {q['expert_dtype']}, group {q['group_size']} {'sym' if q['symmetric'] else 'asym'}, "
               f"scales {q['scale_dtype']}, resident {q['resident_dtype']}, embeddings {q['embed_dtype']}")
    click.echo(f"  file       {_mb(summary['file_size'])} = resident {_mb(summary['resident_bytes'])} + experts "
               f"{_mb(summary['expert_bytes'])} ({summary['n_routed_experts']} blobs of {summary['blob_length']:,} B)")
    click.echo(f"  bits/weight experts {summary['bits_per_weight']:.3f}, whole file {summary['bits_per_weight_total']:.3f}")


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@PROGRESS
def verify(file: Path, progress: bool) -> None:
    """Check the header and every checksum; exit 1 on any failure."""
    try:
        with Container.open(file) as container:
            total = sum(length for _, _, length, _ in container.checksummed_ranges())
            with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
                report = container.verify(progress=bar.update)
    except Int4Error as exc:
        click.echo(f"FAILED: {exc}", err=True)
        sys.exit(EXIT_CHECK_FAILED)
    for failure in report.failures:
        click.echo(f"FAILED: {failure}", err=True)
    if not report.ok:
        sys.exit(EXIT_CHECK_FAILED)
    click.echo(f"OK: {report.checked} checksummed ranges, {_mb(report.bytes_checked)} verified")


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--dtype", type=click.Choice(["f32", "bf16"]), default="f32", show_default=True,
              help="dtype of the written matrices (1-D tensors stay fp32).")
@PROGRESS
def dequantize(file: Path, out_dir: Path, dtype: str, progress: bool) -> None:
    """Turn a container back into a checkpoint directory (CHECKPOINT.md)."""
    from .dequantize import dequantize_container

    try:
        dequantize_container(file, out_dir, dtype=dtype, progress=progress)
    except Int4Error as exc:
        raise _error(exc) from None
    except OSError as exc:
        raise InputError(f"{exc.filename or out_dir}: {exc.strerror}") from None
    click.echo(f"wrote {out_dir}")


@main.command()
@click.argument("config_json", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_scheme_options
@click.option("--tokenizer", "tokenizer_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="The tokenizer.json the container will carry [default: the tokenizer.json "
              "beside CONFIG_JSON, as `export` takes it from the checkpoint directory; none if absent].")
@click.option("--json", "as_json", is_flag=True, help="Print the estimate as JSON.")
def estimate(config_json: Path, tokenizer_path: Path | None, as_json: bool, **scheme_args) -> None:
    """Exact container size for a config.json and scheme, without any weights.

    Counts everything `export` writes: the header, the tokenizer, the resident region and the
    expert blobs with their alignment padding, so for a checkpoint's own config.json the
    result equals the exported file's size to the byte.
    """
    from .estimate import estimate_container_size

    if tokenizer_path is None and (config_json.parent / "tokenizer.json").is_file():
        tokenizer_path = config_json.parent / "tokenizer.json"
    try:
        tokenizer_length = tokenizer_path.stat().st_size if tokenizer_path is not None else 0
        config = json.loads(config_json.read_text(encoding="utf-8"))
        result = estimate_container_size(config, _scheme(**scheme_args), tokenizer_length=tokenizer_length)
    except (ValueError, OSError) as exc:
        raise InputError(f"{config_json}: {exc}") from None
    if as_json:
        click.echo(json.dumps({**result.as_dict(), "tokenizer_path": str(tokenizer_path) if tokenizer_path else None},
                              indent=1))
        return
    rest = result.file_size - result.resident_bytes - result.expert_bytes - result.tokenizer_bytes
    tokenizer = f"tokenizer {_mb(result.tokenizer_bytes)}" if result.tokenizer_bytes else "no tokenizer"
    click.echo(f"{_mb(result.file_size)} = resident {_mb(result.resident_bytes)} + experts {_mb(result.expert_bytes)} "
               f"+ {tokenizer} + header and alignment {_mb(rest)}; {result.total_params:,} params, "
               f"experts {result.bits_per_weight:.3f} bits/weight, whole file {result.bits_per_weight_total:.3f}")
