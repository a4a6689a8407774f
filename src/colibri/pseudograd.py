"""A worker's contribution to a round: its pseudo-gradient, int8 blockwise with error feedback
(spec: PSEUDOGRAD.md), and its router state (biases, per-expert token counts).

The pseudo-gradient of a round is `base - local` for every trained tensor. Each tensor is
flattened, cut into blocks of `BLOCK` values, and each block stored as int8 levels with one fp32
scale (`absmax / 127`): 1 byte + 4/BLOCK per value, 3.9x smaller than fp32. What rounding loses is
kept by the worker (error feedback, `ErrorFeedback`) and added to its next round's pseudo-gradient,
so no update is lost, only delayed: the sum of what a worker sent over its rounds differs from the
sum of its true pseudo-gradients by one round's rounding at most.

The router's expert biases and token counts are not gradients (the bias moves by sign steps); they
travel raw in `router.safetensors` and merge by their own rules (outer_step.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FORMAT = "colibri-pseudograd"
FORMAT_VERSION = "1.0"
BLOCK = 256
PSEUDOGRAD_FILE = "pseudograd.safetensors"
ROUTER_FILE = "router.safetensors"


class PseudogradError(ValueError):
    """A contribution file that does not decode: wrong format or version, shapes that do not match
    the base, or values that are not finite. The message names the file and the tensor."""


def is_router_state(name: str) -> bool:
    """Router state that is not trained by gradients (merged by its own rule)."""
    return name.endswith(".router.expert_bias")


def encode_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tensor -> (int8 levels [n_blocks * BLOCK], fp32 scales [n_blocks])."""
    flat = x.detach().reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1) / 127.0
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    levels = torch.clamp(torch.round(blocks * inverse[:, None]), -127, 127).to(torch.int8)
    return levels.reshape(-1), scales


def decode_int8(levels: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    values = levels.view(-1, BLOCK).to(torch.float32) * scales[:, None]
    return values.reshape(-1)[:numel].reshape(shape)


class ErrorFeedback:
    """The worker's residuals: what int8 rounding left out of its last contribution, per tensor."""

    FILE = "error_feedback.safetensors"

    def __init__(self, directory: Path):
        self.path = Path(directory) / self.FILE
        self.residual: dict[str, torch.Tensor] = load_file(str(self.path)) if self.path.is_file() else {}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        save_file(self.residual, str(tmp))
        tmp.replace(self.path)


def write_pseudograd(path: Path, deltas: dict[str, torch.Tensor], feedback: ErrorFeedback | None) -> int:
    """Encode `deltas` (+ the residuals of `feedback`, which are then replaced) into `path`; returns
    its size in bytes."""
    tensors, shapes = {}, {}
    for name, delta in sorted(deltas.items()):
        value = delta.to(torch.float32)
        if feedback is not None and name in feedback.residual and feedback.residual[name].shape == value.shape:
            value = value + feedback.residual[name]
        levels, scales = encode_int8(value)
        if feedback is not None:
            feedback.residual[name] = value - decode_int8(levels, scales, tuple(value.shape))
        tensors[f"{name}.q"], tensors[f"{name}.scale"] = levels, scales
        shapes[name] = list(value.shape)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "block": str(BLOCK), "shapes": json.dumps(shapes)}
    save_file(tensors, str(path), metadata=meta)
    return path.stat().st_size


def read_pseudograd(path: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Decode `path`; every tensor of `expected` (name -> shape) must be there with its shape."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same error for the merger
        raise PseudogradError(f"{path}: not a safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise PseudogradError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    major = str(meta.get("format_version", "")).split(".")[0]
    if major != FORMAT_VERSION.split(".")[0]:
        raise PseudogradError(f"{path}: format_version {meta.get('format_version')} is not supported by this "
                              f"reader (supports {FORMAT_VERSION})")
    if meta.get("block") != str(BLOCK):
        raise PseudogradError(f"{path}: block {meta.get('block')}, this reader decodes block {BLOCK}")
    shapes = {k: tuple(v) for k, v in json.loads(meta.get("shapes", "{}")).items()}
    raw = load_file(str(path))
    out = {}
    for name, shape in expected.items():
        if shapes.get(name) != tuple(shape):
            raise PseudogradError(f"{path}: tensor {name} has shape {shapes.get(name)}, the base has {tuple(shape)}")
        levels, scales = raw.get(f"{name}.q"), raw.get(f"{name}.scale")
        n_blocks = -(-max(1, _numel(shape)) // BLOCK)
        if levels is None or scales is None or levels.dtype != torch.int8 or levels.numel() != n_blocks * BLOCK \
                or scales.numel() != n_blocks:
            raise PseudogradError(f"{path}: tensor {name} is missing or not {n_blocks} int8 blocks of {BLOCK}")
        if not torch.isfinite(scales).all():
            raise PseudogradError(f"{path}: tensor {name} has non-finite scales")
        out[name] = decode_int8(levels, scales, tuple(shape))
    extra = set(shapes) - set(expected)
    if extra:
        raise PseudogradError(f"{path}: tensors the base does not have: {sorted(extra)[:3]}")
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
