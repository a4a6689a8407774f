"""Random-weight containers of a colibri-model preset's shapes, for the benchmarks; and
`export_random_model`, a random colibri-model of any config exported for real (tests, benchmarks).

The writer is colibri-int4's public `write_synthetic_container` (valid container, random weights,
about a minute for Micro's 3.7 GB); this module only turns a preset name into the checkpoint
config it takes, through colibri-model's public functions, and deletes the (big) file afterwards.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from colibri_int4 import SYNTHETIC_SCHEME, QuantScheme, export_checkpoint, write_synthetic_container
from colibri_model import ColibriConfig, checkpoint_config_dict, get_preset


def write_preset_container(
    out_path: str | os.PathLike, preset: str = "micro", seed: int = 0, scheme: QuantScheme = SYNTHETIC_SCHEME,
    **overrides,
) -> Path:
    """Write a container of the preset's shapes (with config `overrides`) and random weights."""
    config = checkpoint_config_dict(get_preset(preset, **overrides))
    return write_synthetic_container(out_path, config, scheme, seed)


@contextlib.contextmanager
def synthetic_container(
    directory: str | os.PathLike, preset: str = "micro", seed: int = 0, **overrides
) -> Iterator[Path]:
    """Write a preset-shaped random container into `directory` and delete it on exit."""
    path = Path(directory) / f"synthetic-{preset}.coli"
    try:
        yield write_preset_container(path, preset, seed, **overrides)
    finally:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)


def export_random_model(directory: str | os.PathLike, config: ColibriConfig, scheme: QuantScheme | None = None,
                        seed: int = 0, bias_std: float = 0.0) -> Path:
    """A random `config` model saved to directory/ckpt and exported to directory/model.coli, its
    biases and attention sinks drawn at `bias_std` (they start at zero, where a GPT-OSS-shaped
    model's biases and sinks would do nothing a test could see)."""
    import torch
    from colibri_model import ColibriForCausalLM

    directory = Path(directory)
    torch.manual_seed(seed)
    model = ColibriForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if bias_std and name.endswith(("bias", "sinks")):
                parameter.normal_(std=bias_std)
    model.save_pretrained(directory / "ckpt")
    export_checkpoint(directory / "ckpt", directory / "model.coli", scheme or QuantScheme(group_size=32))
    return directory / "model.coli"
