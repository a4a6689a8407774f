"""`colibri-spec`: check a file against its schema and show what it describes.

    colibri-spec config PATH     a checkpoint directory, its config.json, a bare config or a Hugging
                                 Face config.json -> the validated Colibri config (JSON)
    colibri-spec tensors PATH    the same PATH -> every checkpoint tensor with its shape
    colibri-spec metrics PATH    a run directory or metrics.jsonl, read strictly -> records, last step

Exit status: 0 the file is valid, 2 bad usage or a file that breaks its schema (one line, no
traceback). argparse, not click: this package depends on pydantic alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from . import __version__
from .checkpoint_config import CONFIG_FILE, parse_checkpoint_config
from .config import ColibriConfig
from .errors import SpecError
from .hf_config import colibri_config_from_hf
from .metrics import METRICS_FILE, parse_metrics_text
from .tensor_table import checkpoint_tensor_shapes


def read_any_config(path: Path) -> ColibriConfig:
    """The config of a checkpoint directory, a checkpoint's config.json, a bare config, or a
    Hugging Face config.json (told apart by `format_version` / `model_type`)."""
    file = path / CONFIG_FILE if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpecError(f"{file}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"{file}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and "format_version" in data:
        return parse_checkpoint_config(data, str(file))
    if isinstance(data, dict) and data.get("model_type", "colibri") != "colibri":
        return colibri_config_from_hf(data, file)
    try:
        return ColibriConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "config"
        raise SpecError(f"{file}: invalid config: {field}: {first['msg']} ({exc.error_count()} error(s))") from None


def _config(args: argparse.Namespace) -> None:
    print(read_any_config(Path(args.path)).to_json())


def _tensors(args: argparse.Namespace) -> None:
    for name, shape in checkpoint_tensor_shapes(read_any_config(Path(args.path))).items():
        print(f"{name}\t{list(shape)}")


def _metrics(args: argparse.Namespace) -> None:
    path = Path(args.path)
    file = path / METRICS_FILE if path.is_dir() else path
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{file}: cannot read ({exc.strerror or exc})") from None
    records = parse_metrics_text(text, str(file))
    last = records[-1].step if records else None
    print(json.dumps({"records": len(records), "last_step": last}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="colibri-spec", description="Check a Colibri file against its schema.")
    parser.add_argument("--version", action="version", version=f"colibri-spec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, run, help_text in (
        ("config", _config, "print the validated Colibri config of a checkpoint, config or HF config.json"),
        ("tensors", _tensors, "print every checkpoint tensor of that config with its shape"),
        ("metrics", _metrics, "read a run's metrics.jsonl strictly; print the record count and last step"),
    ):
        command = commands.add_parser(name, help=help_text, description=help_text)
        command.add_argument("path", help="a file or directory")
        command.set_defaults(run=run)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except SpecError as exc:
        print(f"colibri-spec: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
