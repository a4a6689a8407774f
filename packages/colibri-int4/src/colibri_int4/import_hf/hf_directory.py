"""A Hugging Face checkpoint directory, read without torch: config.json, the safetensors shards
(`model.safetensors` or the shards of `model.safetensors.index.json`), tokenizer.json and the
chat template.

Opening reads only the shards' headers (a few KB each); a tensor is read with one `pread` when
asked for, so converting a 60 GB checkpoint holds one tensor at a time, never a shard. Every
shard stays open (one file descriptor each) until `close`. Block-scaled FP8 weights (DeepSeek's
own release: F8_E4M3 beside a `weight_scale_inv`) are paired at open and read back dequantized
to fp32 (fp8_weights.py); their scale tensors are not among `names`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..checkpoint import SafetensorsFile
from ..errors import CheckpointError, HFImportError
from ..header import TokenizerConfig
from .fp8_weights import FP8Weights

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_json(path: Path, required: bool = True):
    if not path.is_file():
        if required:
            raise HFImportError(f"{path}: missing")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFImportError(f"{path}: not valid JSON ({exc})") from None


class HFDirectory:
    """The files of one checkpoint directory. `tensor(name)` is fp32 numpy (BF16, F16, F32, and
    F8_E4M3 times its block scales)."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory)
        if not self.path.is_dir():
            raise HFImportError(f"{self.path}: not a directory")
        config = read_json(self.path / "config.json")
        if not isinstance(config, dict):
            raise HFImportError(f"{self.path / 'config.json'}: expected a JSON object")
        self.config: dict = config
        self._shards: dict[str, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}  # tensor name -> its shard
        try:
            self._open_shards()
        except BaseException:
            self.close()
            raise

    def _open_shards(self) -> None:
        index = read_json(self.path / INDEX_FILE, required=False)
        if index is not None:
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFImportError(f"{self.path / INDEX_FILE}: no weight_map")
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_FILE).is_file():
            files, weight_map = [SINGLE_FILE], None
        else:
            raise HFImportError(f"{self.path}: no {SINGLE_FILE} and no {INDEX_FILE} (only safetensors weights are read)")
        for file in files:
            if "/" in file or file.startswith("."):
                raise HFImportError(f"{self.path / INDEX_FILE}: shard name {file!r} leaves the directory")
            try:
                shard = SafetensorsFile(self.path / file)
            except CheckpointError as exc:
                raise HFImportError(str(exc)) from None
            self._shards[file] = shard
            for name in shard.entries:
                if name in self._where:
                    raise HFImportError(f"{shard.path}: tensor '{name}' is also in {self._where[name].path.name}")
                self._where[name] = shard
        if weight_map is not None:
            for name, file in weight_map.items():
                if self._where.get(name) is not self._shards[file]:
                    raise HFImportError(f"{self.path / INDEX_FILE}: tensor '{name}' is not in {file}")
        self.fp8 = FP8Weights(self._where, self.config, self.path / "config.json")

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()

    def __enter__(self) -> HFDirectory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- tensors ---------------------------------------------------------------------------
    @property
    def names(self) -> set[str]:
        """The checkpoint's tensors, FP8 block scales excluded (each belongs to its weight)."""
        return set(self._where) - set(self.fp8.scales.values())

    @property
    def nbytes(self) -> int:
        return sum(shard.nbytes(name) for name, shard in self._where.items())

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].entries[name][1]

    def tensor(self, name: str, index: int | None = None) -> tuple[np.ndarray, int]:
        """(fp32 array, bytes read) of tensor `name`, or of `tensor[index]` (one read)."""
        if name in self.fp8.scales:  # 2-D: `index` is a row
            if index is None:
                return self.fp8.rows(name, 0, self.shape(name)[0])
            rows, n = self.fp8.rows(name, index, index + 1)
            return rows[0], n
        shard = self._where[name]
        array = shard.read(name, index)
        n = shard.nbytes(name)
        return array, n if index is None else n // shard.entries[name][1][0]

    def rows(self, name: str, start: int, stop: int) -> tuple[np.ndarray, int]:
        """(fp32 `tensor[start:stop]`, bytes read), in one read."""
        if name in self.fp8.scales:
            return self.fp8.rows(name, start, stop)
        shard = self._where[name]
        rows = shard.read_rows(name, start, stop)
        return rows, shard.nbytes(name) * rows.shape[0] // shard.entries[name][1][0]

    # --- tokenizer -------------------------------------------------------------------------
    def tokenizer_json(self) -> bytes:
        path = self.path / "tokenizer.json"
        if not path.is_file():
            raise HFImportError(
                f"{path}: missing. import-hf carries a fast tokenizer; for a sentencepiece-only checkpoint "
                "write one first: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
            )
        return path.read_bytes()

    def tokenizer_config(self) -> TokenizerConfig:
        """Chat template, special tokens and end-of-generation ids (`read_tokenizer_config`)."""
        return read_tokenizer_config(self.path, self.config)


def read_tokenizer_config(directory: Path, config: dict) -> TokenizerConfig:
    """Chat template, special tokens and end-of-generation ids of the checkpoint in `directory`,
    from tokenizer_config.json, chat_template.jinja / chat_template.json, generation_config.json
    and `config` (its config.json); needs no weights."""
    tok = read_json(directory / "tokenizer_config.json", required=False) or {}
    template = tok.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if template is None:
        template = (read_json(directory / "chat_template.json", required=False) or {}).get("chat_template")
    generation = read_json(directory / "generation_config.json", required=False) or {}
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
    try:
        return TokenizerConfig(
            chat_template=template if isinstance(template, str) else None,
            bos_token=_token_text(tok.get("bos_token")),
            eos_token=_token_text(tok.get("eos_token")),
            pad_token=_token_text(tok.get("pad_token")),
            eos_token_ids=eos_ids,
            add_bos_token=bool(tok.get("add_bos_token", False)),
        )
    except ValueError as exc:
        raise HFImportError(f"{directory}: tokenizer settings: {str(exc).splitlines()[0]}") from None


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
