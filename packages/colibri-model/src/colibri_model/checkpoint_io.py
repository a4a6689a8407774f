"""The files of a model checkpoint: `config.json` + `model.safetensors` (+ optional `tokenizer.json`),
written and read without the model class (checkpoint.py builds the model; model.py's
`from_pretrained` reads through here, so the two never import each other).

The format is specified in colibri-spec's CHECKPOINT.md; it is the seam other packages read. No
pickle: the tensors are safetensors, everything else JSON. Files are written under temporary names
and renamed into place, so a crash mid-save never leaves a file that looks whole but is not.
`read_checkpoint` also accepts a Hugging Face repo id (`owner/name`) when huggingface_hub is
installed and the Hub reachable, like `PyTorchModelHubMixin.from_pretrained`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from colibri_spec import (
    CONFIG_FILE,
    FORMAT_VERSION,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    CheckpointFormatError,
    ColibriConfig,
    checkpoint_tensor_shapes,
    config_to_checkpoint_json,
    read_config,
)
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .tensor_names import held_dtype

__all__ = ["load_tensors", "read_checkpoint", "save_checkpoint"]


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


def read_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None) -> tuple[ColibriConfig, dict[str, torch.Tensor]]:
    """(config, tensors) of a checkpoint directory (or Hub repo id), the tensors checked by name
    and shape against the config's tensor table and held as `load_tensors` says."""
    directory = _resolve(path)
    config = read_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointFormatError(f"{weights}: missing")
    try:
        state, _ = load_tensors(weights, dtype)
    except (SafetensorError, OSError) as exc:
        raise CheckpointFormatError(f"{weights}: unreadable safetensors file ({exc})") from None
    table = checkpoint_tensor_shapes(config)
    missing, unexpected = set(table) - set(state), set(state) - set(table)
    if missing or unexpected:
        detail = []
        if missing:
            detail.append(f"missing {sorted(missing)[:3]}")
        if unexpected:
            detail.append(f"unexpected {sorted(unexpected)[:3]}")
        raise CheckpointFormatError(f"{weights}: tensors do not match config.json ({'; '.join(detail)})")
    for name, shape in table.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointFormatError(
                f"{weights}: {name} has shape {tuple(state[name].shape)}, config.json implies {shape}"
            )
    return config, state
