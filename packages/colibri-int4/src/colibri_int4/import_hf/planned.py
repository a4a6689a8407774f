"""A Hugging Face model planned before its weights exist here: config.json -> the container
`import-hf` would write, as a header without a file (`Container.planned`).

`colibri-stream plan Qwen3-30B-A3B/config.json` sizes a 60 GB checkpoint from its 1 KB config:
the mapping is the importer's own (`colibri_config_from_hf`, every field mapped or refused),
and the sizes are the exporter's planner's, so they equal what `import-hf --quant Q` writes
(the tokenizer.json, chat template and special tokens beside config.json are counted when
present, as the import carries them; without a tokenizer.json the planned file is short by
exactly its length, about 11 MB for Qwen3's). A GPT-OSS config that says its experts are MXFP4
is planned at the sizes import-hf writes: the experts decoded and re-quantized to `--quant`
(gpt-oss-20b: 13.16 GB at int4 g64, 22.72 GB at int8). So is DeepSeek-V3's published config,
with its FP8 quantization_config: the block-scaled weights are dequantized and re-quantized, so
it plans as its bf16 conversion does.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..container import Container
from ..errors import HFImportError
from .convert import QUANT_PRESETS, colibri_config_from_hf, quant_scheme
from .hf_directory import read_json, read_tokenizer_config


def hf_config_path(source: str | os.PathLike) -> Path:
    """config.json itself, or the config.json of an HF directory (weights need not be there)."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise HFImportError(f"{path}: missing (give a config.json or a directory holding one)")
    return path


def is_hf_config(source: str | os.PathLike) -> bool:
    """Whether `source` names an HF config (a .json file or a directory) rather than a container."""
    path = Path(source)
    return path.is_dir() or path.suffix.lower() == ".json"


def read_hf_config(source: str | os.PathLike) -> tuple[dict, Path, int]:
    """(Colibri config, the config.json path, bytes of the tokenizer.json beside it or 0); the
    config's name is the one `import-hf` gives (model_type:directory name)."""
    path = hf_config_path(source)
    data = read_json(path)
    config = colibri_config_from_hf(data, path, f"{data.get('model_type') if isinstance(data, dict) else '?'}:"
                                                f"{path.resolve().parent.name}")
    tokenizer = path.parent / "tokenizer.json"
    return config, path, tokenizer.stat().st_size if tokenizer.is_file() else 0


def planned_container(source: str | os.PathLike, quant: str = "int4", group_size: int = 64) -> Container:
    """The container `import-hf SOURCE --quant QUANT --group G` would write, without its file."""
    config, path, tokenizer_length = read_hf_config(source)
    tokenizer_config = read_tokenizer_config(path.parent, read_json(path))
    return Container.planned(config, quant_scheme(quant, group_size), tokenizer_length, where=path,
                             tokenizer_config=tokenizer_config)


def sizes_by_quant(source: str | os.PathLike, group_size: int = 64) -> dict[str, Container]:
    """The planned container for each `--quant` preset (bf16, int8, int4): `file_size`,
    `blob_length`, `expert_bytes`, `resident_bytes`."""
    return {q: planned_container(source, q, group_size) for q in QUANT_PRESETS}
