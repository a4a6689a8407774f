"""Model checkpoints: `config.json` + `model.safetensors` (+ optional `tokenizer.json`).

The format is specified in CHECKPOINT.md; it is the seam other packages read. No pickle: the
tensors are safetensors, everything else JSON. Files are written under temporary names and
renamed into place, so a crash mid-save never leaves a file that looks whole but is not.

`load_checkpoint` also accepts a Hugging Face repo id (`owner/name`) when huggingface_hub is
installed and the Hub reachable, like `PyTorchModelHubMixin.from_pretrained`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ColibriConfig
from .tensor_names import held_dtype

FORMAT_VERSION = "1.0"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"


class CheckpointFormatError(ValueError):
    """A checkpoint that this version cannot read; the message says which file and why."""


def _major(version: str) -> str:
    return str(version).split(".")[0]


MODEL_TYPE = "colibri"


def checkpoint_config_dict(config: ColibriConfig) -> dict:
    """The config.json object of a checkpoint of `config` (CHECKPOINT.md): the config's fields
    plus `format_version` and `model_type`. `parse_checkpoint_config` reads it back."""
    return {"format_version": FORMAT_VERSION, "model_type": MODEL_TYPE, **config.to_dict()}


def config_to_checkpoint_json(config: ColibriConfig) -> str:
    return json.dumps(checkpoint_config_dict(config), indent=2) + "\n"


def read_config(directory: str | os.PathLike) -> ColibriConfig:
    """Parse and validate `config.json` of a checkpoint directory."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: missing (not a Colibri checkpoint directory)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointFormatError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object")
    return parse_checkpoint_config(data, str(path))


def parse_checkpoint_config(data: dict, where: str) -> ColibriConfig:
    """The validated `ColibriConfig` of a checkpoint's config.json object: the one reader of
    that format, for checkpoint directories and for the copy an int4 container carries.
    `where` names the source in errors (every error is a `CheckpointFormatError`).

    `model_type` is required, like `format_version`: every writer has always written it, and it
    is what tells a Colibri config.json from another model's config.json of the same shape.
    """
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{where}: expected a JSON object, got {type(data).__name__}")
    data = dict(data)
    version = data.pop("format_version", None)
    if version is None:
        raise CheckpointFormatError(f"{where}: no format_version field")
    if _major(version) != _major(FORMAT_VERSION):
        raise CheckpointFormatError(
            f"{where}: checkpoint format_version {version} is not supported "
            f"(this colibri-model reads {FORMAT_VERSION})"
        )
    if "model_type" not in data:
        raise CheckpointFormatError(f"{where}: no model_type field (expected {MODEL_TYPE!r})")
    model_type = data.pop("model_type")
    if model_type != MODEL_TYPE:
        raise CheckpointFormatError(f"{where}: model_type {model_type!r} is not {MODEL_TYPE!r}")
    try:
        return ColibriConfig.model_validate(data)
    except ValueError as exc:
        first = str(exc).splitlines()
        raise CheckpointFormatError(f"{where}: invalid config: {' '.join(first[:3])}") from None


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(model, directory: str | os.PathLike, tokenizer_json: str | None = None) -> Path:
    """Write `model`'s config and weights to `directory` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "format_version": FORMAT_VERSION})
    os.replace(tmp, directory / WEIGHTS_FILE)
    _atomic_write_text(directory / CONFIG_FILE, config_to_checkpoint_json(model.config))
    if tokenizer_json is not None:
        _atomic_write_text(directory / TOKENIZER_FILE, tokenizer_json)
    return directory


def _resolve(path: str | os.PathLike) -> Path:
    local = Path(path)
    if local.is_dir():
        return local
    text = str(path)
    if text.count("/") == 1 and not local.exists() and not text.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise CheckpointFormatError(
                f"{text}: not a local directory, and huggingface_hub is not installed to fetch it "
                "(pip install 'colibri-model[hub]')"
            ) from None
        return Path(snapshot_download(text, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE]))
    raise CheckpointFormatError(f"{text}: no such checkpoint directory")


def load_tensors(path: str | os.PathLike, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, each tensor in memory that torch allocated.

    NOTE: safetensors maps the file and hands out views at `8 + header length + offset` bytes
    past a page boundary, so a view's address mod 64 follows the length of the JSON header.
    MKL's sgemm takes an alignment-dependent path for a product with one row (an expert that
    got exactly one token in `_grouped_mm`): the same values at an address 8 mod 16 and at one
    0 mod 16 differ in the last bit. A resumed run then drifted from the straight run by 1 ulp
    whenever the header length was unlucky. A copy has the 64-byte alignment of
    every tensor torch allocates, so loaded weights compute with exactly the bits that freshly
    trained ones do. One tensor is copied at a time, and with `dtype` floating tensors are
    converted straight from the file (no full-precision copy) to the dtype `held_dtype` gives
    (1-D tensors stay fp32): the peak is the result plus one tensor.
    """
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {}
        for name in f.keys():
            view = f.get_tensor(name)
            target = held_dtype(view.shape, dtype, name) if dtype is not None and view.is_floating_point() else view.dtype
            tensors[name] = view.to(target) if view.dtype != target else view.clone()
    return tensors, metadata


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None):
    """Build a ColibriForCausalLM from a checkpoint directory (or Hub repo id). With `dtype`,
    tensors are held as `held_dtype` says (1-D tensors fp32, the rest `dtype`); without, as
    stored (`expert_bias` always fp32)."""
    from .model import ColibriForCausalLM

    directory = _resolve(path)
    config = read_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointFormatError(f"{weights}: missing")
    try:
        state, _ = load_tensors(weights, dtype)
    except (SafetensorError, OSError) as exc:
        raise CheckpointFormatError(f"{weights}: unreadable safetensors file ({exc})") from None
    with torch.device("meta"):
        model = ColibriForCausalLM(config)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        detail = []
        if missing:
            detail.append(f"missing {sorted(missing)[:3]}")
        if unexpected:
            detail.append(f"unexpected {sorted(unexpected)[:3]}")
        raise CheckpointFormatError(f"{weights}: tensors do not match config.json ({'; '.join(detail)})")
    for name, tensor in model.state_dict().items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointFormatError(
                f"{weights}: {name} has shape {tuple(state[name].shape)}, config.json implies {tuple(tensor.shape)}"
            )
    model.load_state_dict(state, assign=True)
    # Buffers that are not saved (token counters) must be materialised off the meta device.
    for layer in model.moe_layers():
        layer.router.tokens_per_expert = torch.zeros(config.n_experts, dtype=torch.float32)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias = layer.router.expert_bias.float()
    if device is not None:
        model.to(device)
    return model
