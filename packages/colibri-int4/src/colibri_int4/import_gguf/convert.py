"""GGUF file -> container, tensor by tensor, through the exporter's body writer (export.py).

1. Metadata -> the transformers config.json it stands for (metadata.py) -> the Colibri config,
   by import-hf's own mapping (`colibri_config_from_hf`: every field mapped or refused).
2. Names: each Colibri tensor's Hugging Face name (the family's `NAMES`, as import-hf reads it)
   goes through gguf-py's `TensorNameMap` for the architecture, the table llama.cpp's converter
   wrote the file with, to its GGUF name; it must be in the file with its shape, and every tensor
   of the file must have been used, so an unmapped weight fails before anything is written.
3. Values: `gguf.quants.dequantize` gives fp32; llama.cpp's converter permuted the rows of a
   llama-architecture q/k projection for its interleaved RoPE, which is undone here exactly
   as transformers' GGUF loader undoes it. The exporter then quantizes to the container's scheme,
   so the container is the one import-hf writes for the same (dequantized) weights.

Memory: one routed expert, or one block of rows of a large matrix (export.ROW_BLOCK_BYTES), in
fp32, never a whole stacked expert tensor: the file is memory-mapped and only the blocks asked for
are decoded.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..errors import GGUFImportError, HFImportError
from ..export import ContainerFileWriter, plan_with_header, write_body
from ..header import model_shape
from ..import_hf import FAMILIES, colibri_config_from_hf, quant_scheme
from ..model_shape import checkpoint_tensor_shapes
from ..scheme import QuantScheme
from .file_grid import file_grid
from .gguf_file import GGUFFile, gguf_module
from .metadata import hf_config_from_gguf
from .tokenizer_json import tokenizer_from_gguf


@dataclass
class GGUFImportReport:
    path: Path
    architecture: str  # general.architecture
    model_type: str  # the transformers family it was mapped to
    file_size: int
    gguf_tensor_bytes: int
    tensor_types: dict[str, int]  # GGUF tensor type -> how many tensors
    seconds: float
    config: dict
    grid: str | None = None  # the file's own int4 grid, when the import kept it (file_grid.py)


def _q_k_rows(rows: int, n_heads: int) -> np.ndarray:
    """GGUF row of each HF row of a permuted q/k projection. llama.cpp's converter stores HF row
    (head h, half j, i) at (h, i, j), pairing the two halves for rotate-every-two RoPE; this is
    transformers' `reverse_permute_weights` as an index."""
    half = rows // n_heads // 2
    r = np.arange(rows)
    head, j, i = r // (2 * half), (r % (2 * half)) // half, r % half
    return head * 2 * half + i * 2 + j


class GGUFTensors:
    """The GGUF's tensors seen through Colibri names: a `write_body` source (export.py)."""

    def __init__(self, file: GGUFFile, arch: str, model_type: str, table: dict[str, tuple[int, ...]], shape):
        gguf = gguf_module()
        self.file, self.table = file, table
        arch_enum = {name: enum for enum, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
        self.names = FAMILIES[model_type].NAMES
        self.map = gguf.TensorNameMap(arch_enum, shape.n_layers)
        # llama-architecture q/k rows were permuted for llama.cpp's rotate-every-two RoPE
        self.row_order: dict[str, np.ndarray] = {}
        self.resident: dict[str, str] = {}
        used: set[str] = set()
        self.kv_split: dict[str, tuple[str, str]] = {}
        for name, dims in table.items():
            if ".moe.experts." in name:
                continue
            hf_name = self.names.resident(name)
            gguf_name = self._gguf_name(hf_name, name)
            if name.endswith("attn.kv_b_proj.weight") and gguf_name not in file.tensors:
                used |= self._split_kv_b(name, gguf_name, dims, shape)
                continue
            self._check(gguf_name, dims, f"Colibri tensor '{name}'")
            self.resident[name] = gguf_name
            used.add(gguf_name)
            if arch == "llama" and name.endswith(("attn.q_proj.weight", "attn.k_proj.weight")):
                heads = shape.n_heads if ".q_proj" in name else shape.n_kv_heads
                self.row_order[name] = _q_k_rows(dims[0], heads)
        self.experts: dict[int, tuple[str, ...]] = {}
        for name, dims in table.items():
            if name.endswith("moe.experts.gate_proj"):
                n_experts, expert_dim, d = dims
                layer = int(name.split(".")[1])
                bases = [self._gguf_name(f"model.layers.{layer}.{self.names.moe}.experts.{part}", f"layer {layer} experts")
                         for part in self.names.parts]
                stacked = [base + ".weight" for base in bases]
                shapes = [(n_experts, expert_dim, d), (n_experts, expert_dim, d), (n_experts, d, expert_dim)]
                if shape.expert_proj_bias:  # GPT-OSS: [gate, up, down] then their biases
                    stacked += [base + ".bias" for base in bases]
                    shapes += [(n_experts, expert_dim), (n_experts, expert_dim), (n_experts, d)]
                for gguf_name, dims in zip(stacked, shapes):
                    self._check(gguf_name, dims, f"layer {layer} routed experts")
                self.experts[layer] = tuple(stacked)
                used |= set(stacked)
        unused = sorted(set(file.tensors) - used)
        if "rope_freqs.weight" in unused:
            raise GGUFImportError(
                f"{file.path}: tensor 'rope_freqs.weight' (llama3-style RoPE frequency factors) is not supported")
        if unused:
            raise GGUFImportError(
                f"{file.path}: tensor '{unused[0]}' has no place in the Colibri model ({len(unused)} unused); "
                "the metadata describes a different architecture"
            )

    def _split_kv_b(self, name: str, gguf_name: str, dims: tuple[int, ...], shape) -> set[str]:
        """MLA's kv_b_proj as llama.cpp stores it for weight absorption: per head, k_b transposed
        (`attn_k_b` [heads, kv_lora_rank, nope]) and v_b (`attn_v_b` [heads, v, kv_lora_rank])."""
        k_b, v_b = gguf_name.replace("attn_kv_b", "attn_k_b"), gguf_name.replace("attn_kv_b", "attn_v_b")
        heads, rank = shape.n_heads, shape.kv_lora_rank
        self._check(k_b, (heads, rank, shape.qk_nope_head_dim), f"Colibri tensor '{name}' (its k half)")
        self._check(v_b, (heads, shape.v_head_dim, rank), f"Colibri tensor '{name}' (its v half)")
        self.kv_split[name] = (k_b, v_b)
        return {k_b, v_b}

    def _kv_b(self, name: str) -> np.ndarray:
        """kv_b_proj [heads * (nope + v), rank] rebuilt from its halves (kept for the row blocks)."""
        if getattr(self, "_kv_cached", (None,))[0] != name:
            k_b, v_b = (self.file.tensor(n) for n in self.kv_split[name])
            both = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
            self._kv_cached = (name, both.reshape(self.table[name]))
        return self._kv_cached[1]

    def _gguf_name(self, hf_name: str, what: str) -> str:
        if hf_name.endswith("e_score_correction_bias"):  # the converter renames it to a ".bias"
            hf_name = hf_name[: -len("_bias")] + ".bias"
        name = self.map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GGUFImportError(f"{self.file.path}: no GGUF tensor name for {what} ({hf_name}) in gguf's table")
        # a parameter without a suffix in HF (GPT-OSS's sinks) is stored with ".weight"
        if name not in self.file.tensors and name + ".weight" in self.file.tensors and hf_name.endswith("sinks"):
            return name + ".weight"
        return name

    def _check(self, gguf_name: str, dims: tuple[int, ...], what: str) -> None:
        if gguf_name not in self.file.tensors:
            raise GGUFImportError(f"{self.file.path}: tensor '{gguf_name}' is missing ({what})")
        found = self.file.shape(gguf_name)
        # llama.cpp keeps a [1, d] gate as written or as [d]: the same values
        if found != tuple(dims) and [n for n in found if n != 1] != [n for n in dims if n != 1]:
            raise GGUFImportError(
                f"{self.file.path}: tensor '{gguf_name}' has shape {list(found)}, the metadata implies {list(dims)}")
        self.file.check_type(gguf_name)

    def _bytes(self, gguf_name: str, fraction: float = 1.0) -> int:
        return int(self.file.tensors[gguf_name].n_bytes * fraction)

    def read(self, name: str) -> tuple[np.ndarray, int]:
        if name in self.kv_split:
            return self._kv_b(name), sum(self._bytes(n) for n in self.kv_split[name])
        gguf_name = self.resident[name]
        if name in self.row_order:
            return self.file.rows(gguf_name, self.row_order[name]), self._bytes(gguf_name)
        array = self.file.tensor(gguf_name)
        return array.reshape(self.table[name]), self._bytes(gguf_name)  # a [d] gate read as [1, d]

    def read_rows(self, name: str, start: int, stop: int) -> tuple[np.ndarray, int]:
        if name in self.kv_split:
            rows = self._kv_b(name)
            return rows[start:stop], sum(self._bytes(n, (stop - start) / rows.shape[0]) for n in self.kv_split[name])
        gguf_name = self.resident[name]
        rows = self.row_order[name][start:stop] if name in self.row_order else slice(start, stop)
        total = self.file.shape(gguf_name)[0]
        return self.file.rows(gguf_name, rows), self._bytes(gguf_name, (stop - start) / total)

    def read_expert(self, layer: int, expert: int) -> tuple[list[np.ndarray], int]:
        names = self.experts[layer]  # [gate, up, down] (+ their biases)
        n_experts = self.file.shape(names[0])[0]
        return ([self.file.expert(n, expert) for n in names],
                sum(self._bytes(n, 1 / n_experts) for n in names))


def colibri_config_from_gguf(file: GGUFFile, name: str | None = None) -> tuple[dict, dict]:
    """(the transformers config.json object the GGUF's metadata stands for, the Colibri config)."""
    shapes = {tensor: file.shape(tensor) for tensor in file.tensors}
    hf_config = hf_config_from_gguf(file.metadata, shapes, str(file.path))
    default = f"{hf_config['model_type']}:{file.metadata.get('general.name') or file.path.stem}"
    try:
        config = colibri_config_from_hf(hf_config, f"{file.path} (metadata as config.json)", name or default)
    except HFImportError as exc:
        raise GGUFImportError(str(exc)) from None
    return hf_config, config


def import_gguf(
    gguf_path: str | os.PathLike, out_path: str | os.PathLike, scheme: QuantScheme | None = None,
    name: str | None = None, progress: bool = False, *, keep_file_grid: bool | None = None,
) -> GGUFImportReport:
    """Convert a GGUF file into a container at `out_path`.

    `keep_file_grid` (default: True when no `scheme` is given): where most of the bytes that
    become int4 are Q4_0, Q4_1 or Q4_K blocks, take the int4 grouping that holds them exactly
    instead of the scheme's (file_grid.py); the report's `grid` says what was kept.

    >>> import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2.coli", quant_scheme("int4"))  # doctest: +SKIP
    """
    if keep_file_grid is None:
        keep_file_grid = scheme is None
    scheme = scheme or quant_scheme("int4")
    started = time.perf_counter()
    with GGUFFile(gguf_path) as file:
        arch = file.metadata.get("general.architecture")
        hf_config, config = colibri_config_from_gguf(file, name)
        shape = model_shape(config)
        table = checkpoint_tensor_shapes(shape)
        source = GGUFTensors(file, arch, hf_config["model_type"], table, shape)
        tokenizer, tokenizer_config = tokenizer_from_gguf(file.metadata, str(file.path))
        grid = file_grid(source, scheme) if keep_file_grid else None
        if grid is not None:
            scheme = grid.scheme
        try:
            plan, json_length = plan_with_header(config, shape, scheme, len(tokenizer), tokenizer_config)
        except ValueError as exc:
            raise GGUFImportError(f"{file.path}: cannot quantize with this scheme: {exc}") from None
        types: dict[str, int] = {}
        for tensor in file.tensors:
            types[file.type_name(tensor)] = types.get(file.type_name(tensor), 0) + 1
        total = file.nbytes
        with ContainerFileWriter(out_path, config, scheme, plan, json_length, tokenizer_config) as writer:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="import-gguf", disable=not progress)
            writer.crcs.update(write_body(writer.fd, source, plan, scheme, tokenizer, bar))
            bar.close()
    return GGUFImportReport(Path(out_path), arch, hf_config["model_type"], plan.file_size, total, types,
                            time.perf_counter() - started, config, grid.describe() if grid else None)
