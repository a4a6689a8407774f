"""Random-weight containers of a colibri-model preset's shapes, for the benchmarks.

The writer is colibri-int4's public `write_synthetic_container` (valid container, random weights,
about a minute for Micro's 3.7 GB); this module only turns a preset name into the checkpoint
config it takes, through colibri-model's public functions, and deletes the (big) file afterwards.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from colibri_int4 import SYNTHETIC_SCHEME, QuantScheme, write_synthetic_container
from colibri_model import checkpoint_config_dict, get_preset


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
